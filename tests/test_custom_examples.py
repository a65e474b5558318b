"""The custom wrapper and handler of docs/custom_wrappers_and_handlers.md, tested as a user would.

The tests are written to be copied: each checks the example against a plain PyTorch loop or
against hand-made events, and imports nothing from steplib's own tests. The doc's code blocks
are checked to be verbatim copies of the example files and of this file.
"""

from __future__ import annotations

import contextlib
import copy
import doctest
import importlib.util
import math
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, Event, Events, TrainState, accumulate, clip, make_train_step, run

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wrapper = _load("custom_wrapper")
handler = _load("custom_handler")
adaptive_clip = wrapper.adaptive_clip
LossSpikeStop = handler.LossSpikeStop


# --- helpers: a model, batches, and the plain loop (the oracle) -------------------------------


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(sizes: list[int], *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in sizes
    ]


def mean_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def sum_loss(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), len(y)  # token-weighted


def agc_by_hand(model: nn.Module, clipping: float, eps: float = 1e-3) -> int:
    """The oracle's AGC, written out independently; returns how many units it clipped."""
    clipped = 0
    with torch.no_grad():
        for p in model.parameters():
            grad = p.grad
            assert grad is not None
            dims = tuple(range(1, p.ndim))
            w_norm = p.norm(dim=dims, keepdim=True) if p.ndim > 1 else p.norm()
            g_norm = grad.norm(dim=dims, keepdim=True) if p.ndim > 1 else grad.norm()
            limit = w_norm.clamp(min=eps) * clipping
            too_big = g_norm > limit
            clipped += int(too_big.sum())
            scaled = grad * (limit / g_norm.clamp(min=1e-6))
            grad.copy_(torch.where(too_big, scaled, grad))
    return clipped


HOST_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every way of reading a tensor on the host raise inside the block."""

    def refuse(name: str):
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> None:
            raise AssertionError(f"host read: Tensor.{name}")

        return read

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse(name))
        yield


# --- the wrapper ------------------------------------------------------------------------------


def test_adaptive_clip_matches_the_plain_loop_bit_for_bit() -> None:
    data = batches([8] * 6)
    model = tiny_model()
    reference = copy.deepcopy(model)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = adaptive_clip(make_train_step(mean_loss), clipping=0.01)
    for batch in data:
        state, _ = step(state, batch)

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    clipped = 0
    for batch in data:
        mean_loss(reference, batch).backward()
        clipped += agc_by_hand(reference, clipping=0.01)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    assert clipped > 0  # the test would prove nothing if no unit were ever clipped
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)


def test_adaptive_clip_sees_the_final_gradients_of_an_accumulated_clipped_window() -> None:
    micro = batches([3, 9, 5])  # unequal sizes: the window is token-weighted
    model = tiny_model()
    reference = copy.deepcopy(model)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = accumulate(
        clip(adaptive_clip(make_train_step(sum_loss), clipping=0.02), max_norm=0.5), 3
    )
    for batch in micro:
        state, _ = step(state, batch)
    assert state.step == 1 and state.window.size == 0

    x, y = (torch.cat(parts) for parts in zip(*micro, strict=True))
    mean_loss(reference, (x, y)).backward()  # one big batch
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)  # clip, then AGC
    agc_by_hand(reference, clipping=0.02)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_adaptive_clip_is_part_of_the_steps_description() -> None:
    step = clip(adaptive_clip(make_train_step(mean_loss), clipping=0.05), max_norm=1.0)
    assert step.describe()[0] == {"wrapper": "adaptive_clip", "clipping": 0.05, "eps": 0.001}
    with pytest.raises(ConfigError, match="applied twice"):
        adaptive_clip(step)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "0.01"])
def test_adaptive_clip_refuses_a_bad_setting_when_built(bad: object) -> None:
    with pytest.raises(ConfigError, match="clipping"):
        adaptive_clip(make_train_step(mean_loss), clipping=bad)


def test_adaptive_clip_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # no host reads
    state = TrainState.create(model=model, optimizer=optimizer)
    step = accumulate(adaptive_clip(make_train_step(sum_loss)), 2)
    data = batches([4, 4, 4, 4])
    with no_host_reads(monkeypatch):
        for batch in data:
            state, _ = step(state, batch)
    assert state.step == 2


# --- the handler ------------------------------------------------------------------------------


def step_end(step: int, loss: float) -> Event:
    """A hand-made step_end event carrying only what the handler reads."""
    return Event("step_end", state=None, output=SimpleNamespace(loss=torch.tensor(loss)), step=step)


def feed(spikes: object, losses: list[float]) -> list[object]:
    """Emit one step_end per loss through an Events the handler attached to."""
    events = spikes.attach(Events())  # type: ignore[attr-defined]
    return [events.emit(step_end(s, v)).stop for s, v in enumerate(losses, start=1)]


def test_loss_spike_stop_stops_at_the_first_check_after_a_spike() -> None:
    stops = feed(LossSpikeStop(factor=3.0, warmup=3, check_every=5), [1.0] * 6 + [10.0] + [1.0] * 5)
    assert stops[:9] == [None] * 9  # the spike at update 7 is read at the check of update 10
    assert stops[9] is not None and "update 7" in stops[9].reason  # type: ignore[attr-defined]


def test_loss_spike_stop_refuses_the_state_of_another_stopper() -> None:
    # The page's rule 4, followed by its own example: two stoppers of other settings swapped
    # at a resume (attached in another order) would carry on from each other's average.
    strict, loose = LossSpikeStop(factor=2.0), LossSpikeStop(factor=5.0)
    feed(strict, [1.0] * 3)
    with pytest.raises(ConfigError, match=r"LossSpikeStop built with factor=5.0.*factor=2.0"):
        loose.load_state_dict(strict.state_dict())
    again = LossSpikeStop(factor=2.0)
    again.load_state_dict(strict.state_dict())
    assert again.state_dict()["seen"] == 3


def test_loss_spike_stop_lets_a_smooth_run_and_its_warmup_pass() -> None:
    falling = [2.0 * 0.9**i for i in range(40)]
    assert feed(LossSpikeStop(check_every=5), falling) == [None] * 40
    early = [1.0, 50.0, 1.0, 1.0, 1.0, 1.0]  # a jump during the warmup is not a spike
    assert feed(LossSpikeStop(warmup=3, check_every=1), early) == [None] * 6


def test_loss_spike_stop_reads_the_host_only_when_it_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spikes = LossSpikeStop(factor=2.0, warmup=1, check_every=100)
    events = [step_end(s, v) for s, v in enumerate([1.0, 1.0, 9.0, 1.0], start=1)]
    with no_host_reads(monkeypatch):
        for event in events:
            spikes.update(event)
    stop = spikes.check(events[-1])
    assert stop is not None and spikes.spike_step == 3


def test_loss_spike_stop_continues_from_its_state_dict() -> None:
    losses = [1.0] * 5 + [8.0]
    whole = LossSpikeStop(warmup=2, check_every=1)
    for s, v in enumerate(losses, start=1):
        whole.update(step_end(s, v))
    first, resumed = LossSpikeStop(warmup=2, check_every=1), LossSpikeStop(warmup=2, check_every=1)
    for s, v in enumerate(losses[:3], start=1):
        first.update(step_end(s, v))
    resumed.load_state_dict(first.state_dict())
    for s, v in enumerate(losses[3:], start=4):
        resumed.update(step_end(s, v))
    assert resumed.check(step_end(6, 1.0)) == whole.check(step_end(6, 1.0)) is not None


@pytest.mark.parametrize(
    "settings", [{"factor": 1.0}, {"decay": 1.0}, {"warmup": 0}, {"check_every": 2.5}]
)
def test_loss_spike_stop_refuses_a_bad_setting(settings: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        LossSpikeStop(**settings)


def test_loss_spike_stop_ends_a_real_run_cleanly() -> None:
    ended = []
    model = nn.Linear(6, 3)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = batches([8] * 40)
    data[21] = (data[21][0] * 1000, data[21][1])  # a corrupted batch at update 22
    events = LossSpikeStop(check_every=10).attach(Events())
    events.on("fit_end", lambda e: ended.append(e.step))
    state = run(make_train_step(mean_loss), state, data, events=events)
    assert state.step == 30 and ended == [30]


# --- the examples run, their doctests pass, and the guide quotes them verbatim ----------------


def test_the_example_scripts_run() -> None:
    trained = wrapper.main()
    assert trained["last_loss"] < 0.5 * trained["first_loss"]
    assert handler.main() == {"step": 30, "spike_step": 25}


@pytest.mark.parametrize("module", [wrapper, handler], ids=lambda m: m.__name__)
def test_example_doctests_pass(module: ModuleType) -> None:
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


def test_the_guide_quotes_the_example_code_verbatim() -> None:
    guide = (ROOT / "docs" / "custom_wrappers_and_handlers.md").read_text()
    quoted = re.findall(r"<!-- from (\S+) -->\n```python\n(.*?)```", guide, re.DOTALL)
    assert {source for source, _ in quoted} == {
        "examples/custom_wrapper.py",
        "examples/custom_handler.py",
        "tests/test_custom_examples.py",
    }
    for source, code in quoted:
        assert code in (ROOT / source).read_text(), f"the guide's copy of {source} is out of date"

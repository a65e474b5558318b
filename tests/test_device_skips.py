"""Skips decided on the device (a fused optimizer; no scheduler or a ``LambdaLR``): the same
training as the host-decided reference, bit for bit, with the scheduler settled for readers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from steplib import (
    Events,
    TrainState,
    accumulate,
    amp_wrap,
    checkpoint_every,
    clip,
    make_train_step,
    run,
    skip_nonfinite,
)
from steplib.checkpoint import load, save
from steplib.errors import TooManySkipsError
from steplib.step import device_skips
from steplib.step.device_skips import decides_on_device
from steplib.testing import assert_no_host_sync
from tests.checkpoint_helpers import memory_dir
from tests.reference import make_batches, mean_loss, reference_loop, tiny_model

__all__ = ["memory_dir"]  # the fixture, used by name

POISONED = (2, 3)  # two updates in a row with an inf gradient


def _halving(position: int) -> float:
    return 1.0 / (1 + position)


def _batches(n: int = 7) -> list[Any]:
    batches = make_batches(n)
    for i in POISONED:
        x, y, mask = batches[i]
        batches[i] = (x * float("inf"), y, mask)
    return batches


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)


def _state(kind: str = "adamw", *, scheduler: bool = True, seed: int = 0) -> TrainState:
    model = tiny_model(seed)
    opt = _optimizer(model, kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _halving) if scheduler else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)


def _fp16_step(max_consecutive: int | None = 3) -> Any:
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16)
    return skip_nonfinite(clip(step, max_norm=1.0), max_consecutive=max_consecutive)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("scheduler", [True, False])
def test_law4_device_decided_skips_match_the_gradscaler_reference_bit_for_bit(
    kind: str, scheduler: bool
) -> None:
    batches = _batches()
    ref = _state(kind, scheduler=scheduler)
    records = reference_loop(
        ref.model,
        ref.optimizer,
        batches,
        mean_loss,
        scheduler=ref.scheduler,
        autocast_dtype=torch.float16,
        scaler=ref.scaler,
        max_norm=1.0,
    )
    state = _state(kind, scheduler=scheduler)
    step = _fp16_step()
    lrs = []
    for batch, record in zip(batches, records, strict=True):
        state, out = step(state, batch)
        assert isinstance(out.did_update, torch.Tensor)
        assert bool(out.did_update) == record["did_update"] == (not bool(out.skipped))
        lrs.append(float(out.lr))
    for got, want in zip(state.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(got, want)
    got_opt, want_opt = state.optimizer.state_dict()["state"], ref.optimizer.state_dict()["state"]
    for index, buffers in want_opt.items():
        for name, value in buffers.items():
            assert torch.equal(torch.as_tensor(got_opt[index][name]), torch.as_tensor(value))
    assert state.scaler.get_scale() == ref.scaler.get_scale()  # type: ignore[union-attr]
    assert isinstance(state.skipped_updates, torch.Tensor)  # decided on the device
    assert int(state.skipped_updates) == len(POISONED) and int(state.consecutive_skips) == 0
    assert state.step == len(batches)
    if scheduler:
        # Skipped updates leave the rate where it was: 1, 1/2, 1/3, 1/3, 1/3, 1/4, 1/5 (x base).
        base = 1e-2 if kind == "adamw" else 0.1
        assert lrs == [base * _halving(p) for p in (0, 1, 2, 2, 2, 3, 4)]
        assert state.scheduler.state_dict() == ref.scheduler.state_dict()  # type: ignore[union-attr]


def test_a_non_fused_optimizer_or_another_scheduler_keeps_the_host_decision() -> None:
    model = tiny_model(0)
    params = list(model.parameters())
    fused = torch.optim.AdamW(params, fused=True)
    assert decides_on_device(fused, None)
    assert decides_on_device(fused, torch.optim.lr_scheduler.LambdaLR(fused, _halving))
    assert not decides_on_device(fused, torch.optim.lr_scheduler.StepLR(fused, 2))
    foreach = torch.optim.AdamW(params)
    assert not decides_on_device(foreach, None)

    state = TrainState.create(
        model=model, optimizer=foreach, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10)
    )
    for batch in _batches(4):
        state, out = _fp16_step()(state, batch)
    assert int(state.skipped_updates) == 2 and isinstance(out.lr, torch.Tensor)
    with pytest.raises(AssertionError, match="__bool__"):  # the decision is read on the host
        assert_no_host_sync(_fp16_step(), state, _batches(4)[2:3])


def test_too_many_consecutive_skips_raise_on_the_device_path_too() -> None:
    state = _state()
    step = _fp16_step(max_consecutive=1)
    batches = _batches()
    for batch in batches[:3]:  # the first poisoned update is tolerated
        state, _ = step(state, batch)
    with pytest.raises(TooManySkipsError, match=r"2 consecutive updates.*max_consecutive=1"):
        step(state, batches[3])


@pytest.mark.parametrize("fused", [True, False], ids=["device", "host"])
def test_too_many_skips_names_the_update_it_stopped_at(fused: bool) -> None:
    # It said "at step 3" for the 4th update (the counter before it), where amp_wrap's
    # min_loss_scale and NonFiniteAlarm name the update itself (state.step after it).
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused or None)
    state = TrainState.create(model=model, optimizer=opt)
    step = skip_nonfinite(make_train_step(mean_loss), max_consecutive=1)
    batches = _batches()
    for batch in batches[:3]:  # POISONED: updates 3 and 4
        state, _ = step(state, batch)
    with pytest.raises(TooManySkipsError, match=r"2 consecutive .*, at step 4:"):
        step(state, batches[3])


def test_an_update_decided_on_the_device_leaves_the_given_state_untouched() -> None:
    state = _state()
    step = _fp16_step()
    batches = _batches()
    for batch in batches[:3]:
        state, _ = step(state, batch)
    skipped, consecutive = state.skipped_updates, state.consecutive_skips
    values = skipped.clone(), consecutive.clone()
    after, _ = step(state, batches[3])
    assert state.skipped_updates is skipped and state.consecutive_skips is consecutive
    assert (torch.equal(skipped, values[0]), torch.equal(consecutive, values[1])) == (True, True)
    assert after.skipped_updates is not skipped


def _train(state: TrainState, batches: list[Any], step: Callable[..., Any]) -> TrainState:
    for batch in batches:
        state, _ = step(state, batch)
    return state


def test_a_checkpoint_settles_the_scheduler_and_resume_is_bit_exact(memory_dir: str) -> None:
    batches = _batches(9)
    step = _fp16_step()
    state = _train(_state(), batches[:4], step)  # two applied, two skipped
    url = save(state, memory_dir)
    assert state.scheduler.last_epoch == 2  # type: ignore[union-attr]  # settled by the save: 2 applied updates
    want = _train(state, batches[4:], step)

    resumed = load(url, _state(seed=5))
    assert resumed.skipped_updates == 2
    resumed = _train(resumed, batches[4:], step)
    for got, expected in zip(resumed.model.parameters(), want.model.parameters(), strict=True):
        assert torch.equal(got, expected)
    assert int(resumed.skipped_updates) == int(want.skipped_updates) == 2
    assert resumed.scheduler.state_dict() == want.scheduler.state_dict()  # type: ignore[union-attr]


class _LandsAnUpdateLate(device_skips.HostCopy):
    """A host copy that lands one call after the next is made, as a CUDA copy can."""

    made: ClassVar[list[_LandsAnUpdateLate]] = []

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self.made.append(self)

    def ready(self) -> bool:
        return self.made[-1] is not self


def test_a_checkpoint_of_a_position_still_on_the_device_resumes_exactly(
    memory_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on CUDA: the scheduler object is an update behind its position when the save comes.
    # Before, the checkpoint held that older position and the resumed schedule ran late.
    monkeypatch.setattr(device_skips, "HostCopy", _LandsAnUpdateLate)
    _LandsAnUpdateLate.made.clear()
    batches, step, resumed_step = _batches(9), _fp16_step(), _fp16_step()
    state = _train(_state(), batches[:2], step)  # two applied updates
    assert state.scheduler.last_epoch == 1  # type: ignore[union-attr]  # the second in flight
    url = save(state, memory_dir, step=step)
    assert state.scheduler.last_epoch == 2  # type: ignore[union-attr]  # settled by the save
    want = _train(state, batches[2:], step)
    resumed = _train(load(url, _state(seed=5)), batches[2:], resumed_step)
    step.settle(want)  # both schedulers as their positions, to compare
    resumed_step.settle(resumed)
    for got, expected in zip(resumed.model.parameters(), want.model.parameters(), strict=True):
        assert torch.equal(got, expected)
    assert resumed.scheduler.state_dict() == want.scheduler.state_dict()  # type: ignore[union-attr]


def test_checkpoint_every_settles_the_position_through_the_step_run_calls(
    memory_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No step= named: the handler takes the step from the run's fit_start. Before, it had none
    # and saved the scheduler object's lagging position (on CPU nothing refused it).
    monkeypatch.setattr(device_skips, "HostCopy", _LandsAnUpdateLate)
    _LandsAnUpdateLate.made.clear()
    ckpt = checkpoint_every(memory_dir, every=2, at_end=False)
    run(_fp16_step(), _state(), _batches(9)[:2], events=[ckpt])  # two applied updates
    assert ckpt.last_saved is not None
    scheduler: Any = load(ckpt.last_saved, _state(seed=5)).scheduler
    assert scheduler.last_epoch == 2


def test_run_settles_the_scheduler_before_fit_end() -> None:
    seen = []
    events = Events().on("fit_end", lambda e: seen.append(e.state.scheduler.last_epoch))
    state = run(_fp16_step(), _state(), _batches(), events=events, max_epochs=1)
    scheduler: Any = state.scheduler
    assert seen == [5] and scheduler.last_epoch == 5  # 7 updates, 2 skipped


def test_accumulated_windows_decide_once_per_window() -> None:
    step = skip_nonfinite(accumulate(make_train_step(mean_loss), 2))
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _halving)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    outs = []
    for batch in _batches(8):  # windows (0,1) (2,3) (4,5) (6,7): the second is poisoned
        state, out = step(state, batch)
        outs.append(out)
    closed = [bool(o.did_update) for o in outs[1::2]]
    assert closed == [True, False, True, True]
    assert not any(bool(o.did_update) for o in outs[0::2])  # mid-window: no update
    assert sched.last_epoch == 3 and int(state.skipped_updates) == 1


def test_assert_no_host_sync_accepts_a_device_decided_skip_step() -> None:
    state = assert_no_host_sync(_fp16_step(max_consecutive=2), _state(), _batches())
    assert int(state.skipped_updates) == 2 and state.step == 7

"""A state that is not the newest of its run is refused (``steplib.lineage``).

A step returns a new ``TrainState``, but the model, its ``.grad``, the optimizer, the scheduler
and the scaler change in place. Before the refusal, an older state used again trained on in
silence: two updates counted as one, a window counting fewer micro-batches than ``.grad``
held, a run started again from the state given to a ``run`` that raised restarting its
counters on trained weights, a save recording counters its weights did not have.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics.regression import MeanSquaredError

from steplib import ConfigError, Events, TrainState, accumulate, iterate, make_train_step, run
from steplib.checkpoint import AsyncSaver, load, save
from steplib.handlers import evaluate, make_eval_step
from steplib.state import EMPTY_WINDOW
from steplib.step.compile import compile_step
from steplib.sweep import Copies, SweepSGD, sweep_step
from tests.checkpoint_helpers import memory_dir
from tests.host_reads import on_host_read
from tests.reference import make_batches, mean_loss, tiny_model, token_loss

__all__ = ["memory_dir"]  # the fixture, used by name

BATCHES = make_batches(8)
STALE = r"received a TrainState{whose} at update {step} \(micro-batch {micro}\), but the newest"


def _stale(step: int, micro: int, whose: str = "") -> str:
    return STALE.format(step=step, micro=micro, whose=whose)


def _state(seed: int = 0) -> TrainState:
    model = tiny_model(seed)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_step_called_twice_on_one_state_is_refused_before_it_changes_anything() -> None:
    state = _state()
    step = make_train_step(mean_loss)
    s1, _ = step(state, BATCHES[0])
    after_one = _params(state.model)
    # Before: s2.step == 1 while the model had taken two updates.
    with pytest.raises(ConfigError, match=_stale(0, 0) + r".*update 1 \(micro-batch 1\)"):
        step(state, BATCHES[0])
    assert _same(_params(state.model), after_one)
    s2, _ = step(s1, BATCHES[1])  # the returned state goes on
    assert (s2.step, s2.micro_step) == (2, 2)


def test_mid_window_a_state_used_again_is_refused_before_its_backward() -> None:
    state = _state()
    step = accumulate(make_train_step(mean_loss), 4)
    s1, _ = step(state, BATCHES[0])
    grads = _grads(state.model)
    # Before: .grad held two micro-batches while the window counted one.
    with pytest.raises(ConfigError, match=_stale(0, 0)):
        step(state, BATCHES[1])
    assert _same(_grads(state.model), grads)
    with pytest.raises(ConfigError, match=_stale(0, 0)):
        step.flush(state)
    s2, _ = step(s1, BATCHES[1])
    assert (s2.micro_step, s2.window.size) == (2, 2)


def _gan() -> tuple[TrainState, Any, Any]:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    state = TrainState.create(
        model={"G": g, "D": d},
        optimizer={
            "G": torch.optim.SGD(g.parameters(), lr=0.1),
            "D": torch.optim.SGD(d.parameters(), lr=0.1),
        },
    )

    def d_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
        return model["D"](model["G"](batch).detach()).mean() - model["D"](batch).mean()

    def g_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
        return -model["D"](model["G"](batch)).mean()

    d_step = make_train_step(d_loss, optimizer="D")
    g_step = make_train_step(g_loss, optimizer="G")
    return state, d_step, g_step


def test_each_optimizer_of_a_gan_refuses_its_own_stale_state() -> None:
    state, d_step, g_step = _gan()
    batch = torch.randn(8, 4)
    s1, _ = d_step(state, batch)
    with pytest.raises(ConfigError, match=_stale(0, 0, " of optimizer 'D'")):
        d_step(state, batch)
    # G's counters are its own: its state in `state` is still its newest ...
    s2, _ = g_step(state, batch)
    # ... but s2 carries D's state from before s1's update, refused at D's next step ...
    with pytest.raises(ConfigError, match=_stale(0, 0, " of optimizer 'D'")):
        d_step(s2, batch)
    with pytest.raises(ConfigError, match=_stale(0, 0, " of optimizer 'G'")):
        g_step(s1, batch)  # s1 carries G's state from before s2's update
    # The newest of each, put together, goes on.
    s3 = s2.with_lane(s1["D"])
    s3, _ = d_step(s3, batch)
    s3, _ = g_step(s3, batch)
    assert (s3["D"].step, s3["G"].step) == (2, 2)


class _BoomError(Exception):
    pass


def test_a_run_that_raised_leaves_the_given_state_refused_and_the_seen_one_usable() -> None:
    state = _state()
    step = make_train_step(mean_loss)
    seen: list[TrainState] = []

    def boom(event: Any) -> None:
        if event.state.step == 3:
            raise _BoomError

    events = Events().on("step_end", boom).on("exception", lambda e: seen.append(e.state))
    with pytest.raises(_BoomError):
        run(step, state, BATCHES, events=events)
    # Before: a second run from `state` restarted at update 0 on weights trained 3 updates.
    with pytest.raises(ConfigError, match=_stale(0, 0) + r".*update 3 \(micro-batch 3\)"):
        run(step, state, BATCHES, max_steps=5)
    final = run(step, seen[0], BATCHES, max_steps=5)
    assert (final.step, final.micro_step) == (5, 5)


def test_after_a_load_the_state_it_replaced_is_refused_by_a_step_and_a_save(
    memory_dir: str,
) -> None:
    state = _state()
    step = make_train_step(mean_loss)
    for batch in BATCHES[:2]:
        state, _ = step(state, batch)
    url = save(state, f"{memory_dir}/at2")
    later = state
    for batch in BATCHES[2:4]:
        later, _ = step(later, batch)
    loaded = load(url, later)  # back to update 2: a legitimate rewind
    assert loaded.step == 2
    with pytest.raises(ConfigError, match=_stale(4, 4) + r".*update 2 \(micro-batch 2\)"):
        step(later, BATCHES[4])
    # Before: this checkpoint recorded update 4 with the weights of update 2.
    with pytest.raises(ConfigError, match="save " + _stale(4, 4)):
        save(later, f"{memory_dir}/wrong")
    # The rewound run trains on, as the run did from update 2 the first time.
    again, _ = step(loaded, BATCHES[2])
    reference = _state()
    for batch in BATCHES[:3]:
        reference, _ = step(reference, batch)
    assert (again.step, again.micro_step) == (3, 3)
    assert _same(_params(again.model), _params(reference.model))


def test_a_state_from_before_a_rewinding_load_is_refused_though_its_counters_are_the_newest(
    memory_dir: str,
) -> None:
    # A rewind that skips a batch (as after a loss spike): back to update 0, then another
    # micro-batch than the first time. The state of the first time is at the same counters.
    first, other, closing = (make_batches(1, n, seed=s)[0] for n, s in ((2, 3), (12, 4), (6, 5)))
    step = accumulate(make_train_step(token_loss), 2)
    state = _state()
    url = save(state, f"{memory_dir}/at0")
    before, _ = step(state, first)  # a window of 2 targets
    loaded = load(url, before)
    rewound, _ = step(loaded, other)  # a window of 24 targets: .grad holds their sum
    assert (before.step, before.micro_step) == (rewound.step, rewound.micro_step) == (0, 1)
    # Before: accepted; the update divided .grad (other's and closing's) by 2 + 13 targets
    # where 24 + 13 were summed: 2.5 times the update (measured: parameters 0.035 apart where
    # the whole update moves them 0.024), and a loss of 1.195 for 1.013.
    with pytest.raises(ConfigError, match=_stale(0, 1) + ".*on another line of states"):
        step(before, closing)
    with pytest.raises(ConfigError, match="save " + _stale(0, 1)):
        save(before, f"{memory_dir}/wrong")
    rewound, out = step(rewound, closing)
    reference = _state()
    for batch in (other, closing):
        reference, expected = step(reference, batch)
    assert _same(_params(rewound.model), _params(reference.model))
    assert torch.equal(out.loss, expected.loss)


def test_a_load_into_a_state_an_earlier_load_replaced_leaves_one_newest(memory_dir: str) -> None:
    state = _state()
    step = make_train_step(mean_loss)
    url = save(state, f"{memory_dir}/at0")
    first = load(url, state)
    second = load(url, state)  # into the state the first load replaced: still a load
    with pytest.raises(ConfigError, match=_stale(0, 0) + ".*a load made after this state"):
        step(first, BATCHES[0])
    with pytest.raises(ConfigError, match=_stale(0, 0) + ".*a load made after this state"):
        step(state, BATCHES[0])
    second, _ = step(second, BATCHES[0])
    assert second.step == 1


def test_counters_set_by_hand_on_a_state_from_before_a_load_make_it_the_newest(
    memory_dir: str,
) -> None:
    state = _state()
    step = make_train_step(mean_loss)
    url = save(state, f"{memory_dir}/at0")
    state, _ = step(state, BATCHES[0])
    loaded = load(url, state)
    again = state.replace(step=0, micro_step=0)  # as replace() promises: now the newest
    with pytest.raises(ConfigError, match=_stale(0, 0) + ".*state.replace"):
        step(loaded, BATCHES[1])
    again, _ = step(again, BATCHES[1])
    assert again.step == 1


def test_a_background_save_of_a_stale_state_is_refused_before_it_copies(memory_dir: str) -> None:
    state = _state()
    step = make_train_step(mean_loss)
    newer, _ = step(state, BATCHES[0])
    with AsyncSaver() as saver:
        with pytest.raises(ConfigError, match="AsyncSaver.save " + _stale(0, 0)):
            saver.save(state, f"{memory_dir}/wrong")
        assert state.fence.held == 0  # nothing copied, nothing for the next update to wait for
        saver.save(newer, f"{memory_dir}/right")


def test_a_load_into_a_stale_state_gives_the_newest(memory_dir: str) -> None:
    state = _state()
    step = make_train_step(mean_loss)
    s1, _ = step(state, BATCHES[0])
    url = save(s1, f"{memory_dir}/at1")
    s2, _ = step(s1, BATCHES[1])
    loaded = load(url, state)  # the state given to a run that raised, say: still loads
    assert loaded.step == 1
    with pytest.raises(ConfigError, match=_stale(2, 2) + r".*update 1 \(micro-batch 1\)"):
        step(s2, BATCHES[2])  # newer than the checkpoint: its weights were overwritten
    loaded, _ = step(loaded, BATCHES[1])
    assert loaded.step == 2


def test_counters_replaced_by_hand_make_the_newest_state() -> None:
    state = _state()
    step = make_train_step(mean_loss)
    state, _ = step(state, BATCHES[0])
    restarted = state.replace(step=0, micro_step=0)  # a second phase counted from 0
    with pytest.raises(ConfigError, match=_stale(1, 1)):
        step(state, BATCHES[1])
    restarted, _ = step(restarted, BATCHES[1])
    assert restarted.step == 1
    # Other fields replaced by hand change no counter: both states stay the newest.
    tagged = restarted.replace(extras={"phase": 2})
    tagged, _ = step(tagged, BATCHES[2])
    assert tagged.step == 2


def test_a_deepcopy_is_a_run_of_its_own_with_its_open_window() -> None:
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (n + 1))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, extras={"tag": [1]})
    step = accumulate(make_train_step(mean_loss), 2)
    for batch in BATCHES[:3]:  # an update, then a window holding one micro-batch
        state, _ = step(state, batch)
    branch = copy.deepcopy(state)  # before: TypeError, cannot pickle 'mappingproxy' object
    assert branch.model is not state.model and branch.scheduler is not None
    assert branch.scheduler.optimizer is branch.optimizer
    assert branch.optimizer.param_groups[0]["params"][0] is next(branch.model.parameters())
    assert _same(_grads(branch.model), _grads(state.model))  # the open window's gradients too
    branch, _ = step(branch, BATCHES[3])
    state, _ = step(state, BATCHES[3])  # the original is still its own run's newest
    assert _same(_params(branch.model), _params(state.model))
    assert (branch.step, state.step, dict(branch.extras)) == (2, 2, {"tag": [1]})


def test_a_deepcopy_of_a_gan_state_keeps_its_optimizers_together() -> None:
    state, d_step, _ = _gan()
    branch = copy.deepcopy(state)
    assert branch["D"].model is branch.model
    assert branch.fence is branch["D"].fence and branch.fence is not state.fence
    branch, _ = d_step(branch, torch.randn(8, 4))
    state, _ = d_step(state, torch.randn(8, 4))  # each its own lineage


def test_evaluation_accepts_any_state() -> None:
    state = _state()
    step = make_train_step(mean_loss)
    newer, _ = step(state, BATCHES[0])
    eval_step = make_eval_step(lambda m, b: (m(b[0]), b[1]))
    for which in (state, newer):
        values = evaluate(eval_step, which, BATCHES[:2], metrics=MeanSquaredError())
        assert values


def test_a_compiled_step_refuses_a_stale_state() -> None:
    state = _state()
    step = compile_step(make_train_step(mean_loss))
    step(state, BATCHES[0])
    with pytest.raises(ConfigError, match=_stale(0, 0)):
        step(state, BATCHES[1])


def test_a_sweep_step_refuses_a_stale_state() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(2)])
    state = TrainState.create(model=copies, optimizer=SweepSGD(copies.parameters(), lr=[0.1, 0.2]))
    step = sweep_step(make_train_step(mean_loss), copies=copies, example_batch=BATCHES[0])
    newer, _ = step(state, BATCHES[0])
    with pytest.raises(ConfigError, match="sweep step " + _stale(0, 0)):
        step(state, BATCHES[1])
    newer, _ = step(newer, BATCHES[1])
    assert newer.step == 2


def test_the_check_reads_nothing_from_the_device() -> None:
    # Two integer comparisons per call: a tensor read (law 8) would fail the accepted call, and
    # the refused one raises the refusal, not a read.
    state = _state()
    step = make_train_step(mean_loss)

    def refuse(name: str) -> None:
        raise AssertionError(f"Tensor.{name} in the step")

    with on_host_read(refuse):
        newer, _ = step(state, BATCHES[0])
        newer, _ = step(newer, BATCHES[1])
        with pytest.raises(ConfigError, match=_stale(0, 0)):
            step(state, BATCHES[2])
    assert (newer.lane.lineage.step, newer.lane.lineage.micro_step) == (2, 2)


def test_counters_set_with_dataclasses_replace_are_refused_with_the_fix() -> None:
    state = _state()
    step = make_train_step(mean_loss)
    state, _ = step(state, BATCHES[0])
    hand_made = dataclasses.replace(state, step=0, micro_step=0)  # bypasses TrainState.replace
    with pytest.raises(ConfigError, match=r"state.replace\(step=\.\.\., micro_step=\.\.\.\)"):
        step(hand_made, BATCHES[1])
    # Other fields through dataclasses.replace (as the loop's epoch) keep the newest counters.
    state, _ = step(dataclasses.replace(state, epoch=1), BATCHES[1])
    assert (state.step, state.epoch) == (2, 1)


def test_an_interrupted_iterate_loop_leaves_its_variable_the_newest_state() -> None:
    # The notebook recipe the refusal names: a KeyboardInterrupt inside the step (here in its
    # loss_fn) leaves the loop variable at the last state yielded, which is the newest.
    calls = [0]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return mean_loss(model, batch)

    state = _state()
    step = make_train_step(loss_fn)
    with pytest.raises(KeyboardInterrupt):
        for state, _ in iterate(step, state, BATCHES, max_steps=6):  # noqa: B007, B020
            pass
    assert state.step == 2
    for state, _ in iterate(step, state, BATCHES, max_steps=6):  # noqa: B007, B020
        pass
    assert state.step == 6


CLEARED = r"holds 1 micro-batch\(es\).*\.grad was cleared inside the open window"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_cleared_inside_an_open_window_are_refused_by_a_step_a_flush_and_a_save(
    memory_dir: str, set_to_none: bool
) -> None:
    """``optimizer.zero_grad()`` with a window open (a loop's at an epoch's start) left the
    window's loss and count with no gradient: the next update counted 2 micro-batches and
    applied half of one's gradient, in silence. Refused, naming the two ways on; a zero_grad
    that keeps zeros (``set_to_none=False``) is not told apart without a device read."""
    state = _state()
    step = accumulate(make_train_step(mean_loss), 2)
    state, _ = step(state, BATCHES[0])
    state.optimizer.zero_grad(set_to_none=set_to_none)
    if not set_to_none:
        step(state, BATCHES[1])  # zeros in .grad: taken for the window's gradients
        return
    with pytest.raises(ConfigError, match=CLEARED + r".*EMPTY_WINDOW.*step\.flush\(state\)"):
        step(state, BATCHES[1])
    with pytest.raises(ConfigError, match=CLEARED):
        step.flush(state)
    with pytest.raises(ConfigError, match=CLEARED):
        save(state, f"{memory_dir}/ckpt")
    # dropped as the zero_grad meant: the next window is a whole one of its own
    dropped = state.replace(window=EMPTY_WINDOW)
    fresh = _state()
    for batch in BATCHES[1:3]:
        dropped, _ = step(dropped, batch)
        fresh, _ = step(fresh, batch)
    assert dropped.step == 1 and _same(_params(dropped.model), _params(fresh.model))


def test_a_window_flushed_before_the_zero_grad_is_applied() -> None:
    state = _state()
    step = accumulate(make_train_step(mean_loss), 2)
    state, _ = step(state, BATCHES[0])
    state, out = step.flush(state)
    state.optimizer.zero_grad()
    state, _ = step(state, BATCHES[1])
    assert out is not None and bool(out.did_update) and state.window.size == 1

"""The state's scheduler is stepped by the step alone, once per applied update: a hand loop (or a
handler) that steps it too, or a state used again after a later step advanced its scheduler, is
refused before the update instead of training each update with a later update's learning rate.
The reference is the plain PyTorch loop with a ``LambdaLR`` stepped once after each update."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    make_train_step,
    skip_nonfinite,
    warmup_cosine,
)
from steplib.step.compile import compile_step
from steplib.sweep import Copies, sweep_step
from tests.reference import make_batches, tiny_model

SCHEDULE = warmup_cosine(warmup=2, total=8)
REFUSED = r"at position 2, but the last update left it at 1: it was stepped outside the step"


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


BATCHES = [(x, y) for x, y, _ in make_batches(6, seed=3)]


def _state(model: nn.Module) -> tuple[TrainState, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE)
    return TrainState.create(model=model, optimizer=opt, scheduler=sched), sched


def _reference(updates: int) -> dict[str, torch.Tensor]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE)
    for batch in BATCHES[:updates]:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model.state_dict()


def test_a_hand_loop_that_steps_the_states_scheduler_too_is_refused_before_the_update() -> None:
    model = tiny_model(0)
    state, sched = _state(model)
    step = make_train_step(loss_fn)
    state, _ = step(state, BATCHES[0])
    sched.step()  # the user's own call: the step already advanced it
    with pytest.raises(ConfigError, match=REFUSED):
        step(state, BATCHES[1])
    # Nothing was applied with the doubly advanced rate: the model is the reference's after 1.
    for name, value in _reference(1).items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)


def test_a_scheduler_stepped_on_every_micro_batch_is_refused_at_the_window_close() -> None:
    state, sched = _state(tiny_model(0))
    step = accumulate(make_train_step(loss_fn), 2)
    state, _ = step(state, BATCHES[0])
    state, _ = step(state, BATCHES[1])  # the first update: position 1
    state, _ = step(state, BATCHES[2])
    sched.step()  # per micro-batch, Accelerate's pitfall
    with pytest.raises(ConfigError, match=REFUSED):
        step(state, BATCHES[3])


def test_a_scheduler_whose_position_the_step_keeps_on_the_device_is_checked_too() -> None:
    # A fused optimizer with skip_nonfinite keeps the skip decision, and the LambdaLR's
    # position, on the device; the object is set from there, and was silently re-read from it.
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = skip_nonfinite(make_train_step(loss_fn))
    state, out = step(state, BATCHES[0])
    assert isinstance(out.did_update, torch.Tensor)  # decided on the device
    step.settle(state)  # what a checkpoint does before it saves: no refusal after it
    state, _ = step(state, BATCHES[1])
    sched.step()
    with pytest.raises(ConfigError, match=REFUSED.replace("2", "3").replace("1", "2")):
        step(state, BATCHES[2])


def test_a_compiled_step_that_updates_with_its_last_micro_batch_refuses_before_it() -> None:
    # compile_step runs the update inside the closing micro-batch's graph: the check must come
    # before that micro-batch, or the update is applied with the twice-advanced rate.
    model = tiny_model(0)
    state, sched = _state(model)
    step = compile_step(accumulate(make_train_step(loss_fn), 2), backend="aot_eager")
    for batch in BATCHES[:4]:  # two updates: the compiled update is in use
        state, _ = step(state, batch)
    sched.step()
    state, _ = step(state, BATCHES[4])  # opens the window: nothing applied, nothing checked
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=REFUSED.replace("2", "3").replace("1", "2")):
        step(state, BATCHES[5])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_state_used_again_after_a_later_step_moved_its_scheduler_is_refused() -> None:
    step = make_train_step(loss_fn)
    state, _ = step(_state(tiny_model(0))[0], BATCHES[0])
    step(state, BATCHES[1])  # a notebook cell: the result not kept ...
    # ... and the cell run again on the same state: refused before its backward, as any state
    # that is not the newest of its run (tests/test_stale_state.py), not only at the update.
    stale = r"at update 1 \(micro-batch 1\), but the newest state of the same run is at update 2"
    with pytest.raises(ConfigError, match=stale):
        step(state, BATCHES[1])


def test_a_scheduler_set_by_hand_and_passed_in_again_trains_from_its_position() -> None:
    state, sched = _state(tiny_model(0))
    step = make_train_step(loss_fn)
    state, _ = step(state, BATCHES[0])
    saved = sched.state_dict()
    sched.step()
    sched.load_state_dict(saved)  # back at 1, as the step left it: no refusal
    state, _ = step(state, BATCHES[1])
    sched.load_state_dict(saved)  # back at 1 on purpose: passed in again
    state = state.replace(scheduler=sched)
    state, out = step(state, BATCHES[2])
    assert float(out.lr) == pytest.approx(0.1 * SCHEDULE(1))
    assert sched.last_epoch == 2


def test_a_sweep_step_refuses_its_scheduler_stepped_outside_it_too() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(2)])
    opt = torch.optim.SGD(copies.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE)
    state = TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    step = sweep_step(make_train_step(loss_fn), copies=copies, example_batch=BATCHES[0])
    state, _ = step(state, BATCHES[0])
    sched.step()
    with pytest.raises(ConfigError, match=REFUSED):
        step(state, BATCHES[1])

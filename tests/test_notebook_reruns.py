"""A hand-written loop in a notebook: cells run again, or run out of order, either train as
the plain PyTorch loop does or are refused with the fix, never wrong in silence."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from steplib import (
    ConfigError,
    Event,
    Events,
    TrainState,
    accumulate,
    iterate,
    make_train_step,
    run,
)
from tests.reference import make_batches, mean_loss, params_of, reference_loop, tiny_model

GRADIENT_HELD = r"already hold a gradient .* model\.zero_grad\(set_to_none=True\)"


def _assert_trains_as_the_plain_loop(state: TrainState, *, lr: float) -> None:
    """``state`` (over ``tiny_model(0)`` and SGD at ``lr``) trains as the plain loop does."""
    batches = make_batches(3)
    step = make_train_step(mean_loss)
    for batch in batches:
        state, _ = step(state, batch)
    reference = tiny_model(0)
    reference_loop(reference, torch.optim.SGD(reference.parameters(), lr=lr), batches, mean_loss)
    for got, want in zip(params_of(state.model), params_of(reference), strict=True):
        assert torch.equal(got, want)


def test_a_state_created_over_a_gradient_from_an_earlier_backward_is_refused() -> None:
    # A cell that looks at the gradients (one backward), then the set-up cell: the state's
    # window was empty while .grad held that backward, and the first update added it in
    # (in a scratch run of 4 updates, parameters 0.16 away from the plain loop's).
    model = tiny_model(0)
    mean_loss(model, make_batches(1, seed=7)[0]).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=GRADIENT_HELD):
        TrainState.create(model=model, optimizer=opt)

    model.zero_grad(set_to_none=True)  # the fix: then it is the plain loop
    _assert_trains_as_the_plain_loop(TrainState.create(model=model, optimizer=opt), lr=0.1)


def test_the_set_up_cell_run_again_inside_an_accumulation_window_is_refused() -> None:
    # Half a window, then TrainState.create again on the same model and optimizer: the new
    # state counted none of the first micro-batch, whose gradient was still in .grad.
    model = tiny_model(0)
    opt = {"G": torch.optim.SGD(model.parameters(), lr=0.1)}
    step = accumulate(make_train_step(lambda m, b: mean_loss(m["G"], b), optimizer="G"), 2)
    state, _ = step(TrainState.create(model={"G": model}, optimizer=opt), make_batches(1)[0])
    assert state["G"].window.size == 1
    with pytest.raises(ConfigError, match=GRADIENT_HELD):
        TrainState.create(model={"G": model}, optimizer=opt)


def test_a_piece_swapped_in_with_replace_is_checked_as_create_checks_it() -> None:
    # A cell that lowers the learning rate with a new optimizer in the state: the state's
    # scheduler went on stepping the old one; a new model under the old optimizer never moved.
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt, scheduler=LambdaLR(opt, lambda n: 0.5))
    lower = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(
        ConfigError, match=r"TrainState\.replace: the scheduler \(LambdaLR\) is not"
    ):
        state.replace(optimizer=lower)
    with pytest.raises(ConfigError, match=r"TrainState\.replace: the optimizer holds 4 parameter"):
        state.replace(model=tiny_model(1))
    with pytest.raises(
        ConfigError, match=r"(?s)replace\(model=\.\.\.\) received .*\(type dict\), which is not"
    ):
        state.replace(model={"net": model})
    g, d = nn.Linear(2, 2), nn.Linear(2, 1)
    gan = TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": torch.optim.SGD(g.parameters()), "D": torch.optim.SGD(d.parameters())},
    )
    with pytest.raises(ConfigError, match=r"another model for a state of several optimizers"):
        gan.replace(model=nn.ModuleDict({"G": g, "D": d}))

    # Both pieces at once: the plain loop with the new optimizer.
    _assert_trains_as_the_plain_loop(state.replace(optimizer=lower, scheduler=None), lr=0.01)


def test_a_cell_interrupted_inside_a_handler_is_refused_with_a_way_on_that_works() -> None:
    # The refusal named `for state, out in iterate(...)` as the way to keep the newest state of
    # an interrupted cell; interrupted inside a handler (an evaluation at step_end, a save at
    # epoch_end) the loop had stepped past the last yielded state, so the next cell was refused
    # again, naming the same loop, and only a checkpoint or a new start was left.
    data = make_batches(6)
    step = make_train_step(mean_loss)

    def fresh() -> TrainState:
        model = tiny_model(0)
        return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))

    uninterrupted = run(step, fresh(), data, max_epochs=2)

    def interrupt(event: Event) -> None:
        if event.epoch == 1:  # after the last update of epoch 0 was counted
            raise KeyboardInterrupt

    events = Events()
    events.on("epoch_end", interrupt)
    seen: list[TrainState] = []
    events.on("exception", lambda e: seen.append(e.state))  # the fix the refusal names
    start = state = fresh()
    with pytest.raises(KeyboardInterrupt):  # the notebook's loop: `state` as the cell left it
        for state, _ in iterate(step, start, data, events=events, max_epochs=2):  # noqa: B007
            pass
    assert (state.step, state.epoch) == (5, 0)  # one call behind
    with pytest.raises(ConfigError, match=r'(?s)events\.on\("exception", lambda e: seen\.append'):
        run(step, state, data, max_epochs=2)

    state = run(step, seen[-1], data, max_epochs=2)
    assert (state.step, state.epoch) == (uninterrupted.step, uninterrupted.epoch) == (12, 2)
    for got, want in zip(params_of(state.model), params_of(uninterrupted.model), strict=True):
        assert torch.equal(got, want)

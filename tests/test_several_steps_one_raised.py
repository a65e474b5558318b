"""Several steps on one batch, a later one raising after an earlier one trained on it (a
KeyboardInterrupt in G's step after D's update, an out-of-memory): the run's ``exception``
event carries the newest state (D's update in it), a next run goes on from it over the same
loader, and the batch counts as trained, with a warning that G did not train on it (training
it again would train D twice). Before, the event carried the state from before D's call,
which D's lineage refused, and the refusal's advice named that same state: no way on but a
``load``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from steplib import Events, TrainState, make_train_step, run
from steplib.data import resumable_loader
from steplib.loop_data import Partial
from tests.test_run_several_steps import _d_loss, _g_loss, _state  # the GAN of run's tests

RAISE_AT = 3  # the micro-batch whose G step raises


def _loader() -> Any:
    g = torch.Generator().manual_seed(1)
    real, noise = torch.randn(48, 1, generator=g) + 3, torch.randn(48, 4, generator=g)
    return resumable_loader(TensorDataset(real, noise), batch_size=8, seed=0, shuffle=True)


def _params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def test_a_later_step_that_raised_leaves_the_newest_state_and_the_batch_trained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The reference, one epoch: D on every batch, G on every batch but the one it raised on.
    state = _state()
    d_step, g_step = (
        make_train_step(_d_loss, optimizer="D"),
        make_train_step(_g_loss, optimizer="G"),
    )
    for index, batch in enumerate(_loader()):
        state, _ = d_step(state, batch)
        if index != RAISE_AT:
            state, _ = g_step(state, batch)
    expected = _params(state)

    calls = [0]

    def g_loss(model: Any, batch: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == RAISE_AT + 1:
            raise KeyboardInterrupt  # Ctrl-C in a notebook, inside G's step
        return _g_loss(model, batch)

    steps = {"D": make_train_step(_d_loss, optimizer="D"),
             "G": make_train_step(g_loss, optimizer="G")}  # fmt: skip
    seen: list[TrainState] = []
    events = Events().on("exception", lambda event: seen.append(event.state))
    loader, state = _loader(), _state()
    with caplog.at_level(logging.WARNING, logger="steplib.loop"), pytest.raises(KeyboardInterrupt):
        run(steps, state, loader, events=events, max_epochs=1)
    assert seen[0]["D"].step == RAISE_AT + 1  # D's update on the batch is in the event's state
    assert any("'G'" in r.getMessage() and "not train" in r.getMessage() for r in caplog.records)
    # Goes on from the exception event's state (refused before: D's lineage had moved on).
    state = run(steps, seen[0], loader, max_epochs=1)
    assert state.epoch == 1
    for got, want in zip(_params(state), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_interrupt_after_the_last_step_recorded_its_state_keeps_that_state() -> None:
    # A KeyboardInterrupt between the last step's record and the call's end: every step has
    # trained on the batch, so the recorded state is the newest (an IndexError over the
    # user's interrupt before, naming the step that raised among none left).
    partial = Partial()
    partial.state, partial.done = "newest", ["D", "G"]
    assert partial.taken(KeyboardInterrupt(), {"D": None, "G": None}) == "newest"

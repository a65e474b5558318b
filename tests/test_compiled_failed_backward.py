"""A compiled step whose fused forward/backward graph raised is handled as an eager backward
that raised (``steplib.lineage.backward_failed``): the graph accumulates into ``.grad`` itself,
so an error inside it may leave part of a micro-batch's gradient there. An empty window's
gradients are cleared and the same state steps again; an open window's run is refused at its
next step, and goes on from either way out the refusal names."""

from __future__ import annotations

import pytest
import torch

from steplib import ConfigError, TrainState, accumulate, make_train_step
from steplib.state import EMPTY_WINDOW
from steplib.step.compile import compile_stats, compile_step
from tests.reference import make_batches, mean_loss, tiny_model

BATCHES = make_batches(8)
TORN = "of a run whose last step raised part-way"


def _state() -> TrainState:
    model = tiny_model(0)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _bad(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x, y, mask = batch
    return x[:, :7], y, mask  # a feature short: the graph's first matmul raises


def test_a_fused_graph_that_raised_clears_an_empty_window_and_tears_an_open_one() -> None:
    step = compile_step(accumulate(make_train_step(mean_loss), 2), backend="aot_eager")
    state = _state()
    for batch in BATCHES[:4]:  # two updates: the fused graph runs from then on
        state, _ = step(state, batch)
    assert compile_stats(step).fused_backward is True

    with pytest.raises(Exception, match="must have same reduction dim"):
        step(state, _bad(BATCHES[4]))  # the window's first micro-batch
    assert all(p.grad is None for p in state.model.parameters())
    state, _ = step(state, BATCHES[4])  # the same state: still the newest, and whole
    with pytest.raises(Exception, match="must have same reduction dim"):
        step(state, _bad(BATCHES[5]))  # the closing micro-batch, with the update in the graph
    # Before the fused graph's failure was handled: accepted, the window going on with
    # whatever the graph had added to .grad.
    with pytest.raises(ConfigError, match=TORN):
        step(state, BATCHES[5])
    state.model.zero_grad(set_to_none=True)
    state = state.replace(window=EMPTY_WINDOW, micro_step=state.micro_step - state.window.size)
    for batch in BATCHES[6:8]:
        state, _ = step(state, batch)

    eager = accumulate(make_train_step(mean_loss), 2)
    reference = _state()
    for batch in [*BATCHES[:4], *BATCHES[6:8]]:
        reference, _ = eager(reference, batch)
    assert (state.step, state.micro_step) == (reference.step, reference.micro_step) == (3, 6)
    for got, want in zip(state.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

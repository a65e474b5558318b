"""A backward that raises (out of memory, a KeyboardInterrupt) leaves no silent gradient.

Before: the backward had added part of its micro-batch's gradient to ``.grad`` when it raised,
and the step called again from the same state (retrying after an out-of-memory error, going on
after an interrupted notebook cell) added the whole micro-batch's on top: measured, the last
layer moved by twice its gradient. Now an empty window's gradients are cleared, so the retry
is the clean step, and an open window (whose earlier micro-batches share ``.grad``) is refused
at the next step with the ways out (``steplib.lineage.backward_failed``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from steplib import ConfigError, TrainState, accumulate, amp_wrap, make_train_step, tap
from steplib.checkpoint import load, save
from steplib.state import EMPTY_WINDOW
from steplib.sweep import Copies, SweepSGD, sweep_step
from tests.checkpoint_helpers import memory_dir
from tests.reference import make_batches, mean_loss, tiny_model

__all__ = ["memory_dir"]  # the fixture, used by name

BATCHES = make_batches(6)
TORN = "of a run whose last step raised part-way"


class _OutOfMemoryError(RuntimeError):
    pass


def _fail_once_in_backward(model: nn.Module) -> None:
    """Raise once, inside the backward, after the last layer's gradients were accumulated (the
    first layer's weight is reached last), as an out-of-memory error part-way would."""
    armed = [True]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if armed[0]:
            armed[0] = False
            raise _OutOfMemoryError("CUDA out of memory (simulated)")
        return grad

    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    first.weight.register_hook(hook)


def _state(seed: int = 0) -> TrainState:
    model = tiny_model(seed)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def test_a_step_retried_after_its_backward_raised_equals_the_clean_step() -> None:
    clean = _state()
    step = make_train_step(mean_loss)
    clean, _ = step(clean, BATCHES[0])

    state = _state()
    _fail_once_in_backward(state.model)
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[0])
    assert all(p.grad is None for p in state.model.parameters())
    state, _ = step(state, BATCHES[0])  # the same state: it is still the newest, and whole
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(clean), strict=True))


def test_a_backward_that_raised_inside_an_open_window_is_refused_at_the_next_step() -> None:
    step = accumulate(make_train_step(mean_loss), 2)
    state = _state()
    state, _ = step(state, BATCHES[0])
    _fail_once_in_backward(state.model)
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[1])
    with pytest.raises(ConfigError, match=TORN):
        step(state, BATCHES[1])  # .grad holds micro-batch 0 and part of micro-batch 1
    with pytest.raises(ConfigError, match=TORN):
        save(state, "memory://failed-backward/refused")
    # The way out the message gives: drop the window; it trains as if it never began.
    state.model.zero_grad(set_to_none=True)
    state = state.replace(window=EMPTY_WINDOW, micro_step=state.micro_step - state.window.size)
    state, _ = step(state, BATCHES[2])
    state, _ = step(state, BATCHES[3])

    reference = _state()
    reference, _ = step(reference, BATCHES[2])
    reference, _ = step(reference, BATCHES[3])
    assert state.step == reference.step == 1
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(reference), strict=True))


def test_a_torn_window_goes_on_from_the_last_checkpoint(memory_dir: str) -> None:
    step = accumulate(make_train_step(mean_loss), 2)
    state = _state()
    url = save(state, memory_dir)
    state, _ = step(state, BATCHES[0])
    _fail_once_in_backward(state.model)
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[1])
    state = load(url, state)
    state, _ = step(state, BATCHES[0])
    state, _ = step(state, BATCHES[1])
    assert (state.step, state.micro_step) == (1, 2)


def test_a_loss_fn_that_raised_before_its_backward_leaves_the_window_usable() -> None:
    # Nothing reached .grad: the window goes on, as if the failed call had not been made.
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if batch is None:
            raise ValueError("a bad batch")
        return mean_loss(model, batch)

    step = accumulate(make_train_step(loss_fn), 2)
    state, reference = _state(), _state()
    state, _ = step(state, BATCHES[0])
    with pytest.raises(Exception, match="a bad batch"):
        step(state, None)
    state, _ = step(state, BATCHES[1])
    for batch in BATCHES[:2]:
        reference, _ = step(reference, batch)
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(reference), strict=True))


def test_a_gan_generator_backward_that_raised_leaves_the_discriminators_window_alone() -> None:
    torch.manual_seed(0)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    state = TrainState.create(
        model={"G": g, "D": d},
        optimizer={
            "G": torch.optim.SGD(g.parameters(), lr=0.1),
            "D": torch.optim.SGD(d.parameters(), lr=0.1),
        },
    )
    d_step = accumulate(
        make_train_step(lambda m, b: m["D"](m["G"](b).detach()).mean(), optimizer="D"), 2
    )
    g_step = make_train_step(lambda m, b: -m["D"](m["G"](b)).mean(), optimizer="G")
    batch = torch.randn(8, 4)
    state, _ = d_step(state, batch)  # D's window is open: its gradients are in d.grad
    held = [p.grad.clone() for p in d.parameters()]  # type: ignore[union-attr]
    handle = g.weight.register_hook(lambda grad: (_ for _ in ()).throw(_OutOfMemoryError()))
    with pytest.raises(_OutOfMemoryError):
        g_step(state, batch)
    handle.remove()
    assert all(p.grad is None for p in g.parameters())  # G's window was empty: cleared
    assert all(torch.equal(p.grad, h) for p, h in zip(d.parameters(), held, strict=True))  # type: ignore[arg-type]
    state, _ = g_step(state, batch)
    state, _ = d_step(state, batch)
    assert (state["G"].step, state["D"].step) == (1, 1)


def test_a_sweep_step_retried_after_its_backward_raised_equals_the_clean_step() -> None:
    def sweep() -> tuple[TrainState, Any]:
        copies = Copies.stack([tiny_model(i) for i in range(2)])
        opt = SweepSGD(copies.parameters(), lr=[0.1, 0.2])
        state = TrainState.create(model=copies, optimizer=opt)
        step = sweep_step(make_train_step(mean_loss), copies=copies, example_batch=BATCHES[0])
        return state, step

    clean, step = sweep()
    clean, _ = step(clean, BATCHES[0])
    state, step = sweep()
    param = next(iter(state.model.parameters()))
    handle = param.register_hook(lambda grad: (_ for _ in ()).throw(_OutOfMemoryError()))
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[0])
    handle.remove()
    assert all(p.grad is None for p in state.model.parameters())
    state, _ = step(state, BATCHES[0])
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(clean), strict=True))


def test_a_step_that_raised_while_it_closed_its_window_is_refused_with_the_way_out() -> None:
    # Before: the input state was refused as "not the newest" (its window's micro-batch was
    # counted by a state nobody received), naming states the user never had.
    armed = [True]

    def before_update(state: TrainState) -> None:
        if armed[0]:
            armed[0] = False
            raise _OutOfMemoryError("in the update (simulated)")

    step = tap(make_train_step(mean_loss), before_update=before_update)
    state = _state()
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[0])  # its gradients were normalised in place, then it raised
    with pytest.raises(ConfigError, match=TORN):
        step(state, BATCHES[0])
    state.model.zero_grad(set_to_none=True)
    state = state.replace(window=EMPTY_WINDOW, micro_step=state.micro_step - state.window.size)
    state, _ = step(state, BATCHES[1])

    reference, _ = make_train_step(mean_loss)(_state(), BATCHES[1])
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(reference), strict=True))


def _fp16_state() -> TrainState:
    model = tiny_model(0)
    return TrainState.create(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    )


@pytest.mark.parametrize("way_out", ["drop the window", "load the checkpoint"])
def test_a_float16_update_that_raised_after_unscale_goes_on_by_either_way_out(
    way_out: str, memory_dir: str
) -> None:
    # Before: the GradScaler stayed marked "unscaled" for the optimizer (its update() never
    # ran), so every later update of the run raised torch's "unscale_() has already been
    # called on this optimizer since the last update()", after either way out the refusal names.
    armed = [False]

    def before_update(state: TrainState) -> None:  # the gradients unscaled, the update next
        if armed[0]:
            armed[0] = False
            raise _OutOfMemoryError("in the update (simulated)")

    step = amp_wrap(
        tap(make_train_step(mean_loss), before_update=before_update), dtype=torch.float16
    )
    state = _fp16_state()
    state, _ = step(state, BATCHES[0])
    url = save(state, memory_dir)
    armed[0] = True
    with pytest.raises(_OutOfMemoryError):
        step(state, BATCHES[1])
    with pytest.raises(ConfigError, match=TORN):
        step(state, BATCHES[1])
    if way_out == "drop the window":
        state.model.zero_grad(set_to_none=True)
        state = state.replace(window=EMPTY_WINDOW, micro_step=state.micro_step - state.window.size)
    else:
        state = load(url, state)
    for batch in BATCHES[2:5]:  # past a growth of the scale (growth_interval=2)
        state, out = step(state, batch)
        assert out.did_update

    reference = _fp16_state()
    for batch in [BATCHES[0], *BATCHES[2:5]]:  # as if the failed update had not been tried
        reference, _ = step(reference, batch)
    assert (state.step, state.micro_step) == (reference.step, reference.micro_step) == (4, 4)
    assert all(torch.equal(a, b) for a, b in zip(_params(state), _params(reference), strict=True))
    assert state.scaler.state_dict() == reference.scaler.state_dict()  # type: ignore[union-attr]

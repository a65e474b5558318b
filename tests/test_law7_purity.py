"""Law 7: calling a step never mutates the TrainState object it was given."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from steplib import TrainState, accumulate, amp_wrap, clip, make_train_step, skip_nonfinite
from tests.reference import make_batches, tiny_model, token_loss


def _snapshot(state: TrainState) -> dict[str, tuple[int, Any]]:
    snap: dict[str, tuple[int, Any]] = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        # Identity for every field, and the values of the tensors the step could write into.
        snap[field.name] = (id(value), value.clone() if isinstance(value, torch.Tensor) else None)
    snap["extras"] = (id(state.extras), dict(state.extras))
    return snap


def test_law7_step_never_mutates_the_state_it_was_given() -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler, extras={"run": "a"})
    step = make_train_step(token_loss)
    step = skip_nonfinite(clip(amp_wrap(accumulate(step, 3), dtype=torch.float16), max_norm=1.0))
    seen = []
    for batch in make_batches(7):
        before = _snapshot(state)
        counters = (state.step, state.micro_step, state.window.size, state.skipped_updates)
        new_state, _ = step(state, batch)
        assert new_state is not state
        after = _snapshot(state)
        for name, (ident, value) in before.items():
            assert after[name][0] == ident, name
            if isinstance(value, torch.Tensor):
                assert torch.equal(after[name][1], value), name
        assert after["extras"][1] == before["extras"][1]
        assert (state.step, state.micro_step, state.window.size, state.skipped_updates) == counters
        seen.append(state)
        state = new_state
    # Old states stay readable and distinct: a notebook can keep a history of them.
    assert [s.micro_step for s in seen] == list(range(7))
    state, _ = step.flush(state)
    assert state.window.size == 0


def test_law7_state_is_frozen_and_extras_read_only() -> None:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        state.step = 3  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("TrainState must be frozen")
    try:
        state.extras["x"] = 1  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("TrainState.extras must be read-only")
    assert state.replace(extras={"x": 1}).extras["x"] == 1

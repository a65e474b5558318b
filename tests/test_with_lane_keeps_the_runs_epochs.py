"""``state.with_lane(run(step, state[name], ...))`` keeps what the run recorded for the whole
state: the epochs it completed and the values its evaluations put in ``extras``.

A lane's ``epoch`` and ``extras`` are the state's (``state[name]`` carries them): a run on the
lane counts its passes there and an ``Evaluator`` records its values there. ``with_lane`` put
the lane back but kept the state's own, older ``epoch`` and ``extras``: after the run of the
forward-forward recipe's second layer (docs/migration/README.md) the state said 0 epochs
where 2 had run, and its evaluation's ``val_loss`` was gone; a checkpoint of that state would
record both wrong, and a next ``run(..., max_epochs=2)`` would train 2 epochs again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics import MeanMetric

from steplib import Evaluator, TrainState, make_eval_step, make_train_step, run


def _two_lanes(**more: Any) -> TrainState:
    a, b = nn.Linear(2, 1), nn.Linear(2, 1)
    optimizers = {
        "a": torch.optim.SGD(a.parameters(), lr=0.1),
        "b": torch.optim.SGD(b.parameters(), lr=0.1),
    }
    return TrainState.create(model={"a": a, "b": b}, optimizer=optimizers, **more)


def test_a_run_on_a_lane_gives_the_state_its_epochs_and_its_evaluations() -> None:
    state = _two_lanes()
    evaluator = Evaluator(
        make_eval_step(lambda m, x: {"value": m.get_submodule("b")(x).sum()}),
        [torch.ones(1, 2)],
        metrics={"loss": MeanMetric()},
        at_epoch_end=True,
    )
    step = make_train_step(lambda m, x: m.get_submodule("b")(x).sum(), optimizer="b")
    lane = run(step, state["b"], [torch.ones(1, 2)] * 3, events=[evaluator], max_epochs=2)
    assert (lane.epoch, lane.step, "val_loss" in lane.extras) == (2, 6, True)

    state = state.with_lane(lane)
    assert (state.epoch, state["b"].epoch, state["b"].step, state.step) == (2, 2, 6, 0)
    assert dict(state.extras) == dict(lane.extras)
    # The counted limit holds: no epoch runs again.
    with pytest.warns(UserWarning, match="trains nothing"):
        assert run(step, state["b"], [torch.ones(1, 2)] * 3, max_epochs=2).step == 6


def test_a_step_on_a_lane_changes_neither_epoch_nor_extras() -> None:
    state = _two_lanes(extras={"note": 1})
    state = run(
        make_train_step(lambda m, x: m.get_submodule("a")(x).sum(), optimizer="a"),
        state,
        [torch.ones(1, 2)],
    )
    lane, _ = make_train_step(lambda m, x: m.get_submodule("b")(x).sum(), optimizer="b")(
        state["b"], torch.ones(1, 2)
    )
    merged = state.with_lane(lane)
    assert (merged.epoch, dict(merged.extras), merged["b"].step) == (1, {"note": 1}, 1)

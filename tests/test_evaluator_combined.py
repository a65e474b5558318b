"""``Evaluator(data={...}, combine=..., weights=...)``: each set's values under its name and
their weighted mean as the one metric that early stopping and the checkpoints watch; checked
against a plain evaluation loop per set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    EarlyStopping,
    Evaluator,
    Events,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import best_checkpoint, list_checkpoints
from tests.checkpoint_helpers import make_state
from tests.reference import make_batches, mean_loss

WIKI, CODE = make_batches(2, seed=7), make_batches(3, sizes=[2, 5, 3], seed=8)


def _squared_error(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return (model(x) - y) ** 2


def _plain_mean_error(model: torch.nn.Module, batches: list[Any]) -> float:
    """The reference: every squared error of the set, averaged (what MeanMetric computes)."""
    with torch.no_grad():
        errors = [((model(x) - y) ** 2).flatten() for x, y, _ in batches]
    return torch.cat(errors).mean().item()


def _evaluator(**settings: Any) -> Evaluator:
    return Evaluator(
        make_eval_step(_squared_error),
        {"wiki": WIKI, "code": CODE},
        metrics={"loss": MeanMetric()},
        sanity_batches=1,
        **settings,
    )


def test_the_combined_score_is_the_weighted_mean_of_plain_per_set_evaluations(
    tmp_path: Path,
) -> None:
    evaluator = _evaluator(every=2, combine="loss", weights={"wiki": 3.0, "code": 1.0})
    assert (evaluator.monitor, evaluator.mode) == ("mean_loss", "min")
    expected: list[dict[str, float]] = []

    def reference(event: Any) -> None:  # the same weights, evaluated by a plain loop
        wiki, code = (_plain_mean_error(event.state.model, s) for s in (WIKI, CODE))
        expected.append({"wiki_loss": wiki, "code_loss": code, "mean_loss": (3 * wiki + code) / 4})

    stopper = EarlyStopping(evaluator, patience=100)
    events = Events().on("step_end", reference, every=2)
    events.add(evaluator, stopper, checkpoint_every(str(tmp_path), every=2, metric=evaluator))
    run(make_train_step(mean_loss), make_state(), make_batches(6), events=events)

    assert [step for step, _ in evaluator.history] == [2, 4, 6]
    for (_, got), want in zip(evaluator.history, expected, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-6), name
    # One metric for all: early stopping, the checkpoints' records and the best of them.
    means = [values["mean_loss"] for _, values in evaluator.history]
    assert stopper.monitor == "mean_loss" and stopper.best.value == min(means)
    saved = list_checkpoints(str(tmp_path))
    assert [c.metrics["mean_loss"] for c in saved] == pytest.approx(means)
    (best,) = [c for c in saved if c.url == best_checkpoint(str(tmp_path), evaluator)]
    assert best.metrics["mean_loss"] == min(means)


def test_equal_weights_by_default() -> None:
    evaluator = _evaluator(every=1, combine="loss")
    state = make_state()
    values = evaluator.run(state)
    assert values["mean_loss"] == pytest.approx((values["wiki_loss"] + values["code_loss"]) / 2)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"combine": "loss", "weights": {"wiki": 1.0}}, r"one weight per validation set"),
        ({"combine": "loss", "weights": {"wiki": -1, "code": 1}}, r"-1 .* for the set 'wiki'"),
        ({"combine": "loss", "weights": {"wiki": 0, "code": 0}}, r"are all 0"),
        ({"weights": {"wiki": 1, "code": 1}}, r"without combine=\.\.\..*combine='loss'"),
        ({"combine": ""}, r"combine=\.\.\.\) received ''"),
    ],
)
def test_bad_combined_settings_are_refused_when_built(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _evaluator(every=1, **settings)


def test_combine_needs_several_sets_and_a_metric_they_record() -> None:
    eval_step = make_eval_step(_squared_error)
    metrics = {"loss": MeanMetric()}
    with pytest.raises(ConfigError, match=r"needs several validation sets.*monitor='val_loss'"):
        Evaluator(eval_step, WIKI, metrics=metrics, every=1, combine="loss")
    with pytest.raises(ConfigError, match=r"set named 'mean'.*'mean_loss'"):
        Evaluator(eval_step, {"mean": WIKI, "b": CODE}, metrics=metrics, every=1, combine="loss")
    misspelt = _evaluator(every=1, combine="acc")
    with pytest.raises(ConfigError, match=r"no 'wiki_acc', 'code_acc'.*code_loss, wiki_loss"):
        run(make_train_step(mean_loss), make_state(), make_batches(1), events=[misspelt])

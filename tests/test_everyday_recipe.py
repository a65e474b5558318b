"""The everyday recipe (issue 16): ``examples/classifier.py`` runs in at most 45 lines, with
handlers given as a list, one monitored metric shared by the evaluator, early stopping and
keep-best checkpoints, ``best_checkpoint``, and a checkpoint cadence per epoch."""

from __future__ import annotations

import importlib.util
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
    TrainState,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import CheckpointError, best_checkpoint, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]


def test_the_classifier_example_fits_in_45_lines_and_tests_its_best_checkpoint(
    tmp_path: Path,
) -> None:
    source = ROOT / "examples" / "classifier.py"
    assert len(source.read_text().splitlines()) <= 45
    spec = importlib.util.spec_from_file_location("classifier", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    accuracy = module.main(root=str(tmp_path), epochs=2)
    assert accuracy > 0.6  # 4 classes: chance is 0.25
    kept = list_checkpoints(str(tmp_path))
    # The save at fit end (update 32) was not evaluated: it records no score of another model.
    assert [c.step for c in kept if "val_accuracy" not in c.metrics] == [32]
    best = max(
        (c for c in kept if "val_accuracy" in c.metrics), key=lambda c: c.metrics["val_accuracy"]
    )
    assert best_checkpoint(str(tmp_path), "val_accuracy", mode="max") == best.url
    assert list((tmp_path / "tb").iterdir())  # TensorBoard wrote its events


def _run(tmp_path: Path, values: list[float], **checkpointing: Any) -> tuple[Any, Any, Any]:
    """Train a tiny model for 1 update per batch; the 'evaluation' yields ``values`` in turn."""
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    feed = iter(values)
    eval_step = make_eval_step(lambda m, b: torch.tensor(next(feed)))
    evaluator = Evaluator(
        eval_step,
        [0],
        metrics={"mean": MeanMetric()},
        every=2,
        monitor="val_mean",
        sanity_batches=0,
    )
    stop = EarlyStopping(evaluator, patience=2)
    keep = checkpoint_every(str(tmp_path), keep_best=1, metric=evaluator, **checkpointing)
    state = run(step, state, [torch.ones(3, 2)] * 12, events=[evaluator, stop, keep])
    return state, evaluator, stop


def test_one_metric_is_shared_by_the_evaluator_early_stopping_and_keep_best(
    tmp_path: Path,
) -> None:
    state, evaluator, stop = _run(tmp_path, [3.0, 1.0, 2.0, 1.5, 0.5, 0.1], every=2)
    # Checks at updates 2, 4, 6, 8: the best is 1.0 at 4, then two checks without improvement.
    assert state.step == 8 and len(evaluator.history) == 4
    assert (stop.monitor, stop.best.mode, stop.wait) == ("val_mean", "min", 2)
    best = best_checkpoint(str(tmp_path), evaluator)
    assert [c.step for c in list_checkpoints(str(tmp_path)) if c.url == best] == [4]


def test_a_checkpoint_at_every_epoch_end(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    keep = checkpoint_every(str(tmp_path), at_epoch_end=True, at_end=False)
    run(step, state, [torch.ones(3, 2)] * 3, events=Events(keep), max_epochs=3)
    assert [(c.step, c.epoch) for c in list_checkpoints(str(tmp_path))] == [(3, 1), (6, 2), (9, 3)]


def test_the_shared_metric_and_the_handler_list_refuse_what_cannot_work(tmp_path: Path) -> None:
    evaluator = Evaluator(make_eval_step(lambda m, b: b), [0], metrics=MeanMetric(), every=2)
    with pytest.raises(ConfigError, match="Evaluator built with monitor="):
        EarlyStopping(evaluator)  # it monitors nothing
    monitored = Evaluator(
        make_eval_step(lambda m, b: b), [0], metrics=MeanMetric(), every=2, monitor="val_mean"
    )
    with pytest.raises(ConfigError, match="leave mode out"):
        checkpoint_every(str(tmp_path), every=2, keep_best=1, metric=monitored, mode="max")
    with pytest.raises(ConfigError, match="does not say when to check"):
        Events(EarlyStopping("val_loss"))
    with pytest.raises(ValueError, match=r"events.on\('step_end', handler, every=100\)"):
        Events(lambda event: None)
    with pytest.raises(ConfigError, match="at_epoch_end=True"):
        checkpoint_every(str(tmp_path))
    with pytest.raises(CheckpointError, match="no checkpoint there records 'val_mean'"):
        best_checkpoint(str(tmp_path / "empty"), monitored)

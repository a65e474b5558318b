"""The best is the best (DESIGN.md §4): a checkpoint's score is always its own model's, a save
with no evaluation of its model never competes for best, and a save holds what every other
handler did at its event, whatever order they were attached in.

The 'evaluation' here yields scripted values in turn, so which update scored what is known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    Evaluator,
    Events,
    NewState,
    TrainState,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import best_checkpoint, list_checkpoints, resume_from
from steplib.handlers import EarlyStopping, Scheduler, export_best


def _state() -> TrainState:
    model = torch.nn.Linear(2, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _evaluator(values: list[float], every: int = 2) -> Evaluator:
    feed = iter(values)
    return Evaluator(
        make_eval_step(lambda m, b: torch.tensor(next(feed))),
        [0],
        metrics={"mean": MeanMetric()},
        every=every,
        monitor="val_mean",
        sanity_batches=0,
    )


STEP = make_train_step(lambda m, b: m(b).pow(2).mean())


def test_a_save_at_fit_end_records_no_score_of_an_earlier_model_and_never_wins(
    tmp_path: Path,
) -> None:
    # Evaluations at 2 and 4 (1.0 is the best, at 4); the run ends at 5, unevaluated. Before,
    # the save at 5 was labelled 1.0 (update 4's score), tied the real best, won the tie, and
    # the real best was pruned.
    evaluator = _evaluator([3.0, 1.0])
    keep = checkpoint_every(str(tmp_path), every=2, keep_best=1, metric=evaluator)
    run(STEP, _state(), [torch.ones(3, 2)] * 5, events=[evaluator, keep])
    kept = {c.step: c.metrics for c in list_checkpoints(str(tmp_path))}
    assert sorted(kept) == [4, 5]  # the best, and the newest
    assert kept[4]["val_mean"] == 1.0 and "val_mean" not in kept[5]
    best = best_checkpoint(str(tmp_path), evaluator)
    assert [c.step for c in list_checkpoints(str(tmp_path)) if c.url == best] == [4]
    assert evaluator.best.step == 4


def test_saves_between_evaluations_record_none_of_their_values_and_prune(tmp_path: Path) -> None:
    # Saves every update, evaluations every 3: the saves at 1, 2, 4, 5 scored nothing.
    evaluator = _evaluator([2.0, 1.0], every=3)
    keep = checkpoint_every(
        str(tmp_path), every=1, keep_last=1, keep_best=1, metric=evaluator, at_end=False
    )
    run(STEP, _state(), [torch.ones(3, 2)] * 7, events=[evaluator, keep])
    kept = {c.step: c.metrics.get("val_mean") for c in list_checkpoints(str(tmp_path))}
    assert kept == {6: 1.0, 7: None}


def test_a_save_holds_what_handlers_attached_after_it_did_at_the_same_event(
    tmp_path: Path,
) -> None:
    # The checkpoint handler attached first, the evaluator and a handler that writes the
    # extras after it: the save at each update still holds both (it runs last at its event).
    evaluator = _evaluator([3.0, 1.0, 2.0])
    keep = checkpoint_every(str(tmp_path), every=2, at_end=False)

    def note(event: Any) -> NewState:
        extras = {**event.state.extras, "noted_at": event.step}
        return NewState(event.state.replace(extras=extras))

    events = Events(keep, evaluator).on("step_end", note, every=2)
    run(STEP, _state(), [torch.ones(3, 2)] * 6, events=events)
    recorded = [(c.step, c.metrics["val_mean"], c.metrics["noted_at"]) for c in
                list_checkpoints(str(tmp_path))]  # fmt: skip
    assert recorded == [(2, 3.0, 2), (4, 1.0, 4), (6, 2.0, 6)]


def test_a_scheduler_stepped_at_epoch_end_is_saved_after_its_step(tmp_path: Path) -> None:
    # A per-epoch scheduler attached after checkpoint_every: the checkpoint at each epoch end
    # holds it after that epoch's step, so the resumed epoch runs at the rate it should.
    def build() -> tuple[TrainState, Scheduler]:
        state = _state()
        sched = torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=1, gamma=0.5)
        return state, Scheduler(sched)

    state, per_epoch = build()
    keep = checkpoint_every(str(tmp_path), at_epoch_end=True, at_end=False)
    run(STEP, state, [torch.ones(3, 2)] * 2, events=Events(keep, per_epoch), max_epochs=2)
    assert per_epoch.scheduler.last_epoch == 2

    fresh, resumed = build()
    events = Events(resume_from(str(tmp_path)), resumed)
    after = run(STEP, fresh, [torch.ones(3, 2)] * 2, events=events, max_epochs=2)
    assert after.epoch == 2  # resumed at the end: nothing left to train
    assert resumed.scheduler.last_epoch == 2
    assert fresh.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**2


def _weights_by_update(events: Events) -> dict[int, float]:
    seen: dict[int, float] = {}
    events.on("step_end", lambda e: seen.__setitem__(e.step, e.state.model.bias.item()))
    return seen


def test_export_best_between_evaluations_exports_no_model_with_another_updates_score(
    tmp_path: Path,
) -> None:
    # Evaluations at 2, 4, 6 (1.0, the best, at 2); the exporter checks every 3 updates. At
    # 3 it found update 2's 1.0 in the extras and exported the model of update 3 with it (a
    # model nobody evaluated, under the best score), and at 6 kept it as the best.
    evaluator = _evaluator([1.0, 3.0, 2.0])
    exporter = export_best(str(tmp_path / "best.pt"), monitor="val_mean")
    events = Events(evaluator).on("step_end", exporter, every=3)
    weights = _weights_by_update(events)
    run(STEP, _state(), [torch.ones(3, 2)] * 6, events=events)
    assert (exporter.best.value, exporter.best.step) == (2.0, 6)  # the one it saw evaluated
    exported = torch.load(tmp_path / "best.pt", weights_only=True)
    assert exported["bias"].item() == weights[6]


def test_early_stopping_by_name_between_evaluations_counts_each_evaluation_once() -> None:
    # Evaluations every 2 updates, checks every 3: a check between two evaluations read the
    # last one's value again, counted it as another check without improvement and labelled
    # the best with an update that was not evaluated.
    evaluator = _evaluator([3.0, 2.0, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5])
    stopper = EarlyStopping("val_mean", patience=2)
    events = Events(evaluator).on("step_end", stopper, every=3)
    final = run(STEP, _state(), [torch.ones(3, 2)] * 16, events=events)
    # Checked at 6 (2.5), 12 (2.5) and 18 (never reached): values of updates 6 and 12 only.
    assert (stopper.best.value, stopper.best.step, stopper.wait) == (2.5, 6, 1)
    assert final.step == 16


def test_early_stopping_attached_before_its_evaluator_checks_each_evaluation_at_its_update() -> (
    None
):
    # Attached first, the stopper ran at step_end before the evaluation of that update and
    # checked the previous one's value: a stop one evaluation late, its best mislabelled.
    def stops(first: str) -> tuple[int, dict[str, Any]]:
        evaluator = _evaluator([3.0, 1.0, 2.0, 2.0, 2.0, 2.0])
        stopper = EarlyStopping(evaluator, patience=2)
        handlers = [evaluator, stopper] if first == "evaluator" else [stopper, evaluator]
        final = run(STEP, _state(), [torch.ones(3, 2)] * 12, events=handlers)
        return final.step, stopper.state_dict()

    assert (
        stops("stopper")
        == stops("evaluator")
        == (
            8,
            {
                "monitor": "val_mean",
                "mode": "min",
                "best": {"value": 1.0, "step": 4},
                "wait": 2,
                "evaluations": 4,
            },
        )
    )


def test_a_value_watched_by_name_in_the_other_mode_than_its_evaluators_is_refused(
    tmp_path: Path,
) -> None:
    # An accuracy ranked "max" by its evaluator, watched by name with the default mode "min":
    # export_best kept the model of update 2 (accuracy 0.1) as the best of 0.1, 0.2, 0.3,
    # keep_best=1 kept update 2's checkpoint, EarlyStopping(patience=2) stopped at update 6
    # while the accuracy improved at each evaluation; all in silence.
    def accuracy() -> Evaluator:
        feed = iter([0.1, 0.2, 0.3, 0.4])
        return Evaluator(
            make_eval_step(lambda m, b: torch.tensor(next(feed))),
            [0],
            metrics={"acc": MeanMetric()},
            every=2,
            monitor="val_acc",
            mode="max",
            sanity_batches=0,
        )

    data = [torch.ones(3, 2)] * 6
    url = str(tmp_path / "best.pt")
    for mode in ("min", "max"):  # the default, and the evaluator's
        watchers: list[tuple[str, Any]] = [
            ("export_best", export_best(url, monitor="val_acc", mode=mode)),
            ("EarlyStopping", EarlyStopping("val_acc", mode=mode, patience=2)),
        ]
        for owner, watcher in watchers:
            events = Events(accuracy()).on("step_end", watcher, every=2)
            if mode == "min":
                with pytest.raises(ConfigError, match=rf"{owner} ranks 'val_acc' in mode 'min'"):
                    run(STEP, _state(), data, events=events)
            else:
                assert run(STEP, _state(), data, events=events).step == 6
                assert watcher.best.step == 6
        keep = checkpoint_every(
            str(tmp_path / mode), every=2, keep_best=1, metric="val_acc", mode=mode
        )
        if mode == "min":
            with pytest.raises(
                ConfigError, match=r"ranks 'val_acc' in mode 'min'.*metric=evaluator"
            ):
                run(STEP, _state(), data, events=Events(accuracy(), keep))
        else:
            run(STEP, _state(), data, events=Events(accuracy(), keep))
            kept = list_checkpoints(str(tmp_path / mode))
            assert [(c.step, c.metrics["val_acc"]) for c in kept] == [(6, pytest.approx(0.3))]


def test_a_name_an_attached_evaluator_monitors_is_not_refused_before_its_first_evaluation(
    tmp_path: Path,
) -> None:
    # metric= by name, saves every update, evaluations every 3: the saves at 1 and 2 come
    # before any evaluation. Before, the first raised "found no 'val_mean' among this
    # checkpoint's metrics" though the attached evaluator monitors that name (timm's recipe).
    evaluator = _evaluator([2.0, 1.0], every=3)
    keep = checkpoint_every(
        str(tmp_path), every=1, keep_last=1, keep_best=1, metric="val_mean", at_end=False
    )
    run(STEP, _state(), [torch.ones(3, 2)] * 7, events=[evaluator, keep])
    kept = {c.step: c.metrics.get("val_mean") for c in list_checkpoints(str(tmp_path))}
    assert kept == {6: 1.0, 7: None}


def test_a_misspelt_name_is_still_refused_at_the_first_save(tmp_path: Path) -> None:
    evaluator = _evaluator([2.0, 1.0], every=3)
    keep = checkpoint_every(str(tmp_path), every=1, keep_best=1, metric="val_maen")
    with pytest.raises(ConfigError, match="found no 'val_maen'"):
        run(STEP, _state(), [torch.ones(3, 2)] * 7, events=[evaluator, keep])

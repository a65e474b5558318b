"""Retention: keep_last and keep_best (min and max) keep exactly the right set."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import fsspec
import pytest
import torch

from steplib import ConfigError, Event, Events, NewState, TrainState, make_train_step, run
from steplib.checkpoint import (
    CheckpointInfo,
    CheckpointWarning,
    best_checkpoint,
    checkpoint_every,
    checkpointer,
    list_checkpoints,
    load,
    prune,
    resume_from,
    save,
    storage,
)
from steplib.checkpoint.retention import select_retained
from steplib.data import resumable_loader
from steplib.handlers import BestValue
from tests.checkpoint_helpers import make_state, memory_dir
from tests.reference import make_batches, mean_loss

__all__ = ["memory_dir"]

VALUES = [0.9, 0.3, 0.7, 0.1, 0.8, 0.5]  # the metric of checkpoints 1..6


def _infos(values: Sequence[float | None]) -> list[CheckpointInfo]:
    return [
        CheckpointInfo(f"u{s}", f"step-{s:08d}", s, s, 0, 0.0, {} if v is None else {"val": v})
        for s, v in enumerate(values, start=1)
    ]


def _steps(infos: list[CheckpointInfo]) -> list[int]:
    return [c.step for c in infos]


def test_keep_last_keeps_the_newest() -> None:
    assert _steps(select_retained(_infos(VALUES), keep_last=2)) == [5, 6]
    assert _steps(select_retained(_infos(VALUES), keep_last=10)) == [1, 2, 3, 4, 5, 6]


def test_keep_best_min_and_max_survive_pruning_of_the_last() -> None:
    infos = _infos(VALUES)
    kept = select_retained(infos, keep_last=2, keep_best=2, metric="val", mode="min")
    assert _steps(kept) == [2, 4, 5, 6]  # 0.1 and 0.3 are the best, 5 and 6 the last
    kept = select_retained(infos, keep_last=1, keep_best=2, metric="val", mode="max")
    assert _steps(kept) == [1, 5, 6]  # 0.9, 0.8 are the best; 6 is the newest


def test_keep_best_alone_still_keeps_the_newest_and_ignores_missing_or_nan() -> None:
    infos = _infos([0.2, None, math.nan, 0.1, None])
    kept = select_retained(infos, keep_last=None, keep_best=1, metric="val")
    assert _steps(kept) == [4, 5]


def test_a_tie_is_not_an_improvement_the_older_checkpoint_is_kept() -> None:
    kept = select_retained(_infos([0.1, 0.1, 0.5]), keep_last=1, keep_best=1, metric="val")
    assert _steps(kept) == [1, 3]


def test_one_tie_rule_for_keep_best_best_checkpoint_and_best_value() -> None:
    # Equal values at steps 2 and 3: each of them names step 2, the first to reach it.
    values = [0.5, 0.1, 0.1, 0.3]
    best = BestValue(mode="min")
    for step, value in enumerate(values, start=1):
        best.update(value, step=step)
    kept = select_retained(_infos(values), keep_last=1, keep_best=1, metric="val")
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    directory = "memory://test-one-tie-rule"
    urls = [
        save(state.replace(step=step), directory, metrics={"val": value})
        for step, value in enumerate(values, start=1)
    ]
    assert best.step == 2
    assert _steps(kept) == [2, 4]
    assert best_checkpoint(directory, "val") == urls[1]


def test_no_retention_keeps_everything() -> None:
    assert _steps(select_retained(_infos(VALUES), keep_last=None)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"keep_last": 0}, r"keep_last=\.\.\.\) received 0"),
        ({"keep_last": 2, "keep_best": 1}, r"needs the metric to rank by"),
        ({"keep_last": 2, "mode": "avg"}, r"mode=\.\.\.\) received 'avg'.*'min' \(e\.g\. a loss"),
        ({"keep_last": True}, r"keep_last=\.\.\.\) received True"),
    ],
)
def test_bad_retention_settings_are_refused(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        prune("memory://unused", **arguments)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        checkpoint_every("memory://unused", every=1, **arguments)  # type: ignore[arg-type]


def test_prune_deletes_exactly_the_others(memory_dir: str) -> None:
    state = make_state()
    urls = [
        save(state.replace(step=s), memory_dir, metrics={"val": v})
        for s, v in enumerate(VALUES, start=1)
    ]
    deleted = prune(memory_dir, keep_last=2, keep_best=2, metric="val", mode="min")
    assert deleted == [urls[0], urls[2]]
    assert [c.step for c in list_checkpoints(memory_dir)] == [2, 4, 5, 6]
    fs = fsspec.filesystem("memory")
    assert not fs.exists(urls[0].removeprefix("memory://"))  # no files left behind


def test_checkpoint_every_keeps_the_best_by_a_metric_from_extras(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    step = make_train_step(mean_loss)

    def evaluate(event: object) -> NewState:
        # Stand-in for an evaluation handler: a made-up val_loss that is best at step 2.
        state = event.state  # type: ignore[attr-defined]
        val = {1: 0.5, 2: 0.05, 3: 0.6, 4: 0.7, 5: 0.8, 6: 0.9}[state.step]
        return NewState(state.replace(extras={"val_loss": val}))

    events = Events().on("step_end", evaluate)
    checkpoint_every(
        directory, every=1, keep_last=2, keep_best=1, metric="val_loss", mode="min"
    ).attach(events)
    run(step, make_state(), make_batches(6), events=events)
    kept = list_checkpoints(directory)
    assert [c.step for c in kept] == [2, 5, 6]
    assert kept[0].metrics["val_loss"] == 0.05 and "loss" in kept[0].metrics
    assert sorted(os.listdir(directory)) == ["step-00000002", "step-00000005", "step-00000006"]


def test_prune_removes_what_crashed_saves_left_but_not_newer(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    state = make_state()
    for s in (1, 2, 3):
        save(state.replace(step=s), str(directory))
    (directory / ".tmp-step-00000002-0badf00d").mkdir()  # a crashed local save
    (directory / "step-00000001-micro-00000009").mkdir()  # an uncommitted one, older
    (directory / ".tmp-step-00000009-0badf00d").mkdir()  # newer than the newest: kept
    prune(str(directory), keep_last=2)
    assert sorted(os.listdir(directory)) == [
        ".tmp-step-00000009-0badf00d",
        "step-00000002",
        "step-00000003",
    ]


def test_metrics_must_be_numbers(memory_dir: str) -> None:
    with pytest.raises(ConfigError, match=r"'val' is 'low'"):
        save(make_state(), memory_dir, metrics={"val": "low"})
    url = save(make_state(), memory_dir, metrics={"val": torch.tensor(0.25)})
    assert list_checkpoints(memory_dir)[-1].metrics == {"val": 0.25} and url


@pytest.mark.parametrize("background", [False, True])
def test_a_misspelt_keep_best_metric_is_refused_before_anything_is_pruned(
    tmp_path: Path, background: bool
) -> None:
    directory = str(tmp_path / "ckpt")
    state = make_state()
    # A resumed run's directory: its best checkpoint (step 1) is the oldest.
    for s, acc in ((1, 0.9), (2, 0.5), (3, 0.6)):
        save(state.replace(step=s), directory, metrics={"val_accuracy": acc})
    step = make_train_step(mean_loss)

    def evaluate(event: object) -> NewState:
        return NewState(event.state.replace(extras={"val_accuracy": 0.4}))  # type: ignore[attr-defined]

    events = Events().on("step_end", evaluate)
    ckpt = checkpoint_every(
        directory,
        every=1,
        keep_last=1,
        keep_best=1,
        metric="val_acuracy",  # misspelt
        mode="max",
        background=background,
    )
    ckpt.attach(events)
    with pytest.raises(ConfigError, match=r"found no 'val_acuracy'") as info:
        run(step, state.replace(step=3), make_batches(2), events=events)
    assert "they are: loss, val_accuracy" in str(info.value)
    ckpt.wait()
    assert [c.step for c in list_checkpoints(directory)] == [1, 2, 3]  # nothing saved or pruned


def test_a_save_killed_while_it_wrote_leaves_nothing_once_the_handler_starts(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    state = make_state()
    save(state.replace(step=2), str(directory))
    # Killed during its last save: the staging directory of a step newer than the newest.
    (directory / ".tmp-step-00000003-0badf00d").mkdir()
    (directory / ".tmp-step-00000003-0badf00d" / "model.pt").write_bytes(b"half")
    ckpt = checkpoint_every(str(directory), every=100)  # no retention settings
    ckpt.on_fit_start(Event("fit_start", state.replace(step=2), step=2))
    assert sorted(os.listdir(directory)) == ["step-00000002"]


def test_leftovers_go_at_the_next_save_but_not_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ckpt"
    state = make_state()
    ckpt = checkpoint_every(str(directory), every=1, background=True)
    ckpt.on_fit_start(Event("fit_start", state, step=0))
    release, commit = threading.Event(), storage.commit

    def held_commit(*args: object, **kwargs: object) -> storage.Location:
        release.wait(timeout=30)
        return commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(storage, "commit", held_commit)
    ckpt.save(Event("step_end", state.replace(step=1), step=1))
    deadline = time.monotonic() + 30
    while not (in_flight := [n for n in os.listdir(directory) if n.startswith(".tmp-step-")]):
        assert time.monotonic() < deadline, "the background save never began"
        time.sleep(0.01)
    assert len(in_flight) == 1 and ckpt._saver is not None and ckpt._saver.pending
    ckpt.on_fit_start(Event("fit_start", state, step=0))  # e.g. a notebook cell run again
    assert in_flight[0] in os.listdir(directory)  # the save in flight owns it: untouched
    release.set()
    ckpt.wait()
    (directory / ".tmp-step-00000007-0badf00d").mkdir()  # newer than the newest
    ckpt.save(Event("step_end", state.replace(step=2), step=2))
    ckpt.wait()
    assert sorted(os.listdir(directory)) == ["step-00000001", "step-00000002"]


def test_only_rank_0_removes_leftovers_newer_than_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ckpt"
    state = make_state()
    save(state.replace(step=2), str(directory))
    (directory / ".tmp-step-00000001-0badf00d").mkdir()  # older: any process removes it
    (directory / ".tmp-step-00000003-0badf00d").mkdir()  # another rank may be writing it
    monkeypatch.setattr(checkpointer, "is_main", lambda: False)
    at_2 = Event("fit_start", state.replace(step=2), step=2)
    checkpoint_every(str(directory), every=100).on_fit_start(at_2)
    assert sorted(os.listdir(directory)) == [".tmp-step-00000003-0badf00d", "step-00000002"]


def test_a_save_off_the_schedule_without_the_metric_prunes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A run that ends before its first scheduled save: the save at fit_end is not refused (no
    # evaluation may have run yet), but a misspelt metric must not prune the best either.
    directory = str(tmp_path / "ckpt")
    state = make_state()
    for s, acc in ((1, 0.9), (2, 0.5)):
        save(state.replace(step=s), directory, metrics={"val_accuracy": acc})
    step = make_train_step(mean_loss)
    events = checkpoint_every(
        directory, every=100, keep_last=1, keep_best=1, metric="val_acuracy", mode="max"
    ).attach(Events())
    with caplog.at_level("WARNING", logger="steplib.checkpoint"):
        run(step, state.replace(step=2), make_batches(2), events=events)
    assert [c.step for c in list_checkpoints(directory)] == [1, 2, 4]
    assert "'val_acuracy'" in caplog.text and "saved without pruning" in caplog.text


def test_a_fresh_run_into_a_directory_of_newer_checkpoints_warns(tmp_path: Path) -> None:
    # Before, in silence: keep_last kept the earlier run's step-8 and step-10 and deleted each
    # checkpoint of this run as it was written, and a resume would have loaded step-10.
    directory, step = str(tmp_path), make_train_step(mean_loss)

    def train(state: TrainState, steps: int, *first: object) -> TrainState:
        ckpt = checkpoint_every(directory, every=2, keep_last=2)
        data = resumable_loader(make_batches(12), batch_size=None)  # its position is saved
        return run(step, state, data, events=[*first, ckpt], max_steps=steps)

    train(make_state(), 10)
    said = r"newer than this run's state \(at update 0\): step-00000008, step-00000010, of"
    with pytest.warns(CheckpointWarning, match=said):
        train(make_state(), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resumed, or rewound by hand: where it was loaded from
        train(make_state(), 12, resume_from(directory))
        state = load(f"{directory}/step-00000010", make_state())
        train(state, 12)

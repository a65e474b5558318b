"""Retention: keep_last and keep_best (min and max) keep exactly the right set."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import fsspec
import pytest
import torch

from steplib import ConfigError, Events, NewState, make_train_step, run
from steplib.checkpoint import (
    CheckpointInfo,
    checkpoint_every,
    list_checkpoints,
    prune,
    save,
    select_retained,
)
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


def test_ties_go_to_the_newer_checkpoint() -> None:
    kept = select_retained(_infos([0.1, 0.1, 0.5]), keep_last=1, keep_best=1, metric="val")
    assert _steps(kept) == [2, 3]


def test_no_retention_keeps_everything() -> None:
    assert _steps(select_retained(_infos(VALUES), keep_last=None)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"keep_last": 0}, r"keep_last=\.\.\.\) received 0"),
        ({"keep_last": 2, "keep_best": 1}, r"needs the metric to rank by"),
        ({"keep_last": 2, "mode": "avg"}, r"'min' \(lower is better"),
        ({"keep_last": True}, r"keep_last=\.\.\.\) received True"),
    ],
)
def test_bad_retention_settings_are_refused(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        select_retained(_infos(VALUES), **arguments)  # type: ignore[arg-type]
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
        directory, every=1, keep_last=2, keep_best=1, metric="val_loss", mode="min", step=step
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

"""A log continued by a run resumed after a kill holds each step once, as the log of the same
run without the kill: the records the killed run wrote after its last checkpoint are written
again by the resumed run, so the file sinks drop them (TensorBoard hides them, purge_step)."""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from steplib import Events, TrainState, clip, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.handlers import Evaluator, GradNormMonitor, ProgressBar, Throughput, TrainMetrics
from steplib.handlers.logging import (
    CSVLogger,
    JsonlLogger,
    Log,
    TensorBoardLogger,
    event_record,
)


class _KilledError(Exception):
    pass


def _training() -> tuple[TrainState, Any, Any]:
    """A linear model's state, its step and 10 batches of 4 that a checkpoint can resume."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, batch: m(batch).pow(2).mean())
    data = resumable_loader(
        torch.randn(40, 2, generator=torch.Generator().manual_seed(1)), batch_size=4
    )
    return state, step, data


def _run(root: Path, out: Path, *, kill_at: int | None) -> None:
    """Ten updates, a checkpoint every 4, each update logged to a JSONL file (a bare sink) and
    a CSV file (through Log); killed after update ``kill_at`` is logged."""
    state, step, data = _training()
    ckpt = checkpoint_every(str(root / "ckpt"), every=4)
    with JsonlLogger(str(out / "m.jsonl")) as jsonl, CSVLogger(str(out / "m.csv")) as table:
        events = Events(resume_from(ckpt), ckpt, Log(table, every=1))
        events.on("step_end", jsonl)

        def kill(event) -> None:
            if event.step == kill_at:
                raise _KilledError

        events.on("step_end", kill)
        run(step, state, data, events=events, max_steps=10)


def _jsonl(path: Path) -> list[tuple[int, float]]:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return [(line["step"], line["loss"]) for line in lines]


def _csv(path: Path) -> list[tuple[str, str]]:
    rows = list(csv.DictReader(path.read_text().splitlines()))
    return [(row["step"], row["loss"]) for row in rows]


def test_a_resumed_runs_jsonl_and_csv_logs_hold_each_step_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path / "reference", tmp_path / "reference", kill_at=None)
    with pytest.raises(_KilledError):
        _run(tmp_path / "killed", tmp_path / "killed", kill_at=6)  # checkpoint at 4
    with caplog.at_level(logging.INFO, logger="steplib.logging"):
        _run(tmp_path / "killed", tmp_path / "killed", kill_at=None)
    assert "dropped 2 record(s) at step 5" in caplog.text

    reference = _jsonl(tmp_path / "reference" / "m.jsonl")
    assert [s for s, _ in reference] == list(range(1, 11))
    assert _jsonl(tmp_path / "killed" / "m.jsonl") == reference
    assert _csv(tmp_path / "killed" / "m.csv") == _csv(tmp_path / "reference" / "m.csv")


def test_a_log_continued_at_later_steps_keeps_every_record(tmp_path: Path) -> None:
    url = str(tmp_path / "m.jsonl")
    with JsonlLogger(url) as log:
        log.write({"step": 1, "loss": 2.0})
    with JsonlLogger(url) as log:
        log.write({"step": 2, "loss": 1.0})
    assert _jsonl(Path(url)) == [(1, 2.0), (2, 1.0)]


def test_a_run_from_the_start_into_an_earlier_runs_log_warns_that_it_replaces_it(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "m.jsonl")
    with JsonlLogger(url) as log:
        for step in (1, 2, 3):
            log.write({"step": step, "loss": 9.0})
    said = r"replaces the 3 record\(s\) an earlier run wrote"
    with pytest.warns(UserWarning, match=said), JsonlLogger(url) as log:
        log.write({"step": 1, "loss": 1.0})
    assert _jsonl(Path(url)) == [(1, 1.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said so: the file starts afresh
        with JsonlLogger(url, append=False) as log:
            log.write({"step": 1, "loss": 0.5})
    assert _jsonl(Path(url)) == [(1, 0.5)]


def test_a_resumed_runs_tensorboard_points_hold_each_step_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # the `tb` extra; CI installs it
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )

    tb_dir = str(tmp_path / "tb")
    torch.manual_seed(0)
    for kill_at in (6, None):
        # A resumed run starts in another process and a later second. Here, opened within the
        # same second, TensorBoard orders the two files by their per-process counters as text
        # (".10" before ".9"), so the test failed when another test had opened nine writers.
        time.sleep(1.0 if kill_at is None else 0.0)
        with TensorBoardLogger(tb_dir) as tb:
            start = 1 if kill_at else 5  # the resumed run starts after the checkpoint at 4
            for step in range(start, (kill_at or 10) + 1):
                tb.write({"step": step, "loss": float(step)})
    reader = EventAccumulator(tb_dir)
    reader.Reload()
    assert [point.step for point in reader.Scalars("loss")] == list(range(1, 11))


def _counted_run(root: Path, max_steps: int) -> tuple[ProgressBar, list[dict]]:
    """A run to ``max_steps`` with a bar and a Throughput attached before resume_from."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, batch: m(batch).pow(2).mean())  # a mean: batches/s
    data = resumable_loader(torch.randn(400, 2), batch_size=4)
    ckpt = checkpoint_every(str(root / "ckpt"), every=50)
    bar = ProgressBar(every=5, file=io.StringIO(), samples_per_step=4)
    speed = Throughput()
    reads: list[dict] = []
    events = Events(bar, speed, resume_from(ckpt), ckpt)
    events.on("step_end", lambda event: reads.append(speed.read(event)), every=5)
    run(step, state, data, events=events, max_steps=max_steps)
    return bar, reads


def test_a_bar_and_throughput_attached_before_resume_from_count_this_runs_updates(
    tmp_path: Path,
) -> None:
    """They read where the counters start at fit_start; a resume_from after them swapped the
    resumed state in later, so they counted the earlier run's 60 updates as this run's."""
    _counted_run(tmp_path, 60)
    bar, reads = _counted_run(tmp_path, 70)  # resumes at 60 and makes 10 updates
    assert bar.stats["samples"] == 10 * 4  # was 70 * 4
    assert [sorted(r) for r in reads] == [["batches_per_s", "steps_per_s"]] * 2  # was tokens


def _interval_run(root: Path, *, max_steps: int) -> None:
    """TrainMetrics' means logged every 2 updates (JSONL, CSV, TensorBoard), a checkpoint
    every 5: a run stopped at 5 saves there before its fit_end record of update 5."""
    state, step, data = _training()
    ckpt, train = checkpoint_every(str(root / "ckpt"), every=5), TrainMetrics()
    sinks = [
        JsonlLogger(str(root / "m.jsonl")),
        CSVLogger(str(root / "m.csv")),
        TensorBoardLogger(str(root / "tb")),
    ]
    log = Log(sinks, sources=[train.read], every=2)
    with log:
        events = Events(resume_from(ckpt), train, ckpt, log)
        run(step, state, data, events=events, max_steps=max_steps)


def test_a_record_written_after_the_save_of_its_update_is_replaced_at_the_resume(
    tmp_path: Path,
) -> None:
    # Stopped at 5 (max_steps, a preemption), the checkpoint at 5 holds TrainMetrics' sums of
    # update 5, which the fit_end record of 5 then read. The resumed run's record at 6 covers
    # updates 5 and 6: the record of 5 was kept beside it, update 5 logged twice (11 of 10).
    _interval_run(tmp_path / "whole", max_steps=10)
    _interval_run(tmp_path / "parts", max_steps=5)
    _interval_run(tmp_path / "parts", max_steps=10)
    lines = [orjson.loads(line) for line in (tmp_path / "parts" / "m.jsonl").read_bytes().split()]
    assert [(line["step"], line["updates"]) for line in lines] == [
        (2, 2),
        (4, 2),
        (6, 2),
        (8, 2),
        (10, 2),
    ]
    whole = (tmp_path / "whole" / "m.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["loss"] for line in whole] == [line["loss"] for line in lines]
    rows = list(csv.DictReader((tmp_path / "parts" / "m.csv").read_text().splitlines()))
    assert [row["step"] for row in rows] == ["2", "4", "6", "8", "10"]


def _norms_run(root: Path, *, max_steps: int) -> list[dict[str, Any]]:
    """GradNormMonitor's means alone logged every 2 updates, a checkpoint every 5."""
    state, step, data = _training()
    ckpt, norms = checkpoint_every(str(root / "ckpt"), every=5), GradNormMonitor()
    with Log(JsonlLogger(str(root / "m.jsonl")), sources=[norms.read], every=2) as log:
        events = Events(resume_from(ckpt), norms, ckpt, log)
        run(clip(step, max_norm=10.0), state, data, events=events, max_steps=max_steps)
    return [orjson.loads(line) for line in (root / "m.jsonl").read_bytes().split()]


def test_a_grad_norm_record_written_after_the_save_of_its_update_is_replaced_at_the_resume(
    tmp_path: Path,
) -> None:
    # As for TrainMetrics: the checkpoint at 5 holds the norm of update 5, which the stopped
    # run's fit_end record of 5 read; the resumed run's record at 6 covers 5 and 6 again. The
    # record said not which updates it covered, so the one of 5 was kept: update 5 twice.
    whole = _norms_run(tmp_path / "whole", max_steps=10)
    _norms_run(tmp_path / "parts", max_steps=5)
    parts = _norms_run(tmp_path / "parts", max_steps=10)
    assert [line["step"] for line in parts] == [2, 4, 6, 8, 10]
    assert [line["updates"] for line in parts] == [2] * 5
    for key in ("grad_norm_mean", "grad_norm_max"):
        assert [line[key] for line in parts] == [line[key] for line in whole]


def _evaluated_run(
    root: Path, *, max_steps: int, **options: Any
) -> tuple[list[Any], list[dict[str, str]]]:
    """TrainMetrics' means every 2 updates and an evaluation every 5 (or as ``options`` say)
    into one JSONL and one CSV file, a checkpoint every 5 (after the evaluation at its update)."""
    from torchmetrics import MeanMetric

    state, step, data = _training()
    ckpt, train = checkpoint_every(str(root / "ckpt"), every=5), TrainMetrics()
    val = [torch.randn(4, 2, generator=torch.Generator().manual_seed(2))]
    sinks = [JsonlLogger(str(root / "m.jsonl")), CSVLogger(str(root / "m.csv"))]
    evaluate = make_eval_step(lambda m, batch: {"value": m(batch).pow(2).flatten()})
    options = {"every": 5, **options}
    evaluator = Evaluator(evaluate, val, metrics={"loss": MeanMetric()}, sinks=sinks, **options)
    with Log(sinks, sources=[train.read], every=2) as log:
        events = Events(resume_from(ckpt), train, evaluator, ckpt, log)
        run(step, state, data, events=events, max_steps=max_steps)
    lines = [orjson.loads(line) for line in (root / "m.jsonl").read_bytes().split()]
    rows = list(csv.DictReader((root / "m.csv").read_text().splitlines()))
    return [(line["step"], line.get("updates"), line.get("val_loss")) for line in lines], rows


def test_an_evaluation_at_the_resumed_update_is_kept_in_the_continued_log(tmp_path: Path) -> None:
    # Stopped at 5: the evaluation at 5 was logged before the save, the means of update 5 at
    # fit_end after it. The resumed run's first record (6) covers updates 5 and 6, so the
    # files dropped every record from step 5 on: the evaluation at 5 too, which the resumed
    # run does not run again, so it was lost. Only the means of update 5 are written again.
    whole, whole_rows = _evaluated_run(tmp_path / "whole", max_steps=10)
    _evaluated_run(tmp_path / "parts", max_steps=5)
    parts, rows = _evaluated_run(tmp_path / "parts", max_steps=10)
    assert [(s, u) for s, u, _ in whole] == [
        (2, 2), (4, 2), (5, None), (6, 2), (8, 2), (10, None), (10, 2),
    ]  # fmt: skip
    assert parts == whole
    assert [(r["step"], r["updates"], r["val_loss"]) for r in rows] == [
        (r["step"], r["updates"], r["val_loss"]) for r in whole_rows
    ]


def test_a_resumed_runs_first_means_replace_a_stopped_runs_even_after_an_evaluation(
    tmp_path: Path,
) -> None:
    # Stopped at 5 (saved there), its fit_end record holds the means of update 5. The resumed
    # run's first record was the evaluation at 6 (every 3), which holds no means, so the files
    # kept that record of 5 beside the resumed run's of 5 and 6: update 5 counted twice.
    options = {"every": 3, "at_fit_end": False}
    whole, whole_rows = _evaluated_run(tmp_path / "whole", max_steps=10, **options)
    _evaluated_run(tmp_path / "parts", max_steps=5, **options)
    parts, rows = _evaluated_run(tmp_path / "parts", max_steps=10, **options)
    assert [(s, u) for s, u, _ in whole] == [
        (2, 2), (3, None), (4, 2), (6, None), (6, 2), (8, 2), (9, None), (10, 2),
    ]  # fmt: skip
    assert parts == whole
    assert [(r["step"], r["updates"]) for r in rows] == [
        (r["step"], r["updates"]) for r in whole_rows
    ]


@pytest.mark.parametrize("end", ["stopped", "crashed"])
def test_a_run_resumed_in_the_same_process_with_the_same_sinks_logs_each_update_once(
    tmp_path: Path, end: str
) -> None:
    # A notebook runs the cell again after a stop at 5 (saved there) or a crash at 7 (saved at
    # 5): the same sinks and handlers, resumed from 5. A sink dropped what a run writes again
    # at its own first record only, so the first run's records of 5 (and 6) stayed.
    def runs(root: Path, limits: list[int], crash_at: int | None) -> tuple[list[Any], list[str]]:
        state, step, data = _training()
        ckpt, train = checkpoint_every(str(root / "ckpt"), every=5), TrainMetrics()
        sinks = [JsonlLogger(str(root / "m.jsonl")), CSVLogger(str(root / "m.csv"))]
        events = Events(resume_from(ckpt), train, ckpt, Log(sinks, sources=[train.read], every=2))
        crashed: list[int] = []

        def crash(event) -> None:
            if event.step == crash_at and not crashed:
                crashed.append(event.step)
                raise _KilledError

        events.on("step_end", crash)
        for limit in limits:
            with contextlib.suppress(_KilledError):
                run(step, state, data, events=events, max_steps=limit)
        lines = [orjson.loads(line) for line in (root / "m.jsonl").read_bytes().split()]
        rows = list(csv.DictReader((root / "m.csv").read_text().splitlines()))
        return [(x["step"], x["updates"], x["loss"]) for x in lines], [r["step"] for r in rows]

    whole = runs(tmp_path / "whole", [10], None)
    stopped = end == "stopped"
    parts = runs(tmp_path / "parts", [5, 10] if stopped else [10, 10], None if stopped else 7)
    assert [s for s, _, _ in whole[0]] == [2, 4, 6, 8, 10]
    assert parts == whole


def _evaluated_tensorboard_run(root: Path, *, max_steps: int) -> dict[str, list[int]]:
    """As ``_evaluated_run``, into TensorBoard: the steps of the loss and val_loss points."""
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )
    from torchmetrics import MeanMetric

    state, step, data = _training()
    ckpt, train = checkpoint_every(str(root / "ckpt"), every=5), TrainMetrics()
    val = [torch.randn(4, 2, generator=torch.Generator().manual_seed(2))]
    tb = TensorBoardLogger(str(root / "tb"))
    evaluate = make_eval_step(lambda m, batch: {"value": m(batch).pow(2).flatten()})
    evaluator = Evaluator(evaluate, val, metrics={"loss": MeanMetric()}, every=5, sinks=tb)
    with Log(tb, sources=[train.read], every=2) as log:
        events = Events(resume_from(ckpt), train, evaluator, ckpt, log)
        run(step, state, data, events=events, max_steps=max_steps)
    reader = EventAccumulator(str(root / "tb"))
    reader.Reload()
    return {name: [point.step for point in reader.Scalars(name)] for name in ("loss", "val_loss")}


@pytest.mark.parametrize("end", ["stopped", "crashed"])
def test_an_evaluation_at_the_resumed_update_keeps_its_tensorboard_point(
    tmp_path: Path, end: str
) -> None:
    # The evaluation at 5 is logged before the save at 5. The resumed run's first point (6)
    # covers updates 5 and 6, and its first update (5) was the purge_step: the val_loss point
    # at 5 was hidden, and the resumed run does not evaluate 5 again ([10], not [5, 10]).
    pytest.importorskip("tensorboard")  # the `tb` extra; CI installs it
    whole = _evaluated_tensorboard_run(tmp_path / "whole", max_steps=10)
    parts = tmp_path / "parts"
    if end == "stopped":
        _evaluated_tensorboard_run(parts, max_steps=5)
    else:  # the first run wrote up to 8 (saved at 5), then was killed
        _evaluated_tensorboard_run(parts, max_steps=8)
        shutil.rmtree(parts / "ckpt" / "step-00000008")  # killed before this save
    time.sleep(1.0)  # the resumed run's event file sorts after the first's (see above)
    resumed = _evaluated_tensorboard_run(parts, max_steps=10)
    assert whole == {"loss": [2, 4, 6, 8, 10], "val_loss": [5, 10]}
    assert resumed["val_loss"] == [5, 10]
    # A stopped run's fit_end point of the means of update 5 (written after the save) stays
    # beside the resumed run's of 5 and 6; the purge hides the crashed run's points from 6 on.
    assert resumed["loss"] == ([2, 4, 5, 6, 8, 10] if end == "stopped" else [2, 4, 6, 8, 10])


def _means_run(
    root: Path, *, kill_at: int | None = None, every: int = 3, means: bool = True
) -> None:
    """Six updates, a checkpoint each, TrainMetrics' means (or, not ``means``, each update's
    own values) logged every ``every`` updates."""
    state, step, data = _training()
    train = TrainMetrics()
    ckpt = checkpoint_every(str(root / "ckpt"), every=1, durable=False)
    sources = [train.read] if means else [event_record]
    with JsonlLogger(str(root / "m.jsonl")) as jsonl:
        events = Events(resume_from(ckpt), train, Log(jsonl, sources=sources, every=every))
        events.add(ckpt)

        def kill(event: Any) -> None:
            raise _KilledError

        if kill_at is not None:
            events.on("step_end", kill, once=kill_at, last=True)  # after the save
        run(step, state, data, events=events, max_steps=6)


def test_a_run_resumed_inside_its_first_interval_does_not_say_it_starts_over(
    tmp_path: Path,
) -> None:
    # Resumed from update 2, its first record (3) holds the means of updates 1 to 3 (the
    # restored TrainMetrics' and its own), as a fresh run's does: the JSONL and CSV sinks
    # warned "this run starts at its beginning" and that it replaced an earlier run's records.
    with pytest.raises(_KilledError):
        _means_run(tmp_path, kill_at=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _means_run(tmp_path)
    lines = [orjson.loads(line) for line in (tmp_path / "m.jsonl").read_bytes().splitlines()]
    assert [(line["step"], line["updates"]) for line in lines] == [(3, 3), (6, 3)]


def test_a_fresh_run_into_an_earlier_runs_log_warns_whatever_its_first_step(
    tmp_path: Path,
) -> None:
    # A fresh run whose first record is at update 2 replaced the earlier run's records from
    # step 2 on in silence (and kept its record of update 1): only a first record at update 1
    # was taken for a run from the start.
    _means_run(tmp_path, every=2, means=False)
    shutil.rmtree(tmp_path / "ckpt")  # another run, into the same log
    with pytest.warns(UserWarning, match=r"replaces the 3 record\(s\) an earlier run wrote"):
        _means_run(tmp_path, every=2, means=False)

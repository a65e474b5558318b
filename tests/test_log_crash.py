"""A run that raises: the updates since the last record are in the log (as a stop's are at
fit_end), and the run's own error is the one raised, whatever the log's reads do then."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from steplib import Events, TrainState, make_train_step, run
from steplib.handlers import TrainMetrics
from steplib.handlers.logging import JsonlLogger, Log


class _CrashError(Exception):
    pass


def _crashed_run(url: str, *, sources: Any = None, crash_at: int = 7) -> list[dict[str, Any]]:
    """Eight batches, TrainMetrics' means logged every 5 updates; raises after ``crash_at``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, batch: m(batch).pow(2).mean())
    train = TrainMetrics()

    def crash(event) -> None:
        if event.step == crash_at:
            raise _CrashError("the run's own error")

    with Log(JsonlLogger(url, append=False), sources=sources or [train.read], every=5) as log:
        events = Events(train, log)
        events.on("step_end", crash)
        with pytest.raises(_CrashError, match="the run's own error"):
            run(step, state, list(torch.randn(8, 4, 2)), events=events, max_steps=8)
    return [orjson.loads(line) for line in Path(url).read_bytes().splitlines()]


def test_a_crashed_runs_log_holds_the_updates_since_its_last_record(tmp_path: Path) -> None:
    # The record at 5 was the log's last: updates 6 and 7, the ones just before the error
    # (a diverging loss), were in no record.
    lines = _crashed_run(str(tmp_path / "m.jsonl"))
    assert [(line["step"], line["updates"]) for line in lines] == [(5, 5), (7, 2)]


def test_a_read_that_fails_at_the_crash_is_logged_not_raised_over_the_runs_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # After a device error a tensor read raises again: the run's error stays the one raised.
    def source(event) -> dict[str, Any]:
        if event.step == 7:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"answer": 42}

    with caplog.at_level(logging.ERROR, logger="steplib.logging"):
        lines = _crashed_run(str(tmp_path / "m.jsonl"), sources=[source])
    assert [line["step"] for line in lines] == [5]
    assert "could not write the record of update 7 while the run was failing" in caplog.text


def test_a_crash_on_several_ranks_writes_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A source may all-reduce, and the other ranks need not be at the error: no record.
    import steplib.handlers.logging.log as log_module

    monkeypatch.setattr(log_module, "world_size", lambda: 2)
    lines = _crashed_run(str(tmp_path / "m.jsonl"))
    assert [line["step"] for line in lines] == [5]


def test_a_crash_in_a_handler_before_the_log_is_written_at_its_update(tmp_path: Path) -> None:
    # An alarm attached before the Log raised at update 7's step_end: the record went out at
    # the last step_end the Log saw (6) with TrainMetrics' sums of 6 and 7 under it.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    train, url = TrainMetrics(), str(tmp_path / "m.jsonl")

    def alarm(event) -> None:
        if event.step == 7:
            raise _CrashError("the run's own error")

    events = Events(train)
    events.on("step_end", alarm)
    with Log(JsonlLogger(url, append=False), sources=[train.read], every=5) as log:
        log.attach(events)
        with pytest.raises(_CrashError):
            run(make_train_step(lambda m, b: m(b).pow(2).mean()), state,
                list(torch.randn(8, 4, 2)), events=events, max_steps=8)  # fmt: skip
    lines = [orjson.loads(line) for line in Path(url).read_bytes().splitlines()]
    assert [(line["step"], line["updates"]) for line in lines] == [(5, 5), (7, 2)]


def test_a_crash_after_an_epochs_end_writes_its_last_update_as_the_run_would_have(
    tmp_path: Path,
) -> None:
    # The update at 8 (epoch 0's last) was not due; a crash at that epoch's end wrote it at the
    # error's counters: epoch 1, which it was not in, and without the step's own values (the
    # error's event carries no output): not the record a stop there would have written.
    def crash(event) -> None:
        raise _CrashError("the run's own error")

    url = str(tmp_path / "m.jsonl")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, batch: m(batch).pow(2).mean())
    with Log(JsonlLogger(url, append=False), every=5) as log:
        events = Events(log)
        events.on("epoch_end", crash)
        with pytest.raises(_CrashError):
            run(step, state, list(torch.randn(8, 4, 2)), events=events, max_epochs=2)
    last = orjson.loads(Path(url).read_bytes().splitlines()[-1])
    assert (last["step"], last["epoch"], last["micro_step"]) == (8, 0, 8)
    assert isinstance(last.get("loss"), float) and last["lr"] == 0.1

"""``validation_end`` and ``checkpoint_end``: a plain handler gets what the evaluator recorded,
once per evaluation, and each committed checkpoint once, complete on disk when it arrives
(sync and background saves), on the training thread."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torchmetrics import MeanMetric

from steplib import Evaluator, Events, Stop, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, latest, list_checkpoints, load, pipeline
from tests.checkpoint_helpers import make_state
from tests.reference import make_batches, mean_loss


def _squared_error(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return (model(x) - y) ** 2


def _evaluator(**settings: Any) -> Evaluator:
    return Evaluator(
        make_eval_step(_squared_error),
        make_batches(2, seed=7),
        metrics={"loss": MeanMetric()},
        sanity_batches=1,
        **settings,
    )


def test_validation_end_brings_what_the_evaluator_recorded_once_per_evaluation() -> None:
    evaluator = _evaluator(every=2, at_epoch_end=True, at_fit_end=True, monitor="val_loss")
    seen: list[tuple[int, dict[str, Any], Any]] = []

    def record(event: Any) -> None:
        seen.append((event.step, dict(event.metrics), event.state.extras["val_loss"]))

    events = Events(evaluator).on("validation_end", record)
    run(make_train_step(mean_loss), make_state(), make_batches(5), events=events)
    # Every 2 updates, then at the epoch's end (update 5); fit_end finds update 5 evaluated.
    assert [step for step, _ in evaluator.history] == [2, 4, 5]
    assert [(step, metrics) for step, metrics, _ in seen] == evaluator.history
    # The event's state holds the values (the one the loop goes on with).
    assert [extra for _, _, extra in seen] == [metrics["val_loss"] for _, metrics, _ in seen]


def test_a_stop_from_a_validation_end_handler_stops_the_loop() -> None:
    evaluator = _evaluator(every=2)
    events = Events(evaluator).on("validation_end", lambda e: Stop(f"validated at {e.step}"))
    state = run(make_train_step(mean_loss), make_state(), make_batches(6), events=events)
    assert state.step == 2 and len(evaluator.history) == 1


@pytest.mark.parametrize("in_background", [False, True])
def test_checkpoint_end_reports_each_committed_checkpoint_once_complete_on_disk(
    tmp_path: Path, in_background: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if in_background:
        write = pipeline.write

        def slow_write(*args: Any, **kwargs: Any) -> str:
            time.sleep(0.05)  # the commit lands while training goes on
            return write(*args, **kwargs)

        monkeypatch.setattr(pipeline, "write", slow_write)
    directory = str(tmp_path)
    step = make_train_step(mean_loss)
    params: dict[int, list[torch.Tensor]] = {}
    reported: list[tuple[int, Any]] = []

    def on_checkpoint(event: Any) -> None:
        info = event.checkpoint
        assert threading.current_thread() is threading.main_thread()
        # Committed and complete: latest() reads back and checks every file of it.
        assert latest(directory) == info.url
        (listed,) = [c for c in list_checkpoints(directory) if c.url == info.url]
        assert dataclasses.replace(listed, time=info.time) == info
        loaded = load(info.url, make_state(seed=5), step=step)
        assert all(map(torch.equal, loaded.model.parameters(), params[info.step]))
        reported.append((event.step, info))

    events = Events().on("step_end", lambda e: params.update({e.step: _copies(e.state)}))
    events.add(checkpoint_every(directory, every=2, keep_last=1, background=in_background))
    events.on("checkpoint_end", on_checkpoint)
    run(step, make_state(), make_batches(5), events=events)
    # Every 2 updates, and the final state at fit_end: each reported once, in order.
    assert [info.step for _, info in reported] == [2, 4, 5]
    assert all(step >= info.step for step, info in reported)
    assert [sorted(info.metrics) for _, info in reported] == [["loss"], ["loss"], ["loss"]]
    if not in_background:  # reported by the handler that saved, at that update
        assert [step for step, _ in reported] == [2, 4, 5]


def _copies(state: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def test_a_stop_from_checkpoint_end_stops_the_loop_and_a_failed_save_is_not_reported(
    tmp_path: Path,
) -> None:
    reported: list[int] = []

    def stop_after_the_first(event: Any) -> Stop:
        reported.append(event.checkpoint.step)
        return Stop("uploaded the first checkpoint")

    events = Events(checkpoint_every(str(tmp_path / "ok"), every=2, at_end=False))
    events.on("checkpoint_end", stop_after_the_first)
    state = run(make_train_step(mean_loss), make_state(), make_batches(6), events=events)
    assert (state.step, reported) == (2, [2])

    directory = tmp_path / "broken"
    failing = Events(checkpoint_every(str(directory), every=2, background=True))

    def break_the_directory(event: Any) -> None:
        # After the start's check the directory becomes a file: the background save at 2 fails.
        shutil.rmtree(directory)
        directory.write_text("not a directory")

    failing.on("step_end", break_the_directory, once=1)
    failing.on("checkpoint_end", lambda e: reported.append(e.checkpoint.step))
    with pytest.raises(pipeline.CheckpointError, match="could not write"):
        run(make_train_step(mean_loss), make_state(), make_batches(3), events=failing)
    assert reported == [2]  # nothing more

"""``every=`` counts optimizer updates (an int) or batches (``Batches(n)``), the same for the
emitter, logging, evaluation and checkpoints (issue 28): with ``accumulate(step, 4)``,
``every=Batches(10)`` fires at the ``step_end`` of the update whose window holds batch 10, 20,
30, ..., counted over the run (a resumed run goes on counting), never inside a window."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics

from steplib import (
    ConfigError,
    Evaluator,
    Events,
    ProgressBar,
    TrainState,
    accumulate,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    resumable_loader,
    resume_from,
    run,
)
from steplib.checkpoint import list_checkpoints
from steplib.events import Batches
from steplib.handlers import Log
from tests.reference import RecordingSink


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


STEP = accumulate(make_train_step(lambda m, b: m(b).pow(2).mean()), 4)


def data() -> Any:
    """18 batches (5 updates per epoch: 4 + 4 + 4 + 4 + 2 batches), whose position is saved."""
    return resumable_loader([torch.ones(2, 2)] * 18, batch_size=None, shuffle=False)


# The updates whose windows hold batch 10, 20, 30 over two epochs (batches 1-18, 19-36): update
# 3 holds 9-12, update 6 holds 19-22 (the first of epoch 2), update 8 holds 27-30.
UPDATES = [3, 6, 8]


def test_every_n_batches_fires_on_the_update_that_holds_the_nth_batch(tmp_path: Any) -> None:
    sink, seen, micro = RecordingSink(), [], []
    evaluator = Evaluator(
        make_eval_step(lambda m, b: m(b)),
        [torch.ones(2, 2)],
        metrics={"mean": torchmetrics.MeanMetric()},
        every=Batches(10),
        sanity_batches=0,
    )
    ckpt = checkpoint_every(str(tmp_path), every=Batches(10), at_end=False)
    events = Events(Log(sink, every=Batches(10)), evaluator, ckpt)
    events.on("step_end", lambda e: seen.append(e.step), every=Batches(10))
    events.on("micro_step_end", lambda e: micro.append(e.micro_step), every=Batches(10))
    run(STEP, _state(), data(), events=events, max_epochs=2)
    assert seen == UPDATES
    assert [r["step"] for r in sink.records] == [*UPDATES, 10]  # and the run's last, at its end
    assert [step for step, _ in evaluator.history] == UPDATES
    assert [c.step for c in list_checkpoints(str(tmp_path))] == UPDATES
    assert micro == [10, 20, 30]
    # A plain int counts updates, as before.
    by_updates: list[int] = []
    events = Events().on("step_end", lambda e: by_updates.append(e.step), every=3)
    run(STEP, _state(), data(), events=events, max_epochs=2)
    assert by_updates == [3, 6, 9]


def test_a_resumed_run_goes_on_counting_batches_where_it_stopped(tmp_path: Any) -> None:
    ckpt = checkpoint_every(str(tmp_path), every=2, at_end=False)
    run(STEP, _state(), data(), events=Events(ckpt), max_steps=4)  # saved at update 4: batch 16
    seen: list[int] = []
    events = Events(resume_from(ckpt), ckpt)
    events.on("step_end", lambda e: seen.append(e.step), every=Batches(10))
    run(STEP, _state(), data(), events=events, max_epochs=2)
    assert seen == UPDATES[1:]  # 6 and 8, as in the run without the interruption


@pytest.mark.parametrize(
    "make",
    [
        lambda: Events().on("epoch_end", print, every=Batches(2)),
        lambda: Events().on("step_end", print, every=Batches(0)),
        lambda: Log(RecordingSink(), every=2.5),  # type: ignore[arg-type]
        lambda: ProgressBar(every=0),
        lambda: checkpoint_every("memory://x", every="10"),  # type: ignore[arg-type]
    ],
)
def test_a_cadence_that_is_neither_updates_nor_batches_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match=r"received|Batches\(n\)"):
        make()


def test_batches_is_not_an_int() -> None:
    with pytest.raises(ConfigError, match=r"Batches\(n\) \(batches\)"):
        Log(RecordingSink(), every=0)

"""After ``run`` returns (or raises), the handlers hold nothing of the run: a script keeps its
``Events`` and handlers until it ends, and what they held of the run (its state, so its DDP
model and that model's process group) outlived ``del state`` and ``shutdown()``; gloo's threads
then ran on and could abort the finished job's exit. The two-rank version of this law, threads
counted, is in tests/test_distributed_setup.py."""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics

from steplib import (
    EarlyStopping,
    Evaluator,
    Events,
    Throughput,
    TrainMetrics,
    TrainState,
    accumulate,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
)
from steplib.checkpoint import preemption
from tests.reference import make_batches, mean_loss, tiny_model


def _handlers(directory: str) -> list[Any]:
    evaluator = Evaluator(
        make_eval_step(mean_loss),
        {"val": make_batches(2)},
        metrics={"loss": torchmetrics.MeanMetric()},
        every=2,
        monitor="val_loss",
    )
    saves = checkpoint_every(directory, every=2, keep_best=1, metric=evaluator, background=True)
    stops = EarlyStopping(evaluator)
    return [TrainMetrics(), Throughput(), evaluator, stops, saves, preemption(saves)]


def _run(directory: str, *, fail_at: int | None) -> tuple[weakref.ref[Any], Events, list[Any]]:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    calls = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("the run fails here")
        return mean_loss(model, batch)

    events, handlers = Events(), _handlers(directory)
    events.on("fit_start", resume_from(directory))
    for handler in handlers:
        handler.attach(events)
    step = accumulate(make_train_step(loss_fn), 2)
    with pytest.raises(RuntimeError) if fail_at else contextlib.nullcontext():
        run(step, state, make_batches(12), events=events, max_steps=5)
    return weakref.ref(model), events, handlers


@pytest.mark.parametrize("fail_at", [None, 5], ids=["ended", "raised"])
def test_the_handlers_free_the_runs_model_once_the_run_is_over(
    tmp_path: Path, fail_at: int | None
) -> None:
    model, events, handlers = _run(str(tmp_path), fail_at=fail_at)
    gc.collect()  # cycles are not the handlers' doing: only what they hold counts
    assert model() is None, "a handler kept the run's model after it ended"
    assert handlers and events  # still alive, as in a script before it ends

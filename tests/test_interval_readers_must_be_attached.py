"""A log source that sums the updates since its last read (TrainMetrics, Throughput,
GradNormMonitor) sees each update only when it is attached to the run. Given to a Log as a
source alone, it used to see only the update it was read at, and reported that one as the
interval's: ``Log(every=3)`` wrote the last update's loss as the mean of three, a third of the
updates per second, and ``updates: 1``. Now the read refuses a run it is not attached to."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from steplib import Event, Events, TrainState, clip, make_train_step, run
from steplib.errors import ConfigError
from steplib.handlers import GradNormMonitor, Throughput, TrainMetrics
from steplib.handlers.logging import Log
from tests.reference import RecordingSink


def _batches() -> list[torch.Tensor]:
    return [torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _plain_losses() -> list[float]:
    """The loss of each update, from the loop a careful person writes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in _batches():
        loss = _loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _readers() -> list[Any]:
    now = [0.0]
    return [TrainMetrics(), Throughput(clock=lambda: now[0]), GradNormMonitor()]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["TrainMetrics", "Throughput", "GradNormMonitor"])
def test_a_reader_given_to_log_without_being_attached_is_refused(index: int) -> None:
    reader = _readers()[index]
    events = Events().on("step_end", Log(RecordingSink(), sources=[reader.read]), every=3)
    step = clip(make_train_step(_loss), max_norm=10.0)
    with pytest.raises(ConfigError, match=r"not attached.*\.attach\(events\)"):
        run(step, _state(), _batches(), events=events)


def test_an_attached_train_metrics_logs_the_mean_of_every_update_of_the_interval() -> None:
    train = TrainMetrics()
    sink = RecordingSink()
    events = Events(Log(sink, sources=[train.read], every=3), train)  # read before update
    run(make_train_step(_loss), _state(), _batches(), events=events)

    plain = _plain_losses()
    means = [sum(plain[:3]) / 3, sum(plain[3:]) / 3]  # equal batch sizes: the plain mean
    assert [r["updates"] for r in sink.records] == [3, 3]
    assert [r["loss"] for r in sink.records] == pytest.approx(means, rel=1e-6)


def test_a_reader_called_outside_a_run_reads_what_update_added() -> None:
    # A hand-written loop calls update() and read() itself; its events belong to no run.
    train = TrainMetrics()
    state, step = _state(), make_train_step(_loss)
    plain = _plain_losses()

    for batch in _batches()[:3]:
        state, out = step(state, batch)
        train.update(Event("step_end", state, output=out, step=state.step))
    assert train.read(None)["loss"] == pytest.approx(sum(plain[:3]) / 3, rel=1e-6)

"""Profiler: the schedule writes one Chrome trace per cycle with the step's operators; it stops
on an exception; bad settings are errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from steplib import ConfigError, Events, TrainState, make_train_step, run
from steplib.handlers import Profiler


def _run(profiler: Profiler, n: int, *, fail_at: int | None = None) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("boom")
        return model(batch).pow(2).mean()

    return run(
        make_train_step(loss_fn), state, [torch.ones(3, 8)] * n, events=profiler.attach(Events())
    )


def test_one_trace_per_cycle_holding_the_step_operators(tmp_path: Path) -> None:
    profiler = Profiler(str(tmp_path / "prof"), wait=1, warmup=1, active=2, repeat=2)
    _run(profiler, 10)
    names = [os.path.basename(p) for p in profiler.traces]
    assert names == ["trace_rank0_step4.json", "trace_rank0_step8.json"]
    with open(profiler.traces[0]) as f:
        trace = json.load(f)
    ops = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in ops  # the Linear's forward
    assert any(str(op).startswith("Optimizer.step") for op in ops)  # and the update


def test_a_continued_runs_traces_are_named_by_its_updates_and_keep_the_earlier_ones(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda model, batch: model(batch).pow(2).mean())
    for _ in range(2):  # a run, then one continuing its state (as a resumed run does)
        profiler = Profiler(str(tmp_path), wait=1, warmup=1, active=2)
        state = run(step, state, [torch.ones(3, 8)] * 6, events=profiler.attach(Events()))
    # The second run's cycle recorded updates 9 and 10; it overwrote step4's trace before.
    assert [os.path.basename(p) for p in profiler.traces] == ["trace_rank0_step10.json"]
    assert sorted(os.listdir(tmp_path)) == ["trace_rank0_step10.json", "trace_rank0_step4.json"]


def test_an_exception_stops_the_profiler(tmp_path: Path) -> None:
    profiler = Profiler(str(tmp_path), wait=0, warmup=1, active=10)
    with pytest.raises(RuntimeError, match="boom"):
        _run(profiler, 8, fail_at=4)
    assert profiler._profiler is None
    assert len(profiler.traces) == 1  # the cycle that was recording is written
    profiler.stop()  # again: harmless


@pytest.mark.parametrize(
    "kwargs",
    [{"active": 0}, {"wait": -1}, {"warmup": 1.5}, {"repeat": -1}],
)
def test_bad_schedules_are_config_errors(kwargs, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Profiler(str(tmp_path), **kwargs)
    with pytest.raises(ConfigError, match="trace_dir"):
        Profiler("")

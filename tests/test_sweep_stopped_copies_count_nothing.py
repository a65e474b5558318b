"""A stopped copy of a sweep has no update: it is neither applied nor skipped, whatever its
gradients hold. Its own run stopped there, so it counts no skip (``out.skipped``,
``state.skipped_updates``, ``consecutive_skips``, ``TrainMetrics``' ``skipped``) and its loss,
NaN once it diverged, raises no ``NonFiniteAlarm``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import steplib as sl
from steplib.handlers import GradNormMonitor, NonFiniteAlarm, TrainMetrics
from steplib.sweep import Copies, SweepAdamW, SweepSGD, stop_copies, sweep_step
from tests.reference import make_batches, mean_loss, tiny_model

N = 3


def diverged_and_stopped(
    make_opt: Any, wrap: Any, *, diverged: bool = True
) -> tuple[sl.TrainState, Any]:
    """Copy 1's weights are NaN (it diverged) and it is stopped; copies 0 and 2 train."""
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    with torch.no_grad():
        copies.stacked.get_parameter("0.weight")[1].fill_(float("nan") if diverged else 0.5)
    opt = make_opt(copies.parameters(), lr=[1e-2, 3e-2, 1e-1])
    stop_copies(opt, [1])
    state = sl.TrainState.create(model=copies, optimizer=opt)
    batches = make_batches(4, seed=2)
    step = sweep_step(wrap(sl.make_train_step(mean_loss)), copies=copies, example_batch=batches[0])
    return state, step


@pytest.mark.parametrize("make_opt", [SweepAdamW, SweepSGD])
def test_a_stopped_copy_with_nan_gradients_counts_no_skipped_update(make_opt: Any) -> None:
    """It counted one skipped copy-update per update (``skipped_updates`` 4 after 4 updates,
    ``consecutive_skips`` 4, ``out.skipped`` True for copy 1)."""
    state, step = diverged_and_stopped(make_opt, sl.skip_nonfinite)
    for batch in make_batches(4, seed=2):
        state, out = step(state, batch)
        assert out.skipped.tolist() == [False, False, False]
        assert out.did_update.tolist() == [True, False, True]
    assert int(state.skipped_updates) == 0
    assert int(state.consecutive_skips) == 0


def test_an_active_copy_that_diverges_beside_a_stopped_one_counts_its_skips() -> None:
    """The count is of active copies only, not switched off: copy 2, active, whose weights
    turn NaN, counts its skips as before."""
    state, step = diverged_and_stopped(SweepSGD, sl.skip_nonfinite)
    assert isinstance(state.model, Copies)
    with torch.no_grad():
        state.model.stacked.get_parameter("0.weight")[2].fill_(float("nan"))
    for batch in make_batches(3, seed=2):
        state, out = step(state, batch)
    assert out.skipped.tolist() == [False, False, True]
    assert int(state.skipped_updates) == 3


def assert_only_copy_1_has_no_norm(mean: Any) -> None:
    assert isinstance(mean, list), mean
    assert [math.isnan(m) for m in mean] == [False, True, False], mean


def clipped(step: sl.Step) -> sl.Step:
    return sl.clip(step, max_norm=1.0)


@pytest.mark.parametrize("wrap", [sl.skip_nonfinite, clipped], ids=["skip", "clip"])
def test_a_stopped_copy_is_no_alarm_and_no_update_in_the_metrics(wrap: Any) -> None:
    """NonFiniteAlarm judged a copy by ``~skipped``: without ``skip_nonfinite`` a stopped
    copy's NaN loss raised NonFiniteError at the first read (its update was never applied).
    TrainMetrics counted copy 1 skipped at every update (``skipped: [0, 4, 0]``), and
    GradNormMonitor averaged the norms of a copy that had no update (a finite stopped copy:
    a number where its own run, stopped, has none)."""
    state, step = diverged_and_stopped(SweepAdamW, wrap)
    metrics, norms = TrainMetrics(), GradNormMonitor()
    events = norms.attach(metrics.attach(sl.Events(NonFiniteAlarm(every=1))))
    sl.run(step, state, make_batches(4, seed=2), events=events)
    record = metrics.read(None)
    assert record["updates"] == 4 and "skipped" not in record, record
    assert_only_copy_1_has_no_norm(norms.read(None)["grad_norm_mean"])
    state, step = diverged_and_stopped(SweepAdamW, wrap, diverged=False)
    events = norms.attach(metrics.attach(sl.Events()))
    sl.run(step, state, make_batches(4, seed=2), events=events)
    assert_only_copy_1_has_no_norm(norms.read(None)["grad_norm_mean"])

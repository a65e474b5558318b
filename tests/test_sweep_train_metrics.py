"""TrainMetrics and GradNormMonitor on a sweep: each copy's record equals the one its own plain
run writes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import steplib as sl
from steplib.handlers import GradNormMonitor, TrainMetrics
from steplib.sweep import Copies, SweepSGD, sweep_step

LRS = [0.05, 0.1, 0.2]


def _make() -> torch.nn.Module:
    return torch.nn.Linear(3, 1).double()


Loss = tuple[torch.Tensor, int, dict[str, torch.Tensor]]


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> Loss:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
    return loss, len(y), {"w": model.weight.sum()}


def _nan_for_copy_0(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> Loss:
    # NaN where the bias is below -0.2: copy 0 (seed 0) only, whose updates are then skipped.
    loss, count, aux = _loss(model, batch)
    return loss + 0 * torch.log(model.bias.sum() + 0.2), count, aux


def _same(a: object, b: object) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9)  # type: ignore[arg-type]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(4, 3, generator=g, dtype=torch.float64),
            torch.randn(4, 1, generator=g).double(),
        )
        for _ in range(6)
    ]


def _read(step: sl.Step | object, state: sl.TrainState) -> dict[str, object]:
    train = TrainMetrics()
    sl.run(step, state, _batches(), events=train.attach(sl.Events()))  # type: ignore[arg-type]
    return train.read(None)


@pytest.mark.parametrize("loss_fn", [_loss, _nan_for_copy_0], ids=["all", "one_skipped"])
def test_train_metrics_of_a_sweep_are_each_copys_own_run(loss_fn: Any) -> None:
    copies = Copies.seeded(_make, seeds=range(3))
    state = sl.TrainState.create(model=copies, optimizer=SweepSGD(copies.parameters(), lr=LRS))
    wrapped = sl.skip_nonfinite(sl.accumulate(sl.make_train_step(loss_fn), 2))
    swept = _read(sweep_step(wrapped, copies=copies, example_batch=_batches()[0]), state)
    for i, lr in enumerate(LRS):
        torch.manual_seed(i)
        model = _make()
        plain = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr))
        own = _read(sl.skip_nonfinite(sl.accumulate(sl.make_train_step(loss_fn), 2)), plain)
        assert swept["updates"] == own["updates"] == 3
        for key in ("loss", "w", "lr"):
            assert _same(swept[key][i], own[key]), (key, i)  # type: ignore[index]
        assert swept["num_targets"][i] == own["num_targets"]  # type: ignore[index]
        assert swept.get("skipped", [0] * 3)[i] == own.get("skipped", 0)  # type: ignore[index]


def _norms(step: sl.Step | object, state: sl.TrainState) -> dict[str, Any]:
    norms = GradNormMonitor()
    sl.run(step, state, _batches(), events=norms.attach(sl.Events()))  # type: ignore[arg-type]
    return norms.read(None)


@pytest.mark.parametrize("loss_fn", [_loss, _nan_for_copy_0], ids=["all", "one_skipped"])
def test_grad_norm_monitor_of_a_sweep_is_each_copys_own_run(loss_fn: Any) -> None:
    # Its read compared a copy's count with 0 as one number: a TypeError at the first read.
    copies = Copies.seeded(_make, seeds=range(3))
    state = sl.TrainState.create(model=copies, optimizer=SweepSGD(copies.parameters(), lr=LRS))

    def wrapped() -> sl.Step:
        step = sl.clip(sl.accumulate(sl.make_train_step(loss_fn), 2), max_norm=0.5)
        return sl.skip_nonfinite(step)

    swept = _norms(sweep_step(wrapped(), copies=copies, example_batch=_batches()[0]), state)
    for i, lr in enumerate(LRS):
        torch.manual_seed(i)
        model = _make()
        plain = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr))
        own = _norms(wrapped(), plain)  # {} when every update of this copy was skipped
        for key in ("grad_norm_mean", "grad_norm_max"):
            assert _same(swept[key][i], own.get(key, math.nan)), (key, i)

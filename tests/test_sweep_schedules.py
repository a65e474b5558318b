"""torch schedulers over a sweep's per-copy rates: one that scales the rate gives each copy its
own run's rate (within 1e-12 in float64); one that sets or bounds it by an absolute value
(eta_min, max_lr) would give each copy that value times its rate, and is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler
from torch.optim.swa_utils import SWALR

import steplib as sl
from steplib.handlers import Scheduler
from steplib.sweep import Copies, SweepAdamW, sweep_step
from tests.reference import make_batches, mean_loss, tiny_model

N = 3
LRS = [1e-3, 1e-2, 3e-2]
BATCHES = [(x.double(), y.double(), m) for x, y, m in make_batches(20, seed=3)]

Make = Callable[[torch.optim.Optimizer], Any]


def cosine_to_floor(opt: torch.optim.Optimizer) -> Any:
    return lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)


ABSOLUTE: dict[str, tuple[Make, str]] = {
    "cosine eta_min": (cosine_to_floor, "CosineAnnealingLR has eta_min=0.0001"),
    "restarts eta_min": (
        lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=1e-4),
        "CosineAnnealingWarmRestarts has eta_min=0.0001",
    ),
    "one cycle": (
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=20, cycle_momentum=False),
        "OneCycleLR has max_lr=0.01",
    ),
    "cyclic": (
        lambda o: lr_scheduler.CyclicLR(o, 1e-4, 1e-2, step_size_up=5, cycle_momentum=False),
        "CyclicLR has max_lr=0.01",
    ),
    "swa": (lambda o: SWALR(o, swa_lr=0.01), "SWALR has swa_lr=0.01"),
    "sequential": (
        lambda o: lr_scheduler.SequentialLR(
            o, [lr_scheduler.LinearLR(o, 0.1, total_iters=5), cosine_to_floor(o)], [5]
        ),
        "SequentialLR's CosineAnnealingLR has eta_min",
    ),
}


def own_runs(make: Make, *, peak: bool = False) -> list[torch.nn.Module]:
    """Each copy's own run: AdamW at its rate (``peak``: the rate is the schedule's max_lr)."""
    models = []
    for i in range(N):
        model = tiny_model(i).double()
        opt = torch.optim.AdamW(model.parameters(), lr=LRS[i])
        sched = make(opt) if not peak else make_one_cycle(opt, LRS[i])
        for batch in BATCHES:
            mean_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        models.append(model)
    return models


def make_one_cycle(opt: torch.optim.Optimizer, max_lr: float) -> Any:
    return lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=20, cycle_momentum=False)


def sweep(make: Make) -> tuple[Copies, Any, sl.TrainState]:
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = SweepAdamW(copies.parameters(), lr=LRS)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=make(opt))
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=BATCHES[0])
    return copies, step, state


@pytest.mark.parametrize("name", sorted(ABSOLUTE))
def test_a_scheduler_with_an_absolute_rate_over_per_copy_rates_is_refused(name: str) -> None:
    """CosineAnnealingLR(eta_min=1e-4) over rates [1e-3, 1e-2, 3e-2] trained every copy 0.8e-3
    to 1.1e-3 away from its own run in 30 updates (the floor became 1e-4 * lr[i]), in silence."""
    make, what = ABSOLUTE[name]
    copies, step, state = sweep(make)
    before = [p.detach().clone() for p in copies.parameters()]
    with pytest.raises(sl.ConfigError, match=what) as error:
        step(state, BATCHES[0])
    assert "Give the optimizer one lr for all copies" in str(error.value)
    assert all(torch.equal(b, p) for b, p in zip(before, copies.parameters(), strict=True))


def test_the_same_schedulers_over_one_rate_for_all_copies_are_taken() -> None:
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=BATCHES[0])
    for name, (make, _) in ABSOLUTE.items():
        opt = SweepAdamW(copies.parameters(), lr=1e-3, weight_decay=[0.0, 0.1, 0.2])
        state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=make(opt))
        state, out = step(state, BATCHES[0])
        assert out.did_update.all(), name


@pytest.mark.parametrize("make", [lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=20)])
def test_a_scheduler_that_scales_the_rate_gives_each_copy_its_own_runs_rate(make: Make) -> None:
    copies, step, state = sweep(make)
    for batch in BATCHES:
        state, _ = step(state, batch)
    assert_same(copies, own_runs(make))


def test_one_cycle_with_max_lr_1_over_per_copy_peaks_is_each_copys_one_cycle() -> None:
    """The fix the refusal names: max_lr=1.0 makes OneCycleLR a factor of each copy's rate."""
    copies, step, state = sweep(lambda o: make_one_cycle(o, 1.0))
    for batch in BATCHES:
        state, _ = step(state, batch)
    assert_same(copies, own_runs(lambda o: o, peak=True))


def test_a_per_epoch_scheduler_with_an_absolute_floor_is_refused_at_fit_start() -> None:
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = SweepAdamW(copies.parameters(), lr=LRS)
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=BATCHES[0])
    before = [p.detach().clone() for p in copies.parameters()]
    per_epoch = Scheduler(lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4))
    with pytest.raises(sl.ConfigError, match="Scheduler: the scheduler's CosineAnnealingLR"):
        sl.run(step, state, BATCHES, events=[per_epoch], max_epochs=3)
    assert all(torch.equal(b, p) for b, p in zip(before, copies.parameters(), strict=True))


def assert_same(copies: Copies, models: list[torch.nn.Module]) -> None:
    for i, model in enumerate(models):
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)

"""A ``CosineAnnealingLR`` stepped past its ``T_max`` climbs back to the base rate (torch's cosine
is periodic): a ``T_max`` given in epochs to the state's scheduler, which the step steps at
every update, makes the rate oscillate every ``T_max`` updates in silence. Warned once, at the
step that starts the climb; a schedule that ends where the run ends, or restarts by design,
is not warned about."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

from steplib import Events, TrainState, make_train_step, run
from steplib.handlers import Scheduler

WARNED = r"CosineAnnealingLR\(T_max=4\) reaches eta_min=0.0 here.*periodic\. It is "


def _run(make: Any, *, updates: int = 10, per_epoch: bool = False) -> list[float]:
    """``updates`` updates of 1 batch (an epoch each with ``per_epoch``); the rates used."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = make(optimizer)
    state = TrainState.create(
        model=model, optimizer=optimizer, scheduler=None if per_epoch else scheduler
    )
    rates: list[float] = []
    events = Events(Scheduler(scheduler)) if per_epoch else Events()
    events.on("step_end", lambda event: rates.append(float(event.output.lr)))
    step = make_train_step(lambda m, batch: m(batch).pow(2).mean())
    data = [torch.ones(1, 2)] if per_epoch else [torch.ones(1, 2)] * updates
    epochs, steps = (updates, None) if per_epoch else (None, updates)
    run(step, state, data, events=events, max_epochs=epochs, max_steps=steps)
    return rates


def test_a_cosine_stepped_past_t_max_each_update_is_warned_at_the_climb() -> None:
    # T_max=4 (epochs, say) stepped each update: 1.0 at update 9 again, after 0.0 at 5.
    with pytest.warns(UserWarning, match=WARNED) as caught:
        rates = _run(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4))
    assert len([w for w in caught if "T_max" in str(w.message)]) == 1
    assert rates[4] == 0.0 and rates[8] == pytest.approx(1.0)


def test_a_cosine_that_ends_with_the_run_is_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates = _run(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=10))
    assert rates[-1] < rates[0]


def test_a_warmup_then_cosine_is_judged_by_the_cosines_own_steps() -> None:
    def sequential(optimizer: Any, t_max: int) -> Any:
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
        return lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[2])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(lambda o: sequential(o, 8))  # 2 of warmup, 8 of cosine: 10 updates
    with pytest.warns(UserWarning, match=r"SequentialLR's CosineAnnealingLR\(T_max=4\)"):
        _run(lambda o: sequential(o, 4))


def test_a_cosine_followed_by_a_constant_rate_is_not_warned_when_it_hands_over() -> None:
    # The cosine stops at T_max exactly, where the constant's milestone starts: it stays there.
    def three(optimizer: Any) -> Any:
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=0.1)
        low = lr_scheduler.ConstantLR(optimizer, factor=0.1, total_iters=100)
        return lr_scheduler.SequentialLR(optimizer, [warmup, cosine, low], milestones=[2, 6])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(three)


def test_a_chained_cosine_and_a_per_epoch_cosine_are_warned_too() -> None:
    def chained(optimizer: Any) -> Any:
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
        return lr_scheduler.ChainedScheduler([cosine, lr_scheduler.ExponentialLR(optimizer, 1.0)])

    with pytest.warns(UserWarning, match=r"ChainedScheduler's CosineAnnealingLR\(T_max=4\)"):
        _run(chained)
    with pytest.warns(UserWarning, match=WARNED + r"stepped at every epoch_end by this Scheduler"):
        _run(lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4), updates=6, per_epoch=True)


def test_warm_restarts_by_design_are_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3))

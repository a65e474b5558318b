"""A schedule as long as the batches a run draws, stepped once per update of ``accumulate``:
its length was counted in batches (torch's ``OneCycleLR(..., steps_per_epoch=len(loader))``,
``num_training_steps=epochs * len(loader)``), and the run ends a ``1 / k`` of the way through,
its rate never brought down (diffusers#4387, accelerate#1160). ``run`` warns at its start, for
torch's schedulers with a length, steplib's ``warmup_*`` and transformers' schedules,
and says the length in updates; counted in updates, or without accumulation, nothing is said."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as lr
from transformers import get_linear_schedule_with_warmup

from steplib import Events, TrainState, accumulate, make_train_step, run, warmup_cosine
from tests.reference import make_batches, tiny_model

BATCHES = [(x, y) for x, y, _ in make_batches(10, seed=3)]  # 10 a pass
K, EPOCHS = 4, 3  # 3 updates a pass (4, 4, 2): 9 in all, 30 batches
UPDATES = EPOCHS * math.ceil(len(BATCHES) / K)
WARNED = r"ends after 30 steps, the batches this run draws.*the run makes 9 updates and ends 30%"


def _scheduler(kind: str, optimizer: torch.optim.Optimizer, length: int) -> Any:
    if kind == "one_cycle":
        return lr.OneCycleLR(optimizer, max_lr=1.0, total_steps=length)
    if kind == "cosine":
        return lr.CosineAnnealingLR(optimizer, T_max=length)
    if kind == "linear":
        return lr.LinearLR(optimizer, start_factor=1.0, end_factor=0.01, total_iters=length)
    if kind == "warmup_cosine":
        return lr.LambdaLR(optimizer, warmup_cosine(warmup=2, total=length))
    if kind == "transformers":  # a LambdaLR of a partial with num_training_steps
        return get_linear_schedule_with_warmup(optimizer, 2, num_training_steps=length)
    warmup = lr.LinearLR(optimizer, start_factor=0.1, total_iters=2)  # "sequential"
    return lr.SequentialLR(
        optimizer, [warmup, lr.CosineAnnealingLR(optimizer, T_max=length - 2)], milestones=[2]
    )


def _run(kind: str, length: int, k: int = K, **limits: Any) -> list[float]:
    model = tiny_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = _scheduler(kind, optimizer, length)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    rates: list[float] = []
    events = Events()
    events.on("step_end", lambda e: rates.append(float(e.output.lr)))
    step = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
    run(accumulate(step, k) if k > 1 else step, state, BATCHES, events=events, **limits)
    return rates


KINDS = ["one_cycle", "cosine", "linear", "warmup_cosine", "transformers", "sequential"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_schedule_counted_in_batches_is_warned_about_at_the_start(kind: str) -> None:
    # Before: nothing said; a OneCycleLR's rate peaked at the run's last update (1.0 x
    # max_lr, the 9th of 9), a cosine's was 0.84 of the base rate.
    with pytest.warns(UserWarning, match=WARNED + r".*Count its length in updates: 9 "):
        rates = _run(kind, EPOCHS * len(BATCHES), max_epochs=EPOCHS)
    assert len(rates) == UPDATES
    assert rates[-1] > 0.5  # part of the way through: not brought down
    # counted in updates: no warning (the suite turns warnings into errors), and brought down
    assert _run(kind, UPDATES, max_epochs=EPOCHS)[-1] < 0.2


def test_max_steps_times_the_window_is_warned_about_too() -> None:
    with pytest.warns(UserWarning, match=r"ends after 20 steps.*5 updates.*: 5 \(max_steps=5\)"):
        _run("one_cycle", 5 * K, max_steps=5)
    _run("one_cycle", 5, max_steps=5)


def test_without_accumulation_a_schedule_of_the_batches_is_right() -> None:
    assert _run("one_cycle", EPOCHS * len(BATCHES), k=1, max_epochs=EPOCHS)[-1] < 0.01

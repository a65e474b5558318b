"""``warmup_cosine_restarts`` against its two references: torch's ``CosineAnnealingWarmRestarts``
(a cycle length and ``T_mult``) and Hugging Face's hard-restarts formula (``n`` cycles)."""

from __future__ import annotations

import math

import pytest
import torch

from steplib import ConfigError
from steplib.schedules import warmup_cosine_restarts

BASE_LR = 0.5


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=BASE_LR)


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, updates: int) -> list[float]:
    """The LR each of ``updates`` updates uses, stepping as a training loop does."""
    lrs = []
    for _ in range(updates):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize(
    ("t_0", "t_mult", "eta_min"), [(5, 1, 0.0), (3, 2, 0.05), (2, 3, 0.0), (1, 2, 0.1)]
)
def test_cycle_and_cycle_mult_give_the_lrs_of_cosine_annealing_warm_restarts(
    warmup, t_0, t_mult, eta_min
):
    opt = _optimizer()
    torch_lrs = _lrs(
        torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
            opt, T_0=t_0, T_mult=t_mult, eta_min=eta_min
        ),
        40,
    )
    schedule = warmup_cosine_restarts(
        warmup=warmup, cycle=t_0, cycle_mult=t_mult, min_ratio=eta_min / BASE_LR
    )
    ours = _lrs(torch.optim.lr_scheduler.LambdaLR(_optimizer(), schedule), warmup + 40)
    assert ours[:warmup] == pytest.approx([BASE_LR * (i + 1) / warmup for i in range(warmup)])
    # After the warmup, torch's cycles shifted by `warmup` updates.
    assert ours[warmup:] == pytest.approx(torch_lrs, rel=1e-12, abs=1e-15)
    assert max(torch_lrs) == BASE_LR and min(torch_lrs) < BASE_LR / 2  # restarts happened


def _hf_hard_restarts(step: int, *, warmup: int, total: int, cycles: int) -> float:
    """HF's ``get_cosine_with_hard_restarts_schedule_with_warmup`` after the warmup; the warmup
    is steplib's (update ``i`` uses ``(i + 1) / warmup``, as in ``warmup_cosine``)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))


@pytest.mark.parametrize(
    ("warmup", "total", "cycles"), [(0, 20, 1), (4, 30, 3), (10, 47, 5), (2, 9, 7)]
)
def test_cycles_give_hugging_faces_hard_restarts(warmup, total, cycles):
    schedule = warmup_cosine_restarts(warmup=warmup, total=total, cycles=cycles)
    steps = range(total + 5)
    expected = [_hf_hard_restarts(s, warmup=warmup, total=total, cycles=cycles) for s in steps]
    assert [schedule(s) for s in steps] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # Through LambdaLR too: update s uses base * f(s).
    lrs = _lrs(torch.optim.lr_scheduler.LambdaLR(_optimizer(), schedule), total + 5)
    assert lrs == pytest.approx([BASE_LR * e for e in expected], rel=1e-12, abs=1e-15)


def test_min_ratio_is_the_floor_of_every_cycle_and_after_total():
    schedule = warmup_cosine_restarts(warmup=2, total=22, cycles=4, min_ratio=0.2)
    for s in range(2, 30):
        hf = _hf_hard_restarts(s, warmup=2, total=22, cycles=4)
        assert schedule(s) == pytest.approx(0.2 + 0.8 * hf)
    assert schedule(22) == schedule(1000) == 0.2


def test_decay_lowers_each_restarts_peak_above_the_floor():
    schedule = warmup_cosine_restarts(warmup=2, cycle=4, cycle_mult=2, decay=0.5, min_ratio=0.1)
    # Restarts after the warmup at 0, 4, 12, 28 updates (lengths 4, 8, 16).
    peaks = [schedule(2 + t) for t in (0, 4, 12, 28)]
    assert peaks == pytest.approx([1.0, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.25, 0.1 + 0.9 * 0.125])
    assert schedule(2 + 3) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    assert min(schedule(s) for s in range(2, 200)) >= 0.1


def test_cycle_with_total_ends_at_the_floor():
    schedule = warmup_cosine_restarts(warmup=0, total=7, cycle=3, min_ratio=0.25)
    assert schedule(3) == 1.0  # a restart
    assert schedule(5) == pytest.approx(0.25 + 0.75 * 0.25)  # 2/3 into the second cycle
    assert schedule(7) == schedule(100) == 0.25


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"warmup": 0, "total": 10}, "give exactly one"),
        ({"warmup": 0, "total": 10, "cycles": 2, "cycle": 5}, "give exactly one"),
        ({"warmup": 0, "cycles": 2}, "it needs total"),
        ({"warmup": 0, "total": 10, "cycles": 2, "cycle_mult": 2}, "give cycle=length"),
        ({"warmup": 0, "total": 10, "cycles": 0}, "(cycles=...) received 0"),
        ({"warmup": 0, "total": 10, "cycles": 2.0}, "(cycles=...) received 2.0"),
        ({"warmup": 5, "total": 10, "cycles": 6}, "Use cycles <= 5"),
        ({"warmup": 10, "total": 10, "cycles": 1}, "warmup=10 >= total=10"),
        ({"warmup": -1, "cycle": 3}, "(warmup=...) received -1"),
        ({"warmup": 0, "cycle": 0}, "(cycle=...) received 0"),
        ({"warmup": 0, "cycle": 3, "cycle_mult": 0}, "(cycle_mult=...) received 0"),
        ({"warmup": 0, "cycle": 3, "cycle_mult": 1.5}, "(cycle_mult=...) received 1.5"),
        ({"warmup": 0, "cycle": 3, "decay": 0.0}, "(decay=...) received 0.0"),
        ({"warmup": 0, "cycle": 3, "decay": 1.5}, "(decay=...) received 1.5"),
        ({"warmup": 0, "cycle": 3, "min_ratio": 2.0}, "min_ratio received 2.0"),
        ({"warmup": 4, "total": 3, "cycle": 3}, "warmup=4 >= total=3"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        warmup_cosine_restarts(**kwargs)
    assert fragment in str(info.value)

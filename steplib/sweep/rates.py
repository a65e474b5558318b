"""Which learning-rate schedulers a sweep with per-copy rates can follow.

With a per-copy ``lr``, a sweep optimizer's ``group["lr"]`` is a factor of every copy's rate
(copy ``i`` trains at ``group["lr"] * lr[i]``). A scheduler that multiplies its base rate
(``LambdaLR``, ``StepLR``, ``LinearLR``, ``CosineAnnealingLR`` to 0) gives each copy the rate
its own run would have had. One that sets the rate to, or bounds it by, a value given in
absolute terms (``eta_min=1e-4``, ``max_lr=0.01``, ``min_lr``, ``AbsoluteLR``) applies that
value to the factor, and every copy trains at that value times its own rate: the same lines
as the copies' own runs, another schedule, in silence. Those are refused here, by what they
hold, with the fix. Imports ``errors`` and ``schedules`` only (a handler's check uses it).
"""

from __future__ import annotations

from typing import Any

from torch.optim import lr_scheduler

from steplib.errors import ConfigError
from steplib.schedules import AbsoluteLR


def check_per_copy_schedule(scheduler: Any, optimizer: Any, caller: str) -> None:
    """Refuse ``scheduler`` when ``optimizer`` is a sweep optimizer with per-copy rates
    (``lr_per_copy``) and the scheduler sets an absolute rate.

    Raises:
        ConfigError: what in the scheduler is absolute, why each copy would train at another
            rate than its own run's, and the fix.
    """
    if scheduler is None or not getattr(optimizer, "lr_per_copy", False):
        return
    found = absolute_setting(scheduler)
    if found is None:
        return
    raise ConfigError(
        f"{caller}: the scheduler's {found}, and this sweep's optimizer has a per-copy lr, so "
        "its group['lr'] is a factor of each copy's rate (copy i trains at group['lr'] * "
        "lr[i]): every copy would train at that value times its own rate, not at the rate its "
        "own run would have. Give the optimizer one lr for all copies (per-copy weight decay, "
        "betas or momentum still work), or schedule a factor of each copy's rate: "
        "LambdaLR(optimizer, warmup_cosine(...)) (for AbsoluteLR's get_lr: LambdaLR(optimizer, "
        "lambda n: get_lr(n) / base)), CosineAnnealingLR without eta_min, or "
        "OneCycleLR(optimizer, max_lr=1.0, ...) with lr=[each copy's max_lr]."
    )


def absolute_setting(scheduler: Any) -> str | None:
    """What in ``scheduler`` sets or bounds the rate by an absolute value (``"AbsoluteLR sets
    the group's lr to the rate itself"``, ``"CosineAnnealingLR has eta_min=0.0001"``), also
    inside a ``SequentialLR`` or ``ChainedScheduler``; ``None`` when it only scales the rate
    (a value of 1.0 for ``max_lr`` is a factor too: the copies' rates are the maxima)."""
    # torch keeps a SequentialLR's and a ChainedScheduler's schedulers in `_schedulers`, with
    # no public name: read, never written.
    inner = getattr(scheduler, "_schedulers", None)
    if isinstance(inner, list | tuple):
        found = next((text for s in inner if (text := absolute_setting(s))), None)
        return None if found is None else f"{type(scheduler).__name__}'s {found}"
    name = type(scheduler).__name__
    if isinstance(scheduler, AbsoluteLR):
        return "AbsoluteLR sets the group's lr to the rate itself"
    floors = {
        lr_scheduler.CosineAnnealingLR: "eta_min",
        lr_scheduler.CosineAnnealingWarmRestarts: "eta_min",
    }
    for kind, attribute in floors.items():
        if isinstance(scheduler, kind) and getattr(scheduler, attribute) != 0:
            return f"{name} has {attribute}={getattr(scheduler, attribute)}, an absolute floor"
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) and any(scheduler.min_lrs):
        return f"{name} has min_lr={scheduler.min_lrs[0]}, an absolute floor"
    if isinstance(scheduler, lr_scheduler.OneCycleLR | lr_scheduler.CyclicLR):
        peaks = _peaks(scheduler)
        if any(peak != 1.0 for peak in peaks):
            return f"{name} has max_lr={peaks[0]}, an absolute rate"
    return None


def _peaks(scheduler: Any) -> list[float]:
    """A OneCycleLR's or CyclicLR's ``max_lr`` per group (OneCycleLR keeps it in the group)."""
    if isinstance(scheduler, lr_scheduler.CyclicLR):
        return [float(v) for v in scheduler.max_lrs]
    return [float(group["max_lr"]) for group in scheduler.optimizer.param_groups]

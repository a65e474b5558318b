"""Which learning-rate schedulers a sweep with per-copy rates can follow.

With a per-copy ``lr``, a sweep optimizer's ``group["lr"]`` is a factor of every copy's rate
(copy ``i`` trains at ``group["lr"] * lr[i]``). A scheduler that multiplies its base rate
(``LambdaLR``, ``StepLR``, ``LinearLR``, ``CosineAnnealingLR`` to 0) gives each copy the rate
its own run would have had. One that sets the rate to, or bounds it by, a value given in
absolute terms (``eta_min=1e-4``, ``max_lr=0.01``, ``swa_lr``, ``min_lr``, ``AbsoluteLR``)
applies that value to the factor, and every copy trains at that value times its own rate:
the same lines as the copies' own runs, another schedule, in silence. Those are refused
here, by what they hold, with the fix. Imports ``errors`` and ``schedules`` only (a
handler's check uses it).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch.optim import lr_scheduler
from torch.optim.swa_utils import SWALR

from steplib.errors import ConfigError
from steplib.schedules import AbsoluteLR, found_in


def check_per_copy_schedule(scheduler: Any, optimizer: Any, caller: str) -> None:
    """Refuse ``scheduler`` when ``optimizer`` is a sweep optimizer with per-copy rates
    (``lr_per_copy``) and the scheduler sets an absolute rate.

    Raises:
        ConfigError: what in the scheduler is absolute, why each copy would train at another
            rate than its own run's, and the fix.
    """
    groups = getattr(optimizer, "lr_per_copy", ())
    if scheduler is None or not groups:
        return
    found = absolute_setting(scheduler, groups)
    if found is None:
        return
    raise ConfigError(
        f"{caller}: the scheduler's {found}, and this sweep's optimizer has a per-copy lr (param "
        f"group {', '.join(map(str, groups))}), so that group's lr is a factor of each copy's "
        "rate (copy i trains at group['lr'] * lr[i]): every copy would train at that value "
        "times its own rate, not at the rate its own run would have. Give the optimizer one lr "
        "for all copies (per-copy weight decay, betas or momentum still work), or schedule a "
        "factor of each copy's rate: LambdaLR(optimizer, warmup_cosine(...)) (for "
        "AbsoluteLR's get_lr: LambdaLR(optimizer, lambda n: get_lr(n) / base)), "
        "CosineAnnealingLR without eta_min, or OneCycleLR(optimizer, max_lr=1.0, "
        "cycle_momentum=False, ...) with lr=[each copy's max_lr]."
    )


def absolute_setting(scheduler: Any, groups: Collection[int]) -> str | None:
    """What in ``scheduler`` sets or bounds the rate of a param group in ``groups`` (those
    with per-copy rates) by an absolute value (``"AbsoluteLR sets the group's lr to the rate
    itself"``, ``"CosineAnnealingLR has eta_min=0.0001"``), also inside a ``SequentialLR`` or
    ``ChainedScheduler``; ``None`` when it only scales their rate (a value of 1.0 for
    ``max_lr`` is a factor too: the copies' rates are the maxima). A value held per group
    (``max_lr``, ``min_lr``, ``swa_lr``) counts for those groups only: another group's rate
    is one rate, which an absolute value sets as it would in a plain run."""
    return found_in(scheduler, lambda one: _absolute_here(one, groups))


def _absolute_here(scheduler: Any, groups: Collection[int]) -> str | None:
    if isinstance(scheduler, AbsoluteLR):
        return "AbsoluteLR sets the group's lr to the rate itself"
    for kind, name, factor, what in _ABSOLUTE:
        if isinstance(scheduler, kind):
            held = getattr(scheduler, name, None)
            if held is None:  # OneCycleLR and SWALR keep theirs in each group
                held = [group[name] for group in scheduler.optimizer.param_groups]
            if isinstance(held, list | tuple):  # one per group: those with per-copy rates
                values = [float(v) for i, v in enumerate(held) if i in groups]
            else:  # one for every group (eta_min)
                values = [float(held)]
            wrong = [value for value in values if value != factor]
            if wrong:
                argument = name.removesuffix("s")  # CyclicLR's max_lrs: its argument max_lr
                return f"{kind.__name__} has {argument}={wrong[0]}, {what}"
    return None


# (scheduler, where its absolute value is, the value that makes it a factor, what it is):
# an eta_min of 0 is 0 in any unit; a max_lr of 1.0 makes each copy's rate the maximum.
_ABSOLUTE: tuple[tuple[Any, str, float, str], ...] = (
    (lr_scheduler.CosineAnnealingLR, "eta_min", 0.0, "an absolute floor"),
    (lr_scheduler.CosineAnnealingWarmRestarts, "eta_min", 0.0, "an absolute floor"),
    (lr_scheduler.ReduceLROnPlateau, "min_lrs", 0.0, "an absolute floor"),
    (lr_scheduler.OneCycleLR, "max_lr", 1.0, "an absolute rate"),
    (lr_scheduler.CyclicLR, "max_lrs", 1.0, "an absolute rate"),
    (SWALR, "swa_lr", 1.0, "an absolute rate"),
)

"""Where a schedule ends, checked before it is stepped past the end: a ``OneCycleLR``'s last
step (torch raises only after the optimizer applied the update, or after a per-epoch
scheduler's whole epoch trained) and a ``CosineAnnealingLR``'s ``T_max`` (its rate climbs back,
in silence); and at a run's start, a schedule as long as the batches the run draws where the
step makes an update every few of them (it ends part of the way through, in silence). Used by
the step, the loop and the ``Scheduler`` handler."""

from __future__ import annotations

import bisect
import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from steplib.errors import ConfigError


def cycle_end(scheduler: Any) -> tuple[int, Any] | None:
    """``(steps, cycle)``: ``scheduler`` can be stepped ``steps`` more times before the
    ``OneCycleLR`` ``cycle`` that it steps raises torch's ``ValueError("Tried to step ...
    times")`` (the soonest; ``None``: no such end). A ``ChainedScheduler`` steps each of its
    schedulers; a ``SequentialLR`` steps one at a time and restarts the next at its milestone."""
    lr = torch.optim.lr_scheduler
    if isinstance(scheduler, lr.OneCycleLR):
        return max(scheduler.total_steps - scheduler.last_epoch, 0), scheduler
    # torch keeps these in `_schedulers` and `_milestones`: read, never written.
    if isinstance(scheduler, lr.ChainedScheduler):
        ends = [end for one in scheduler._schedulers if (end := cycle_end(one)) is not None]
        return min(ends, key=lambda end: end[0], default=None)
    if not isinstance(scheduler, lr.SequentialLR):
        return None
    at, milestones, stages = scheduler.last_epoch, scheduler._milestones, scheduler._schedulers
    now = bisect.bisect_right(milestones, at)
    for index in range(now, len(stages)):
        start = at if index == now else milestones[index - 1]  # where it starts, or restarts
        stage = stages[index]
        if index == now:
            end = cycle_end(stage)
        else:  # restarted at its milestone: a OneCycleLR at 0 (nested ones not looked into)
            end = (stage.total_steps, stage) if isinstance(stage, lr.OneCycleLR) else None
        steps = milestones[index] - start - 1 if index < len(milestones) else None
        if end is not None and (steps is None or end[0] < steps):
            return start - at + end[0], end[1]
    return None


def check_updates_left(state: Any, updates: int, *, needs: str) -> None:
    """:func:`check_steps_left` of the state's scheduler, stepped at every update: torch
    refuses the step past a ``OneCycleLR``'s end only after the optimizer applied that update,
    so the model holds an update its counters do not. ``needs``: what asks for the updates
    (``"this update"``, ``"max_steps=10"``)."""
    after = (
        "A checkpoint restores the total_steps it was saved with, so a resumed run ends where its "
        "cycle ends; to train on after it, give the state a new scheduler: state.replace("
        "scheduler=...)."
    )
    owner = f"the state's scheduler ({type(state.scheduler).__name__})"
    late = ("update", state.step, "the optimizer has applied that update")
    check_steps_left(state.scheduler, updates, needs=needs, owner=owner, late=late, after=after)


def check_steps_left(
    scheduler: Any, steps: int, *, needs: str, owner: str, late: tuple[str, int, str], after: str
) -> None:
    """Raise ``ConfigError`` if ``scheduler`` cannot be stepped ``steps`` more times
    (:func:`cycle_end`). ``late``: what it is stepped at (``"update"``, ``"epoch"``), how
    many of those are done, and what torch's own error would come after."""
    end = cycle_end(scheduler)
    if end is None or steps <= end[0]:
        return
    (left, cycle), (unit, done, trained) = end, late
    total, limit = cycle.total_steps, "max_steps" if unit == "update" else f"max_{unit}s"
    raise ConfigError(
        f"{unit} {done + 1}: {owner} can be stepped {left} more time(s) before the end of a "
        f"OneCycleLR's cycle (total_steps={total}), and {needs} would step it {steps} "
        f"time(s): torch refuses a step past the end (ValueError 'Tried "
        f"to step ... times') after {trained}. Build the OneCycleLR with total_steps= the run's "
        f"{unit}s (here at least {total + steps - left}), or stop the run at "
        f"{limit}={done + left}. {after}"
    )


def warn_if_rate_rises(scheduler: Any, *, stepped: str) -> None:
    """Warn when ``scheduler``'s next step takes a ``CosineAnnealingLR`` past its ``T_max``
    (also the one a ``ChainedScheduler`` or ``SequentialLR`` steps next): torch's cosine is
    periodic, so the rate climbs back to the base rate over the next ``T_max`` steps, where a
    user who gave ``T_max`` in epochs to a scheduler stepped at every update expected it to
    stay low. ``stepped``: how it is stepped, what ``T_max`` counts. Said once (the same
    words each time: Python's filter)."""
    cosine = _next_cosine(scheduler)
    if cosine is None or cosine.last_epoch != cosine.T_max:
        return
    name = "" if cosine is scheduler else f"{type(scheduler).__name__}'s "
    warnings.warn(
        f"{name}CosineAnnealingLR(T_max={cosine.T_max}) reaches eta_min={cosine.eta_min} here, "
        "and its next step starts its rate back up to the base rate: torch's cosine is "
        f"periodic. It is {stepped}; give T_max the steps the whole run makes. For restarts "
        "by design, use CosineAnnealingWarmRestarts or steplib.warmup_cosine_restarts.",
        stacklevel=2,
    )


def _next_cosine(scheduler: Any) -> Any:
    """The ``CosineAnnealingLR`` that ``scheduler``'s next step steps, or ``None``."""
    lr = torch.optim.lr_scheduler
    if isinstance(scheduler, lr.CosineAnnealingLR):
        return scheduler
    # torch keeps these in `_schedulers` and `_milestones`: read, never written.
    if isinstance(scheduler, lr.ChainedScheduler):
        found = (_next_cosine(one) for one in scheduler._schedulers)
        return next((c for c in found if c is not None and c.last_epoch == c.T_max), None)
    if isinstance(scheduler, lr.SequentialLR):
        at, milestones = scheduler.last_epoch + 1, scheduler._milestones
        index = bisect.bisect_right(milestones, at)
        restarts = index > 0 and milestones[index - 1] == at  # its scheduler starts at 0
        return None if restarts else _next_cosine(scheduler._schedulers[index])
    return None


def check_run_length(
    state: Any, step: Any, data: Any, *, max_steps: int | None, max_epochs: int | None
) -> None:
    """At a run's start (after ``fit_start``): :func:`check_updates_left` for ``max_steps``,
    and a warning when the state's scheduler ends after as many steps as the run draws batches
    while the step makes one update every ``k > 1`` of them (``accumulate``): its length was
    counted in batches (torch's ``steps_per_epoch=len(loader)``), it is stepped once per update,
    and the run ends ``1 / k`` of the way through it, its rate never brought down (diffusers#4387,
    accelerate#1160: the same mistake, the other way round)."""
    if max_steps is not None:
        check_updates_left(state, max_steps - state.step, needs=f"max_steps={max_steps}")
    window = getattr(getattr(step, "plan", None), "window", 1)
    length = _horizon(state.scheduler)
    if window <= 1 or length is None or isinstance(step, Mapping):
        return
    runs = []  # (batches, updates, how the updates are counted) for each limit given
    if max_steps is not None:
        runs.append((max_steps * window, max_steps, f"max_steps={max_steps}"))
    try:
        per_epoch = len(data)
    except TypeError:  # unsized: no epoch length to count
        per_epoch = None
    if max_epochs is not None and per_epoch is not None:
        updates, how = max_epochs * math.ceil(per_epoch / window), "math.ceil(len(data) / k)"
        runs.append((max_epochs * per_epoch, updates, f"max_epochs={max_epochs} x {how}"))
    for batches, updates, how in runs:
        if length == batches != updates:
            warnings.warn(
                f"the state's scheduler ({type(state.scheduler).__name__}) ends after {length} "
                f"steps, the batches this run draws, but the step makes one update every "
                f"{window} batches (k={window}) and steps it once per update: the run makes "
                f"{updates} updates and ends {updates / length:.0%} of the way through the "
                f"schedule, its rate never brought down. Count its length in updates: {updates} "
                f"({how}).",
                stacklevel=2,
            )
            return


def _horizon(scheduler: Any) -> int | None:
    """After how many steps ``scheduler``'s schedule ends, where it says: a ``OneCycleLR``'s
    ``total_steps``, a cosine's ``T_max``, a ``LinearLR``'s or ``PolynomialLR``'s
    ``total_iters``, a ``LambdaLR`` of steplib's ``warmup_*(total=)`` or of a transformers
    schedule (``num_training_steps``); a ``SequentialLR``'s last stage from its milestone."""
    lr = torch.optim.lr_scheduler
    lengths = {
        lr.OneCycleLR: "total_steps",
        lr.CosineAnnealingLR: "T_max",
        lr.LinearLR: "total_iters",
        lr.PolynomialLR: "total_iters",
    }
    if type(scheduler) in lengths:
        return int(getattr(scheduler, lengths[type(scheduler)]))
    # torch keeps these in `_schedulers` and `_milestones`: read, never written.
    if isinstance(scheduler, lr.SequentialLR):
        last = _horizon(scheduler._schedulers[-1])
        return None if last is None else scheduler._milestones[-1] + last
    if isinstance(scheduler, lr.ChainedScheduler):
        ends = [end for one in scheduler._schedulers if (end := _horizon(one)) is not None]
        return max(ends, default=None)
    if isinstance(scheduler, lr.LambdaLR):
        for fn in scheduler.lr_lambdas:
            try:
                parameters = inspect.signature(fn).parameters
            except (TypeError, ValueError):  # a callable without a signature
                continue
            for name in ("total", "num_training_steps"):
                if name in parameters and isinstance(parameters[name].default, int):
                    return int(parameters[name].default)
    return None

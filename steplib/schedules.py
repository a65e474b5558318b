"""Learning-rate schedules as plain functions of the update index, for ``LambdaLR``; and
:class:`AbsoluteLR` for a function that gives the rate itself.

Each builder returns ``f(step) -> multiplier`` of the optimizer's base LR, where ``step`` is the
number of updates applied so far (``LambdaLR`` calls it with 0 before the first update).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=2, total=10))
    >>> [round(warmup_cosine(warmup=2, total=10)(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from steplib.errors import ConfigError, describe

Schedule = Callable[[int], float]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} received {describe(value)}; it must be an int >= {minimum}.")
    return value


def _check_ratio(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(
            f"min_ratio received {describe(value)}; it must be a number in [0, 1] (the final LR "
            "as a fraction of the base LR)."
        )
    return float(value)


def _warmup(warmup: int, step: int) -> float:
    # step + 1: the first update already uses a non-zero LR (1/warmup of the base).
    return (step + 1) / warmup


def warmup_constant(*, warmup: int) -> Schedule:
    """Linear warmup over ``warmup`` updates to the base LR, then constant.

    Args:
        warmup: updates of linear warmup, an int >= 0; update ``i`` (0-based) uses
            ``(i + 1) / warmup`` of the base LR. ``0`` means no warmup (constant 1.0).

    Returns:
        ``f(step) -> multiplier`` of the base LR, for ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ConfigError: ``warmup`` is not an int >= 0.

    Example:
        >>> schedule = warmup_constant(warmup=4)
        >>> [schedule(s) for s in range(6)]
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    """
    warmup = _check_int("warmup_constant(warmup=...)", warmup, 0)

    def schedule(step: int) -> float:
        return _warmup(warmup, step) if step < warmup else 1.0

    return schedule


def warmup_linear(*, warmup: int, total: int, min_ratio: float = 0.0) -> Schedule:
    """Linear warmup, then linear decay to ``min_ratio`` at update ``total`` (constant after).

    Args:
        warmup: updates of linear warmup, an int >= 0 (``0``: none); update ``i`` (0-based)
            of the warmup uses ``(i + 1) / warmup`` of the base LR.
        total: the update at which the decay reaches ``min_ratio``, an int > ``warmup``.
        min_ratio: the final LR as a fraction of the base LR, in [0, 1].

    Returns:
        ``f(step) -> multiplier`` of the base LR, for ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ConfigError: ``warmup``/``total`` not ints with ``0 <= warmup < total``, or
            ``min_ratio`` outside [0, 1].

    Example:
        >>> schedule = warmup_linear(warmup=2, total=6, min_ratio=0.2)
        >>> [round(schedule(s), 3) for s in range(8)]
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    """
    warmup, total, floor = _check_span("warmup_linear", warmup, total, min_ratio)

    # `total` a keyword default: what run() reads of it (schedule_ends), as it reads the
    # num_training_steps of a transformers schedule (a partial).
    def schedule(step: int, *, total: int = total) -> float:
        if step < warmup:
            return _warmup(warmup, step)
        progress = min(1.0, (step - warmup) / (total - warmup))
        return floor + (1.0 - floor) * (1.0 - progress)

    return schedule


def warmup_cosine(*, warmup: int, total: int, min_ratio: float = 0.0) -> Schedule:
    """Linear warmup, then half-cosine decay to ``min_ratio`` at update ``total`` (constant
    after).

    Args:
        warmup: updates of linear warmup, an int >= 0 (``0``: none); update ``i`` (0-based)
            of the warmup uses ``(i + 1) / warmup`` of the base LR.
        total: the update at which the decay reaches ``min_ratio``, an int > ``warmup``.
        min_ratio: the final LR as a fraction of the base LR, in [0, 1].

    Returns:
        ``f(step) -> multiplier`` of the base LR, for ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ConfigError: ``warmup``/``total`` not ints with ``0 <= warmup < total``, or
            ``min_ratio`` outside [0, 1].

    Example:
        >>> schedule = warmup_cosine(warmup=2, total=6)
        >>> [round(schedule(s), 3) for s in range(8)]
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    """
    warmup, total, floor = _check_span("warmup_cosine", warmup, total, min_ratio)

    def schedule(step: int, *, total: int = total) -> float:  # as warmup_linear's
        if step < warmup:
            return _warmup(warmup, step)
        progress = min(1.0, (step - warmup) / (total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def _check_span(
    name: str, warmup: object, total: object, min_ratio: object
) -> tuple[int, int, float]:
    w = _check_int(f"{name}(warmup=...)", warmup, 0)
    t = _check_int(f"{name}(total=...)", total, 1)
    if w >= t:
        raise ConfigError(
            f"{name} received warmup={w} >= total={t}; the decay needs updates after the "
            f"warmup. Use warmup < total, e.g. warmup={max(0, t // 10)}."
        )
    return w, t, _check_ratio(min_ratio)


def warmup_cosine_restarts(
    *,
    warmup: int,
    total: int | None = None,
    cycles: int | None = None,
    cycle: int | None = None,
    cycle_mult: int = 1,
    decay: float = 1.0,
    min_ratio: float = 0.0,
) -> Schedule:
    """Linear warmup, then cosine decays from the peak to ``min_ratio``, each restarting at the
    peak (SGDR; torch's ``CosineAnnealingWarmRestarts``, HF's hard restarts).

    Give the cycles one of two ways: ``cycles=n`` splits ``total - warmup`` updates into ``n``
    equal cycles (HF's ``get_cosine_with_hard_restarts_schedule_with_warmup``); ``cycle=length``
    makes the first cycle ``length`` updates and each next one ``cycle_mult`` times longer
    (``T_0`` and ``T_mult`` of ``CosineAnnealingWarmRestarts``), restarting for ever unless
    ``total`` is given. From update ``total`` on, the multiplier is ``min_ratio``.

    Args:
        warmup: updates of linear warmup, an int >= 0 (``0``: none); update ``i`` (0-based)
            of the warmup uses ``(i + 1) / warmup`` of the base LR (HF's warmup uses ``i /
            warmup``; the cycles after it are HF's exactly).
        total: the update at which the schedule ends at ``min_ratio``, an int > ``warmup``;
            needed with ``cycles``, optional with ``cycle``.
        cycles: how many equal cycles fill ``total - warmup`` updates, an int >= 1.
        cycle: the first cycle's length in updates, an int >= 1 (instead of ``cycles``).
        cycle_mult: each cycle is this many times longer than the one before, an int >= 1;
            only with ``cycle``.
        decay: the cosine's height above ``min_ratio`` is multiplied by this at each restart,
            a number in (0, 1] (``1``: every cycle restarts at the base LR).
        min_ratio: the LR at the end of each cycle as a fraction of the base LR, in [0, 1].

    Returns:
        ``f(step) -> multiplier`` of the base LR, for ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ConfigError: not exactly one of ``cycles`` and ``cycle``; ``cycles`` without
            ``total`` or with ``cycle_mult``; more cycles than updates; a non-int or
            out-of-range ``warmup``, ``total``, ``cycles``, ``cycle`` or ``cycle_mult``;
            ``decay`` outside (0, 1] or ``min_ratio`` outside [0, 1].

    Example:
        >>> schedule = warmup_cosine_restarts(warmup=1, total=9, cycles=2)
        >>> [round(schedule(s), 3) for s in range(10)]
        [1.0, 1.0, 0.854, 0.5, 0.146, 1.0, 0.854, 0.5, 0.146, 0.0]
        >>> schedule = warmup_cosine_restarts(warmup=0, cycle=2, cycle_mult=2, decay=0.5)
        >>> [round(schedule(s), 3) for s in range(8)]
        [1.0, 0.5, 0.5, 0.427, 0.25, 0.073, 0.25, 0.24]
    """
    name = "warmup_cosine_restarts"
    floor = _check_ratio(min_ratio)
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ConfigError(
            f"{name}(decay=...) received {describe(decay)}; it must be a number in (0, 1]: the "
            "factor on each restart's peak above min_ratio (1.0 restarts at the base LR)."
        )
    mult = _check_int(f"{name}(cycle_mult=...)", cycle_mult, 1)
    if (cycles is None) == (cycle is None):
        raise ConfigError(
            f"{name} received cycles={cycles!r} and cycle={cycle!r}; give exactly one: "
            f"cycles=n (n equal cycles up to total) or cycle=length (the first cycle's updates)."
        )
    if cycles is not None:
        if total is None or mult != 1:
            raise ConfigError(
                f"{name}(cycles={cycles!r}) received total={total!r}, cycle_mult={mult}; "
                "cycles=n splits total - warmup updates into n equal cycles, so it needs total "
                "and cycle_mult=1. For growing cycles give cycle=length with cycle_mult."
            )
        warmup, total, floor = _check_span(name, warmup, total, floor)
        n, span = _check_int(f"{name}(cycles=...)", cycles, 1), total - warmup
        if n > span:
            raise ConfigError(
                f"{name} received cycles={n} for total - warmup = {span} updates; each cycle "
                f"needs at least one update. Use cycles <= {span}."
            )

        def position(t: int) -> tuple[int, float]:
            # HF's formula, float for float: the cycles need not be whole numbers of updates.
            x = n * (t / span)
            return int(x), x % 1.0
    else:
        length = _check_int(f"{name}(cycle=...)", cycle, 1)
        if total is None:
            warmup = _check_int(f"{name}(warmup=...)", warmup, 0)
        else:
            warmup, total, floor = _check_span(name, warmup, total, floor)

        def position(t: int) -> tuple[int, float]:
            if mult == 1:
                index, t = divmod(t, length)
                return index, t / length
            # Whole updates, as CosineAnnealingWarmRestarts counts them: no log() rounding.
            index, size = 0, length
            while t >= size:
                t, size, index = t - size, size * mult, index + 1
            return index, t / size

    def schedule(step: int) -> float:
        if step < warmup:
            return _warmup(warmup, step)
        if total is not None and step >= total:
            return floor
        index, fraction = position(step - warmup)
        height = (1.0 - floor) * decay**index
        return floor + height * 0.5 * (1.0 + math.cos(math.pi * fraction))

    return schedule


def accumulation_steps(*, tokens_per_update: int, batch_size: int, seq_len: int) -> int:
    """Micro-batches per update so that each update sees ``tokens_per_update`` tokens.

    Args:
        tokens_per_update: the token budget of one optimizer update, an int >= 1.
        batch_size: sequences per micro-batch, an int >= 1.
        seq_len: tokens per sequence, an int >= 1.

    Returns:
        ``tokens_per_update // (batch_size * seq_len)``: the ``k`` to pass to ``accumulate``.

    Raises:
        ConfigError: a non-positive argument, or a token budget that is not a multiple of
            ``batch_size * seq_len`` (the message gives the nearest budgets that divide).

    Example:
        >>> accumulation_steps(tokens_per_update=65536, batch_size=16, seq_len=1024)
        4
        >>> accumulation_steps(  # doctest: +ELLIPSIS
        ...     tokens_per_update=50000, batch_size=16, seq_len=1024
        ... )
        Traceback (most recent call last):
        steplib.errors.ConfigError: accumulation_steps: tokens_per_update=50000 is not a ...
    """
    budget = _check_int("accumulation_steps(tokens_per_update=...)", tokens_per_update, 1)
    size = _check_int("accumulation_steps(batch_size=...)", batch_size, 1)
    length = _check_int("accumulation_steps(seq_len=...)", seq_len, 1)
    per_micro = size * length
    if budget % per_micro:
        lower = max(per_micro, budget // per_micro * per_micro)
        raise ConfigError(
            f"accumulation_steps: tokens_per_update={budget} is not a multiple of batch_size * "
            f"seq_len = {size} * {length} = {per_micro} tokens per micro-batch. Use "
            f"tokens_per_update={lower} or {lower + per_micro}, or change the batch size."
        )
    return budget // per_micro


class AbsoluteLR(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler from a function that gives the learning rate itself (nanoGPT's
    ``get_lr(it)``), not a multiplier of the base rate.

    Every parameter group gets ``lr_fn(n)`` exactly, ``n`` being the number of updates applied
    so far (0 before the first). ``LambdaLR(opt, lambda n: get_lr(n) / base)`` is close but not
    exact: it multiplies the quotient back by ``base``, which differs in the last bits.

    Args:
        optimizer: the optimizer whose learning rate to set.
        lr_fn: ``lr_fn(n) -> float``, the absolute learning rate for update ``n``.

    Raises:
        ConfigError: ``lr_fn`` is not callable, or the optimizer's parameter groups have
            different learning rates (which it would replace by one).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> sched = AbsoluteLR(opt, lambda n: 0.1 / (n + 1))
        >>> opt.param_groups[0]["lr"]
        0.1
        >>> opt.step(); sched.step(); opt.param_groups[0]["lr"]
        0.05
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_fn: Callable[[int], float]) -> None:
        if not callable(lr_fn):
            raise ConfigError(
                f"AbsoluteLR(optimizer, lr_fn) received lr_fn={describe(lr_fn)}, which is not "
                "callable. Pass the function that gives the rate: AbsoluteLR(opt, get_lr)."
            )
        # Read once, when built: a tensor LR (compile_step's) is read on the host here.
        rates = [float(group["lr"]) for group in optimizer.param_groups]
        if len(set(rates)) > 1:
            raise ConfigError(
                f"AbsoluteLR(optimizer, lr_fn) received an optimizer whose parameter groups have "
                f"the learning rates {rates}; AbsoluteLR gives every group lr_fn(n) itself, so "
                "their different rates would be lost. Schedule a factor of each group's rate "
                "instead: LambdaLR(optimizer, lambda n: get_lr(n) / base), with base the rate "
                "get_lr is written for; or give every group the same lr."
            )
        self.lr_fn = lr_fn
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The rate of every group at the current position."""
        return [self.lr_fn(self.last_epoch)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """The position, without the function (give it again when you rebuild the scheduler)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_fn")}


def found_in(scheduler: Any, test: Callable[[Any], str | None]) -> str | None:
    """What ``test`` finds in ``scheduler`` (its words, or ``None``) or, for a ``SequentialLR``
    or ``ChainedScheduler``, in the first of the schedulers it holds where ``test`` finds
    something, named ``"SequentialLR's LambdaLR ..."``: they step the same optimizer in turn."""
    # torch keeps a SequentialLR's and a ChainedScheduler's schedulers in `_schedulers`, with
    # no public name: read, never written.
    inner = getattr(scheduler, "_schedulers", None)
    if not isinstance(inner, list | tuple):
        return test(scheduler)
    found = next((text for one in inner if (text := found_in(one, test))), None)
    return None if found is None else f"{type(scheduler).__name__}'s {found}"


__all__ = [
    "AbsoluteLR",
    "Schedule",
    "accumulation_steps",
    "warmup_constant",
    "warmup_cosine",
    "warmup_cosine_restarts",
    "warmup_linear",
]

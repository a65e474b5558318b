"""A watched value: :func:`monitored_value` reads it from ``state.extras`` as one number
(:func:`one_number` refuses a sweep's, one per copy), and :class:`BestValue` keeps the best of
it so far; shared by early stopping, the evaluator, ``export_best`` and ``Scheduler``.

Imports ``errors``, ``events`` and ``state``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from steplib import errors
from steplib.errors import ConfigError, describe
from steplib.events import Event
from steplib.state import EVALUATED_AT


class BestValue:
    """The best value seen so far of one quantity, and the step it was seen at.

    Args:
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. an accuracy).
        min_delta: how much better than the best a value must be to count as an improvement.

    Raises:
        ConfigError: ``mode`` not ``"min"``/``"max"``, or ``min_delta`` not a number >= 0.

    Example:
        >>> best = BestValue(mode="min")
        >>> [best.update(v, step=s) for s, v in enumerate([3.0, 2.0, 2.5, float("nan")])]
        [True, True, False, False]
        >>> best.value, best.step
        (2.0, 1)
    """

    def __init__(self, *, mode: str = "min", min_delta: float = 0.0) -> None:
        self.mode = errors.mode(type(self).__name__, mode)
        self.min_delta = errors.non_negative(type(self).__name__, "min_delta", min_delta)
        self.value: float | None = None
        self.step: int | None = None

    def is_better(self, value: float) -> bool:
        """Whether ``value`` improves on the best by more than ``min_delta`` (NaN never does).

        Raises:
            ConfigError: ``value`` is several numbers (a sweep's, one per copy).
        """
        if _several(value):  # math.isnan: a bare TypeError
            raise ConfigError(
                f"{type(self).__name__} keeps the best of one number and received "
                f"{describe(value)}, not one (a sweep's values, one per copy?), so no one of "
                "them is the best. Keep one per copy: bests = [BestValue(mode=...) for _ in "
                "values], then bests[i].update(values[i], step=...); or watch a sweep with "
                "steplib.sweep.SweepEarlyStopping or SuccessiveHalving."
            )
        if math.isnan(value):
            return False
        if self.value is None:
            return True
        if self.mode == "min":
            return value < self.value - self.min_delta
        return value > self.value + self.min_delta

    def update(self, value: float, *, step: int) -> bool:
        """Record ``value`` if it is better; return whether it was."""
        if not self.is_better(value):
            return False
        self.value, self.step = float(value), step
        return True

    def state_dict(self) -> dict[str, Any]:
        """The best value and its step (for a checkpoint's ``extras``)."""
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.value, self.step = state["value"], state["step"]


def monitored_value(owner: str, monitor: str, event: Event) -> float | None:
    """``event.state.extras[monitor]`` as a float: what a handler that watches a value reads
    (:class:`EarlyStopping`, :func:`~steplib.handlers.export.export_best`); ``None`` when an
    evaluation of another update put it there (``extras[EVALUATED_AT]``), so that a value is
    never counted again, nor credited to a later model, by a check between two evaluations.

    Args:
        owner: the handler's name, for the error message.
        monitor: the name in ``state.extras``.
        event: the event whose state holds the value.

    Returns:
        The value as a float (a one-element tensor is read with ``.item()``), or ``None`` when
        it is another update's.

    Raises:
        ConfigError: ``monitor`` is not in ``state.extras``; the message lists the numbers that
            are there.

    Example:
        >>> from types import SimpleNamespace
        >>> event = Event("step_end", state=SimpleNamespace(extras={"val_loss": 0.5}), step=3)
        >>> monitored_value("EarlyStopping", "val_loss", event)
        0.5
        >>> extras = {"val_loss": 0.5, "evaluated_at": {"val_loss": 2}}  # update 2's model
        >>> event = Event("step_end", state=SimpleNamespace(extras=extras), step=3)
        >>> monitored_value("EarlyStopping", "val_loss", event) is None
        True
    """
    extras: Mapping[str, Any] = getattr(event.state, "extras", None) or {}
    if monitor not in extras:
        available = sorted(k for k, v in extras.items() if _is_number(v))
        raise ConfigError(
            f"{owner}(monitor={monitor!r}) found no {monitor!r} in state.extras at step "
            f"{event.step}; the numbers there are: {', '.join(available) or '(none)'}. Monitor "
            "one of them, and register this handler after the evaluation handler that puts the "
            "value there, on the same event and interval (e.g. both every=100)."
        )
    if extras.get(EVALUATED_AT, {}).get(monitor, event.step) != event.step:
        return None
    return one_number(owner, monitor, extras[monitor])


def one_number(owner: str, monitor: str, value: Any, *, arg: str = "monitor") -> float:
    """``value`` as a float; ``ConfigError`` for a sweep's (a list, one per copy): no one best."""
    if _several(value):  # .item() of a tensor of several: a bare RuntimeError
        count = value.numel() if isinstance(value, torch.Tensor) else len(value)
        raise ConfigError(
            f"{owner}({arg}={monitor!r}) watches one number, and {monitor!r} is a list of "
            f"{count} (a sweep's, one per copy). Use steplib.sweep.SweepEarlyStopping"
            f"({monitor!r}) or SuccessiveHalving, and no monitor= on a sweep's Evaluator."
        )
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _several(value: Any) -> bool:
    """Whether ``value`` is several numbers (a sweep's, one per copy), not one."""
    if isinstance(value, torch.Tensor):
        return value.numel() != 1
    return isinstance(value, list | tuple)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)

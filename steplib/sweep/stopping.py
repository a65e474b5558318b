"""Stopping copies of a sweep one by one: per-copy early stopping and successive halving.

A stopped copy is a False in the sweep optimizer's ``param_groups[0]["active"]`` mask, which
its update multiplies in (``torch.where``): its parameters and optimizer state never change
again, the other copies train on, and the step reads nothing on the host. The decision is
taken where values are on the host anyway: after an evaluation (``validation_end``), from the
per-copy values an ``Evaluator`` recorded (``per_copy_metric``). The mask is saved with the
optimizer, and these handlers' own state with every checkpoint (``state_dict``).

Imports ``events``, ``errors`` and the sweep's optimizer (never ``loop`` or ``step``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.wrappers import MultioutputWrapper

from steplib import errors
from steplib.errors import ConfigError, describe
from steplib.events import Event, Handler, Stop
from steplib.sweep.per_copy_optimizer import PerCopyOptimizer


def per_copy_metric(metric: Metric, n: int) -> Metric:
    """``metric`` computed separately for each of ``n`` copies: its ``compute()`` is ``[n]``.

    The eval step returns outputs with the copies first (``copies(x)`` is ``[n, batch, ...]``)
    and the targets expanded to match: ``make_eval_step(lambda m, b: (m(b[0]),
    b[1].expand(m.n, *b[1].shape)))``. An ``Evaluator`` then records each value as a list of
    ``n`` numbers (``val_accuracy: [0.91, 0.87, ...]``).

    Args:
        metric: a torchmetrics ``Metric`` (cloned once per copy).
        n: the number of copies.

    Returns:
        A ``Metric`` (torchmetrics' ``MultioutputWrapper`` over the copies' dimension).

    Raises:
        ConfigError: ``metric`` is not a Metric, or ``n`` not an int >= 1.

    Example:
        >>> import torch, torchmetrics
        >>> acc = per_copy_metric(torchmetrics.MeanMetric(), 2)
        >>> acc.update(torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
        >>> acc.compute().tolist()
        [2.0, 0.0]
    """
    if not isinstance(metric, Metric):
        raise ConfigError(
            f"per_copy_metric received {describe(metric)}; pass a torchmetrics Metric, e.g. "
            "per_copy_metric(MulticlassAccuracy(10, average='micro'), copies.n)."
        )
    n = errors.positive_int("per_copy_metric", "n", n)
    return _PerCopyMetric(metric, n, output_dim=0, remove_nans=False)


class _PerCopyMetric(MultioutputWrapper):
    """``MultioutputWrapper`` over the copies' dimension that refuses inputs with another
    number of copies: it would compute the first ``n`` and drop the rest without a word."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._check_copies(args, kwargs)
        super().update(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_copies(args, kwargs)
        return super().forward(*args, **kwargs)

    def _check_copies(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        n = len(self.metrics)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] != n):
                raise ConfigError(
                    f"per_copy_metric(..., n={n}) received a tensor of shape "
                    f"{tuple(value.shape)}; every input must have the copies first, {n} of "
                    "them. Give the metric the sweep's number of copies, "
                    "per_copy_metric(metric, copies.n), and expand the targets to match the "
                    "outputs: (m(x), y.expand(m.n, *y.shape))."
                )


def stop_copies(optimizer: torch.optim.Optimizer, which: Iterable[int]) -> None:
    """Stop updating the copies ``which`` (indices): a host write into the update's mask.

    Args:
        optimizer: the sweep's :class:`~steplib.sweep.SweepAdamW` or ``SweepSGD``.
        which: the indices of the copies to stop.

    Raises:
        ConfigError: ``optimizer`` is not a sweep optimizer, or an index is out of range.

    Example:
        >>> import torch
        >>> from steplib.sweep import Copies, SweepSGD
        >>> opt = SweepSGD(Copies.stack([torch.nn.Linear(2, 1)] * 3).parameters(), lr=0.1)
        >>> stop_copies(opt, [0, 2])
        >>> active_copies(opt)
        [1]
    """
    active = _active(optimizer, "stop_copies")
    for i in which:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(active):
            raise ConfigError(
                f"stop_copies received the index {describe(i)}; pass ints in [0, {len(active)})."
            )
        active[i] = False


def active_copies(optimizer: torch.optim.Optimizer) -> list[int]:
    """The indices of the copies still trained (a host read of the mask).

    Args:
        optimizer: the sweep's :class:`~steplib.sweep.SweepAdamW` or ``SweepSGD``.

    Returns:
        The indices, in order.

    Example:
        >>> import torch
        >>> from steplib.sweep import Copies, SweepAdamW
        >>> active_copies(SweepAdamW(Copies.stack([torch.nn.Linear(2, 1)] * 2).parameters()))
        [0, 1]
    """
    return [i for i, on in enumerate(_active(optimizer, "active_copies").tolist()) if on]


class SweepEarlyStopping(Handler):
    """Stop each copy at its own ``patience``-th evaluation in a row without improvement of its
    value of ``monitor``; stop the run when every copy has stopped.

    Attach it after the ``Evaluator`` (whose metrics are per copy, see
    :func:`per_copy_metric`): ``Events(evaluator, SweepEarlyStopping("val_loss", patience=3))``.

    Args:
        monitor: the name of a per-copy value the evaluator records (``"val_loss"``).
        mode: ``"min"`` or ``"max"``.
        patience: evaluations in a row without improvement that stop a copy (an int >= 1).
        min_delta: an improvement must beat the copy's best by more than this.

    Raises:
        ConfigError: bad arguments; at an evaluation, a value that is not one number per copy,
            or an optimizer that is not a sweep optimizer.

    Example:
        >>> stopper = SweepEarlyStopping("val_loss", patience=1)
        >>> stopper.update([1.0, 1.0]), stopper.update([0.5, 1.5])
        ([], [1])
    """

    def __init__(
        self, monitor: str, *, mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        self.monitor = _name("SweepEarlyStopping", monitor)
        self.mode = errors.mode("SweepEarlyStopping", mode)
        self.patience = errors.positive_int("SweepEarlyStopping", "patience", patience)
        self.min_delta = errors.non_negative("SweepEarlyStopping", "min_delta", min_delta)
        self.best: list[float | None] = []
        self.wait: list[int] = []

    def on_fit_start(self, event: Event) -> Stop | None:
        """Refuse an optimizer that cannot stop copies (before the first update, not at the
        first evaluation); stop at once a run that starts with every copy stopped (resumed
        after the evaluation that stopped the last one): it would otherwise go on to its next
        evaluation, with updates that update no copy and more evaluations, checkpoints and
        schedule steps than the run it continues. The mask decides, as after an evaluation,
        not this stopper's patience: a copy stopped by ``SuccessiveHalving`` (or by
        ``skip_nonfinite``, or by hand) may not have run out of it."""
        if not _active(event.state.optimizer, "SweepEarlyStopping").any():
            return Stop(f"sweep early stopping: every copy had stopped ({self.monitor})")
        return None

    def on_validation_end(self, event: Event) -> Stop | None:
        """Check each copy after each evaluation; stop the run when every copy has stopped."""
        optimizer = event.state.optimizer
        values = _values("SweepEarlyStopping", self.monitor, event, optimizer)
        stop_copies(optimizer, self.update(values))
        if not active_copies(optimizer):
            return Stop(f"sweep early stopping: every copy stopped improving {self.monitor}")
        return None

    def update(self, values: Sequence[float]) -> list[int]:
        """Count one evaluation of each copy's value; the copies whose patience ran out now."""
        if not self.best:
            self.best, self.wait = [None] * len(values), [0] * len(values)
        stopped = []
        for i, value in enumerate(values):
            if self.wait[i] >= self.patience:
                continue  # stopped earlier
            best = self.best[i]
            if not math.isnan(value) and (best is None or self._better(value, best)):
                self.best[i], self.wait[i] = float(value), 0
                continue
            self.wait[i] += 1
            if self.wait[i] >= self.patience:
                stopped.append(i)
        return stopped

    def _better(self, value: float, best: float) -> bool:
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        """Each copy's best value and evaluations waited (saved with each checkpoint), and
        what it watches (checked at load)."""
        return {**self._built(), "best": list(self.best), "wait": list(self.wait)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ConfigError`` for the state of one that
        watched another value)."""
        errors.same_handler("SweepEarlyStopping", self._built(), state)
        self.best, self.wait = list(state["best"]), [int(w) for w in state["wait"]]

    def _built(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode}


class SuccessiveHalving(Handler):
    """At each evaluation, keep training the best ``keep`` fraction of the copies still active
    (at least ``min_copies``) and stop the others: successive halving over a sweep's copies.

    Args:
        monitor: the name of a per-copy value the evaluator records (``"val_loss"``).
        mode: ``"min"`` or ``"max"``.
        keep: the fraction of the active copies kept at each evaluation, in (0, 1).
        min_copies: never fewer copies than this (an int >= 1).

    Raises:
        ConfigError: bad arguments; at an evaluation, as :class:`SweepEarlyStopping`.

    Example:
        >>> halving = SuccessiveHalving("val_loss", keep=0.5)
        >>> halving.choose([0.3, 0.1, 0.4, 0.2], active=[0, 1, 2, 3])
        [0, 2]
    """

    def __init__(
        self, monitor: str, *, mode: str = "min", keep: float = 0.5, min_copies: int = 1
    ) -> None:
        self.monitor = _name("SuccessiveHalving", monitor)
        self.mode = errors.mode("SuccessiveHalving", mode)
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep < 1:
            raise ConfigError(
                f"SuccessiveHalving(keep=...) received {describe(keep)}; pass the fraction of "
                "the copies to keep at each evaluation, a number in (0, 1), e.g. keep=0.5."
            )
        self.keep = float(keep)
        self.min_copies = errors.positive_int("SuccessiveHalving", "min_copies", min_copies)

    def on_fit_start(self, event: Event) -> None:
        """Refuse an optimizer that cannot stop copies (``torch.optim.AdamW``, which a sweep of
        seeds may use) before the first update, not at the first evaluation."""
        _active(event.state.optimizer, "SuccessiveHalving")

    def on_validation_end(self, event: Event) -> None:
        """Halve after each evaluation."""
        optimizer = event.state.optimizer
        values = _values("SuccessiveHalving", self.monitor, event, optimizer)
        stop_copies(optimizer, self.choose(values, active=active_copies(optimizer)))

    def choose(self, values: Sequence[float], *, active: Sequence[int]) -> list[int]:
        """The active copies to stop: all but the best ``keep`` fraction (NaN ranks last;
        a tie keeps the lower index)."""
        kept = max(self.min_copies, math.ceil(len(active) * self.keep))
        sign = 1.0 if self.mode == "min" else -1.0

        def rank(i: int) -> tuple[bool, float, int]:
            return (math.isnan(values[i]), sign * values[i], i)

        return sorted(sorted(active, key=rank)[kept:])


def _active(optimizer: Any, owner: str) -> torch.Tensor:
    if not isinstance(optimizer, PerCopyOptimizer):
        raise ConfigError(
            f"{owner} needs a sweep optimizer (SweepAdamW or SweepSGD), whose update masks "
            f"stopped copies; the state's optimizer is {describe(optimizer)}. Build it with "
            "SweepAdamW(copies.parameters(), lr=...)."
        )
    active: torch.Tensor = optimizer.param_groups[0]["active"]
    return active


def _values(owner: str, monitor: str, event: Event, optimizer: Any) -> list[float]:
    n = len(_active(optimizer, owner))
    metrics = event.metrics or {}
    value = metrics.get(monitor)
    if not isinstance(value, list) or len(value) != n:
        raise ConfigError(
            f"{owner}({monitor!r}) needs one value per copy ({n}) after each evaluation, and "
            f"the evaluation recorded {describe(value)}; the values are "
            f"{sorted(metrics)}. Give the Evaluator per-copy metrics: "
            "metrics={'loss': per_copy_metric(MeanMetric(), copies.n)}."
        )
    return [float(v) for v in value]


def _name(owner: str, monitor: Any) -> str:
    if not isinstance(monitor, str) or not monitor:
        raise ConfigError(
            f"{owner}(monitor) received {describe(monitor)}; pass the name of a per-copy value "
            "the Evaluator records, e.g. 'val_loss'."
        )
    return monitor

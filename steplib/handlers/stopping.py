"""Handlers that decide whether training goes on, and monitors of the gradient norm and the LR.

* :class:`EarlyStopping`: stop when a monitored value (e.g. ``val_loss`` that
  :class:`~steplib.handlers.evaluation.Evaluator` puts in ``state.extras``) stopped improving.
* :class:`TimeLimit`: stop before a wall-clock budget runs out.
* :class:`StopFile`: stop when a file appears (``touch runs/exp/STOP``).
* :class:`NonFiniteAlarm`: raise (or stop) on a NaN/inf loss or gradient norm, naming the step
  and the batch, while reading the device only every ``every`` updates.
* :class:`GradNormMonitor`, :class:`LRMonitor`: log sources (see
  :class:`steplib.handlers.logging.Log`).

Every stop decision is taken jointly when a process group is initialised (one small all-reduce
on the check's interval): a rank that stops alone leaves the others waiting in a collective.

Imports ``events``, ``errors``, ``distributed`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import torch

from steplib import errors
from steplib.distributed.collectives import any_rank
from steplib.errors import ConfigError, StepLibError, describe
from steplib.events import Event, Events, Stop


class NonFiniteError(StepLibError, FloatingPointError):
    """:class:`NonFiniteAlarm` saw a NaN or infinite loss or gradient norm."""


def _device(event: Event) -> torch.device | None:
    return getattr(event.state, "device", None)


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
        """Whether ``value`` improves on the best by more than ``min_delta`` (NaN never does)."""
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


def monitored_value(owner: str, monitor: str, event: Event) -> float:
    """``event.state.extras[monitor]`` as a float: what a handler that watches a value reads
    (:class:`EarlyStopping`, :func:`~steplib.handlers.export.export_best`).

    Args:
        owner: the handler's name, for the error message.
        monitor: the name in ``state.extras``.
        event: the event whose state holds the value.

    Returns:
        The value as a float (a one-element tensor is read with ``.item()``).

    Raises:
        ConfigError: ``monitor`` is not in ``state.extras``; the message lists the numbers that
            are there.

    Example:
        >>> from types import SimpleNamespace
        >>> event = Event("step_end", state=SimpleNamespace(extras={"val_loss": 0.5}), step=3)
        >>> monitored_value("EarlyStopping", "val_loss", event)
        0.5
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
    value = extras[monitor]
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)


class EarlyStopping:
    """Stop when ``state.extras[monitor]`` has not improved for ``patience`` checks.

    Each call is one check: register it after the evaluation handler, on the same event and
    interval, so that every check sees a fresh value::

        evaluator.attach(events)                       # every=500, puts val_loss in extras
        events.on("step_end", EarlyStopping("val_loss", patience=3), every=500)

    Args:
        monitor: the name in ``state.extras`` (an evaluator's names carry its prefix: ``val_``).
        mode: ``"min"`` or ``"max"``.
        patience: checks without improvement tolerated; the next one stops (0: stop at the first).
        min_delta: an improvement must beat the best by more than this.

    Raises:
        ConfigError: bad arguments; at a check, ``monitor`` missing from ``state.extras`` (the
            message lists the names that are there).

    Example:
        >>> stopper = EarlyStopping("val_loss", patience=1)
        >>> [stopper.update(v, step=s) is not None for s, v in enumerate([2.0, 1.0, 1.5, 1.2])]
        [False, False, False, True]
    """

    def __init__(
        self, monitor: str, *, mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(
                f"EarlyStopping(monitor) received {describe(monitor)}; pass the name of a value "
                "in state.extras, e.g. EarlyStopping('val_loss')."
            )
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ConfigError(
                f"EarlyStopping(patience=...) received {describe(patience)}; it must be an int "
                ">= 0 (checks without improvement to tolerate), e.g. patience=3."
            )
        self.monitor = monitor
        self.patience = patience
        self.best = BestValue(mode=mode, min_delta=min_delta)
        self.wait = 0

    def __call__(self, event: Event) -> Stop | None:
        """Check ``event.state.extras[monitor]`` (a host number: no device read)."""
        value = monitored_value("EarlyStopping", self.monitor, event)
        return self.update(value, step=event.step)

    def update(self, value: float, *, step: int) -> Stop | None:
        """Count one check of ``value`` at ``step``; a :class:`Stop` when patience ran out."""
        if self.best.update(value, step=step):
            self.wait = 0
            return None
        self.wait += 1
        if self.wait <= self.patience:
            return None
        return Stop(
            f"early stopping: {self.monitor} has not improved by more than "
            f"{self.best.min_delta} for {self.wait} checks (best {self.best.value} at step "
            f"{self.best.step}, now {value} at step {step})"
        )

    def state_dict(self) -> dict[str, Any]:
        """The best value and the checks waited (save it with a checkpoint's ``extras``)."""
        return {"best": self.best.state_dict(), "wait": self.wait}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run keeps its patience)."""
        self.best.load_state_dict(state["best"])
        self.wait = int(state["wait"])


class TimeLimit:
    """Stop before a wall-clock budget runs out: when the next update would likely cross it.

    The clock starts at ``fit_start`` (or at the first check without one). The estimate of
    the next update's time is the mean time per update so far, measured on the host: no tensor
    is read.

    Args:
        seconds: the budget.
        every: check every this many updates (each check is one all-reduce when a process group
            is initialised, so that every rank stops at the same step).
        clock: the time source (``time.monotonic``); tests pass a fake one.

    Raises:
        ConfigError: ``seconds`` not a number > 0, ``every`` not a positive int.

    Example:
        >>> from steplib import Events
        >>> limit = TimeLimit(3600)
        >>> events = limit.attach(Events())
        >>> limit.seconds
        3600.0
    """

    def __init__(self, seconds: float, *, every: int = 1, clock: Any = time.monotonic) -> None:
        if errors.non_negative("TimeLimit", "seconds", seconds) == 0:
            raise ConfigError("TimeLimit(seconds=0) would stop at once; pass seconds > 0.")
        self.seconds = float(seconds)
        self.every = errors.positive_int("TimeLimit", "every", every)
        self._clock = clock
        self._start: float | None = None
        self._start_step = 0

    def attach(self, events: Events) -> Events:
        """Register on ``fit_start`` (start the clock) and ``step_end`` (check)."""
        events.on("fit_start", self.start)
        events.on("step_end", self, every=self.every)
        return events

    def start(self, event: Event) -> None:
        """Start the clock now."""
        self._start, self._start_step = self._clock(), event.step

    def __call__(self, event: Event) -> Stop | None:
        """Stop when the time used plus one more update's worth reaches the budget."""
        if self._start is None:
            self.start(event)
            return None
        used = self._clock() - self._start
        per_update = used / max(event.step - self._start_step, 1)
        if not any_rank(used + per_update >= self.seconds, device=_device(event)):
            return None
        return Stop(
            f"time limit: {used:.0f} s used of {self.seconds:.0f} s after {event.step} updates; "
            f"one more (about {per_update:.1f} s) would cross the budget"
        )


class StopFile:
    """Stop when a file exists (``touch runs/exp/STOP`` from a shell), then remove it.

    Args:
        path: a local path or fsspec URL.
        every: check every this many updates (a file-system call, and one all-reduce when a
            process group is initialised).
        remove: delete the file once seen (by the ranks that saw it), so that a restarted run
            does not stop at once.

    Raises:
        ConfigError: ``path`` not a non-empty string, ``every`` not a positive int.

    Example:
        >>> import fsspec
        >>> from steplib import Event
        >>> flag = StopFile("memory://doc/STOP")
        >>> flag(Event("step_end", state=None, step=10)) is None
        True
        >>> fsspec.open("memory://doc/STOP", "w").open().close()
        >>> flag(Event("step_end", state=None, step=20)).reason
        'stop file memory://doc/STOP found at step 20'
    """

    def __init__(self, path: str, *, every: int = 10, remove: bool = True) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"StopFile(path) received {describe(path)}; pass the path of the file to watch, "
                "e.g. StopFile('runs/exp/STOP')."
            )
        self.path = path
        self.every = errors.positive_int("StopFile", "every", every)
        self.remove = remove
        self._fs, self._path = fsspec.core.url_to_fs(path)

    def attach(self, events: Events) -> Events:
        """Register on ``step_end`` every ``every`` updates."""
        return events.on("step_end", self, every=self.every)

    def __call__(self, event: Event) -> Stop | None:
        """Stop if the file exists (on any rank)."""
        seen = bool(self._fs.exists(self._path))
        if not any_rank(seen, device=_device(event)):
            return None
        if self.remove and seen:
            # Every rank checked before the agreement, so removing now hides it from none; on
            # a shared file system another rank may have removed it already.
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm(self._path)
        return Stop(f"stop file {self.path} found at step {event.step}")


# Where a micro-batch was: step, epoch, batch index in the epoch, micro-step.
_Where = tuple[int, int, int | None, int]


class NonFiniteAlarm:
    """Raise :class:`NonFiniteError` (or stop) when a loss or gradient norm is NaN or infinite,
    naming the first step, epoch and batch index where it happened.

    Each micro-batch's finiteness is kept as a tensor on the device; the flags are read in one
    host transfer every ``every`` updates, so the alarm names the exact batch without a host sync
    per step. With accumulation, a non-final micro-batch is judged by its own loss, the final
    one by the window's loss and gradient norm.

    Args:
        every: read the flags every this many updates (and at ``fit_end``).
        include_skipped: also alarm for windows that ``skip_nonfinite`` or a float16 scaler
            skipped (their update was not applied, so by default they are not an alarm).
        action: ``"raise"`` or ``"stop"`` (return a :class:`Stop` with the same message).

    Raises:
        ConfigError: bad arguments.

    Example:
        >>> from steplib import Events
        >>> alarm = NonFiniteAlarm(every=50)
        >>> events = alarm.attach(Events())
        >>> alarm.action
        'raise'
    """

    def __init__(
        self, *, every: int = 10, include_skipped: bool = False, action: str = "raise"
    ) -> None:
        self.every = errors.positive_int("NonFiniteAlarm", "every", every)
        if action not in ("raise", "stop"):
            raise ConfigError(
                f"NonFiniteAlarm(action=...) received {describe(action)}; pass 'raise' (stop "
                "the run with NonFiniteError) or 'stop' (end it cleanly with a Stop)."
            )
        self.include_skipped = include_skipped
        self.action = action
        # Per micro-batch of the open window, then of the closed windows not read yet: a device
        # flag pair [loss bad, grad norm bad] and where it was (step, epoch, batch, micro-step).
        self._window: list[torch.Tensor] = []
        self._window_where: list[_Where] = []
        self._pending: list[torch.Tensor] = []
        self._pending_where: list[_Where] = []

    def attach(self, events: Events) -> Events:
        """Register on ``micro_step_end`` (flag), ``step_end`` (close the window, read every
        ``every``) and ``fit_end`` (read what is left)."""
        events.on("micro_step_end", self.on_micro_step_end)
        events.on("step_end", self.on_step_end)
        events.on("fit_end", self.check)
        return events

    def on_micro_step_end(self, event: Event) -> None:
        """Flag this micro-batch's loss (device ops only)."""
        bad = ~torch.isfinite(event.output.loss.detach())
        self._window.append(torch.stack((bad, torch.zeros_like(bad))))
        # The update this micro-batch belongs to: while its window is open, the next one.
        window_open = getattr(event.state, "window_size", 0) > 0
        step = event.step + 1 if window_open else event.step
        self._window_where.append((step, event.epoch, event.batch_index, event.micro_step))

    def on_step_end(self, event: Event) -> Stop | None:
        """Close the window (gradient norm, skipped mask); read the flags on the interval."""
        out = event.output
        if not self._window:  # a window the loop flushed, with no micro-step event of its own
            self.on_micro_step_end(event)
        window = self._window
        if out.grad_norm is not None:
            grad_bad = ~torch.isfinite(out.grad_norm.detach()).to(window[-1].device)
            window[-1] = window[-1] | torch.stack((torch.zeros_like(grad_bad), grad_bad))
        if not self.include_skipped:
            keep = ~out.skipped.to(window[-1].device)
            window = [flags & keep for flags in window]
        self._pending.extend(window)
        self._pending_where.extend(self._window_where)
        self._window, self._window_where = [], []
        if event.step % self.every == 0:
            return self.check(event)
        return None

    def check(self, event: Event | None = None) -> Stop | None:
        """Read the pending flags (one host transfer); raise or stop at the first bad one."""
        pending, where = self._pending, self._pending_where
        self._pending, self._pending_where = [], []
        if not pending:
            return None
        flags = torch.stack(pending).tolist()  # the one host read
        for (loss_bad, grad_bad), (step, epoch, batch, micro) in zip(flags, where, strict=True):
            if not (loss_bad or grad_bad):
                continue
            what = "loss" if loss_bad else "gradient norm"
            message = (
                f"non-finite {what} (NaN or inf) at step {step} (epoch {epoch}, batch index "
                f"{batch}, micro-step {micro}). Look at that batch for NaN/inf or extreme "
                "values; lower the learning rate; add clip(step, max_norm=1.0); or wrap the "
                "step in skip_nonfinite to skip such updates."
            )
            if self.action == "stop":
                return Stop(message)
            raise NonFiniteError(message)
        return None


class GradNormMonitor:
    """A log source: mean and max of the gradient norm over the updates since the last read.

    The norm is the one the step measured (``StepOutput.grad_norm``): wrap the step with
    ``clip(step, max_norm=...)`` or ``skip_nonfinite(step)``. Sums stay on the device; one host
    read per :meth:`read`. Skipped updates are left out.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from steplib import Event
        >>> monitor = GradNormMonitor()
        >>> for norm in (1.0, 3.0):
        ...     out = SimpleNamespace(grad_norm=torch.tensor(norm), skipped=torch.tensor(False))
        ...     monitor.update(Event("step_end", state=None, output=out))
        >>> monitor.read(Event("step_end", state=None))
        {'grad_norm_mean': 2.0, 'grad_norm_max': 3.0}
    """

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._last: Any = None

    def attach(self, events: Events) -> Events:
        """Register :meth:`update` on every ``step_end``."""
        return events.on("step_end", self.update)

    def update(self, event: Event) -> None:
        """Add this update's norm (device ops only).

        Raises:
            ConfigError: the step does not measure the gradient norm.
        """
        out = event.output
        if out is None or out is self._last:
            return
        self._last = out
        if out.grad_norm is None:
            raise ConfigError(
                "GradNormMonitor: the step reports no gradient norm (StepOutput.grad_norm is "
                "None), so there is nothing to monitor. Build the step with clip(step, "
                "max_norm=1.0) or skip_nonfinite(step), which measure it."
            )
        keep = ~out.skipped.to(out.grad_norm.device)
        norm = torch.where(keep, out.grad_norm.detach().float(), 0.0)
        count = keep.float()
        if self._sum is None or self._max is None or self._count is None:
            self._sum, self._max, self._count = norm, norm, count
        else:
            self._sum, self._count = self._sum + norm, self._count + count
            self._max = torch.maximum(self._max, norm)

    def read(self, event: Event | None) -> dict[str, float]:
        """The mean and max since the last read (empty when no update was seen); resets.

        ``event``'s own output is added first if :meth:`update` has not seen it.
        """
        if event is not None:
            self.update(event)
        if self._sum is None or self._max is None or self._count is None:
            return {}
        total, largest, count = torch.stack((self._sum, self._max, self._count)).tolist()
        self._sum = self._max = self._count = None
        if count == 0:
            return {}
        return {"grad_norm_mean": total / count, "grad_norm_max": largest}


class LRMonitor:
    """A log source: the learning rate of each parameter group, read from the optimizer.

    The optimizer keeps a float LR on the host, so reading it costs no device sync (a tensor LR
    is read with ``float``). One group is logged as ``lr``, several as ``lr/group0``, ...

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from steplib import Event
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
        >>> LRMonitor().read(Event("step_end", state=SimpleNamespace(optimizer=opt)))
        {'lr/group0': 0.1, 'lr/group1': 0.1}
    """

    def read(self, event: Event) -> dict[str, float]:
        """The current LR of every group (after this update's scheduler step)."""
        groups = event.state.optimizer.param_groups
        rates = [float(group["lr"]) for group in groups]
        if len(rates) == 1:
            return {"lr": rates[0]}
        return {f"lr/group{i}": rate for i, rate in enumerate(rates)}

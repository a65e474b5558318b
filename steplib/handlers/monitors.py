"""Monitors: an alarm on non-finite losses and gradient norms, and log sources for the gradient
norm and the learning rate.

* :class:`NonFiniteAlarm`: raise (or stop) on a NaN/inf loss or gradient norm, naming the step
  and the batch, while reading the device only every ``every`` updates.
* :class:`GradNormMonitor`, :class:`LRMonitor`: log sources (see
  :class:`steplib.handlers.logging.Log`).

Imports ``events``, ``errors`` and ``output`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from steplib import errors
from steplib.cadence import due
from steplib.errors import ConfigError, NonFiniteError, describe
from steplib.events import Event, Handler, Stop
from steplib.output import Unread

# Where a micro-batch was: the step's name ("" for one step), the update, the epoch, the batch
# index in the epoch, the micro-step.
_Where = tuple[str, int, int, int | None, int]


class NonFiniteAlarm(Handler):
    """Raise :class:`NonFiniteError` (or stop) when a loss or gradient norm is NaN or infinite,
    naming the first step, epoch and batch index where it happened.

    Each micro-batch's finiteness is kept as a tensor on the device; the flags are read in one
    host transfer every ``every`` updates, so the alarm names the exact batch without a host sync
    per step. With accumulation, a non-final micro-batch is judged by its own loss, the final
    one by the window's loss and gradient norm. With several steps (a GAN's D and G) each
    step's windows are judged by its own loss, gradient norm and skip.

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
        # Per step, the micro-batches of its open window; then those of the closed windows not
        # read yet: a device flag pair [loss bad, grad norm bad] and where it was (_Where).
        self._window: dict[str, list[torch.Tensor]] = {}
        self._window_where: dict[str, list[_Where]] = {}
        self._pending: list[torch.Tensor] = []
        self._pending_where: list[_Where] = []
        self._flagged: dict[str, Any] = {}  # per step, the last output flagged
        self._optimizers: dict[str, str] = {}  # per step, the optimizer it updates (several)

    def on_fit_start(self, event: Event) -> None:
        """Find the optimizer each step updates (a state of several), whose window says when
        the step's skip is decided.

        Raises:
            ConfigError: a step of the run that updates no optimizer of the state.
        """
        self._optimizers = errors.step_optimizers("NonFiniteAlarm", event)

    def on_micro_step_end(self, event: Event) -> None:
        """Flag each step's loss of this micro-batch (device ops only)."""
        for name, out in (event.outputs or {"": event.output}).items():
            self._flag(event, name, out)

    def on_step_end(self, event: Event) -> Stop | None:
        """Flag what the loop flushed (no micro-step event of its own); read on the interval."""
        for name, out in (event.outputs or {"": event.output}).items():
            if out is not self._flagged.get(name):
                self._flag(event, name, out)
        if due(self.every, event):
            return self.check(event)
        return None

    def _flag(self, event: Event, name: str, out: Any) -> None:
        self._flagged[name] = out
        # Per element: a sweep's loss is one per copy, and each copy's flags are masked by its
        # own skip below (reduced only then: a copy skipped must not hide another's NaN).
        bad = ~torch.isfinite(out.loss.detach())
        window = self._window.setdefault(name, [])
        window.append(torch.stack((bad, torch.zeros_like(bad))))
        # The update (of the run's counter) this micro-batch belongs to: while the counted
        # window is open, the next one.
        counted = getattr(event.state, "window", None)
        step = event.step + 1 if counted is not None and counted.size > 0 else event.step
        where = (name, step, event.epoch, event.batch_index, event.micro_step)
        self._window_where.setdefault(name, []).append(where)
        # Its own optimizer's window (a GAN's state); else the state's.
        optimizer = self._optimizers.get(name, name)
        named = optimizer in getattr(event.state, "names", ())
        own = getattr(event.state[optimizer] if named else event.state, "window", None)
        if own is not None and own.size > 0:
            return  # this step's window is still open: its skip is not decided yet
        # The window closed at this micro-batch: its gradient norm and its own skip.
        if out.grad_norm is not None:
            grad_bad = ~torch.isfinite(out.grad_norm.detach()).to(window[-1].device)
            window[-1] = window[-1] | torch.stack((torch.zeros_like(grad_bad), grad_bad))
        if not self.include_skipped:
            # Applied updates only: at a closed window that is ~skipped for one model, and it
            # also leaves out a sweep's stopped copy, whose loss (NaN once it diverged) trains
            # nothing and is neither applied nor skipped.
            keep = out.did_update.to(window[-1].device)
            window = [flags & keep.to(flags.device) for flags in window]
        # [loss bad, grad norm bad] of any copy (a sweep's [2, N]; one model's is [2] already).
        self._pending.extend(flags.reshape(2, -1).any(dim=1) for flags in window)
        self._pending_where.extend(self._window_where[name])
        self._window[name], self._window_where[name] = [], []

    def on_fit_end(self, event: Event) -> Stop | None:
        """Read the flags left (:meth:`check`)."""
        return self.check(event)

    def state_dict(self) -> dict[str, Any]:
        """The flags not read yet and where each was (of the open windows and of the closed
        ones). Attached to a run, they are saved with each checkpoint and restored on resume
        (``checkpoint.contents``), so that a NaN flagged before a kill still raises at the
        read after the resume, naming its own step, as without the interruption.

        Example:
            >>> NonFiniteAlarm().state_dict()
            {'window': {}, 'window_where': {}, 'pending': [], 'pending_where': []}
        """
        return {
            "window": {name: list(flags) for name, flags in self._window.items()},
            "window_where": {
                name: [list(w) for w in where] for name, where in self._window_where.items()
            },
            "pending": list(self._pending),
            "pending_where": [list(where) for where in self._pending_where],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the flags stay where they were loaded:
        :meth:`check` brings them to one device)."""
        self._window = {name: list(flags) for name, flags in state["window"].items()}
        self._window_where = {
            name: [_where(w) for w in where] for name, where in state["window_where"].items()
        }
        self._pending = list(state["pending"])
        self._pending_where = [_where(where) for where in state["pending_where"]]

    def check(self, event: Event | None = None) -> Stop | None:
        """Read the pending flags (one host transfer); raise or stop at the first bad one."""
        pending, where = self._pending, self._pending_where
        self._pending, self._pending_where = [], []
        if not pending:
            return None
        # Flags restored at a resume may sit on the CPU (as loaded), the new ones on the GPU.
        device = pending[-1].device
        flags = torch.stack([f.to(device) for f in pending]).tolist()  # the one host read
        for (loss_bad, grad_bad), (name, step, epoch, batch, micro) in zip(
            flags, where, strict=True
        ):
            if not (loss_bad or grad_bad):
                continue
            what = ("loss" if loss_bad else "gradient norm") + (
                f" of step {name!r}" if name else ""
            )
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


def _where(saved: Any) -> _Where:
    name, step, epoch, batch, micro = saved
    return str(name), int(step), int(epoch), None if batch is None else int(batch), int(micro)


class GradNormMonitor(Handler):
    """A log source: mean and max of the gradient norm over the updates since the last read.

    The norm is the one the step measured (``StepOutput.grad_norm``): wrap the step with
    ``clip(step, max_norm=...)`` or ``skip_nonfinite(step)``. Sums stay on the device; one host
    read per :meth:`read`. Skipped updates (and a sweep's stopped copies) are left out.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from steplib import Event
        >>> monitor = GradNormMonitor()
        >>> for norm in (1.0, 3.0):
        ...     out = SimpleNamespace(grad_norm=torch.tensor(norm), did_update=torch.tensor(True))
        ...     monitor.update(Event("step_end", state=None, output=out))
        >>> monitor.read(Event("step_end", state=None))
        {'grad_norm_mean': 2.0, 'grad_norm_max': 3.0, 'updates': 2}
    """

    def __init__(self) -> None:
        # Per step ("" for a run of one step): the sum, max and count of the norms not skipped.
        self._norms: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._unread = Unread()
        # The run's updates since the last read: a record says how many it covers
        # (``updates``), so that a sink continuing its file at a resume drops the record a
        # stopped run wrote after the save of its update.
        self._updates = 0

    def on_micro_step_end(self, event: Event) -> None:
        """In a run of several steps, add each step's window that closed with a norm."""
        if event.outputs is not None:
            self.update(event)

    def on_step_end(self, event: Event) -> None:
        """:meth:`update` on every update."""
        self.update(event)

    def update(self, event: Event) -> None:
        """Add this update's norm (device ops only); in a run of several steps, each step's
        norm of a window that closed, under its name (a step that measures none is left out).

        Raises:
            ConfigError: the step does not measure the gradient norm.
        """
        for name, out in self._unread.outputs(event):
            if out.grad_norm is not None:
                self._add(name, out)
            elif event.outputs is None:  # several steps: one that measures none is left out
                raise ConfigError(
                    "GradNormMonitor: the step reports no gradient norm (StepOutput.grad_norm "
                    "is None), so there is nothing to monitor. Build the step with clip(step, "
                    "max_norm=1.0) or skip_nonfinite(step), which measure it."
                )
        if self._unread.counts(event):
            self._updates += 1

    def _add(self, name: str, out: Any) -> None:
        # Applied updates only (a closed window: ~skipped for one model; a sweep's stopped copy
        # is neither applied nor skipped, and its norm is of no update).
        keep = out.did_update.to(out.grad_norm.device)
        norm = torch.where(keep, out.grad_norm.detach().float(), 0.0)
        count = keep.float()
        if name in self._norms:
            total, largest, seen = self._norms[name]
            norm, largest, count = total + norm, torch.maximum(largest, norm), seen + count
        else:
            largest = norm
        self._norms[name] = (norm, largest, count)

    def state_dict(self) -> dict[str, Any]:
        """The sums of the interval not yet read, per step. Attached to a run, they are saved
        with each checkpoint and restored on resume (``checkpoint.contents``), so that the
        first read after a resume covers the same updates as without the interruption.

        Example:
            >>> GradNormMonitor().state_dict()
            {'steps': {}, 'updates': 0}
        """
        return {
            "steps": {name: list(norms) for name, norms in self._norms.items()},
            "updates": self._updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (or an earlier checkpoint's one step)."""
        if "steps" not in state:  # before the sums were kept per step
            one = (state["sum"], state["max"], state["count"])
            state = {"steps": {"": one} if one[0] is not None else {}}
        self._norms = {name: (s, m, c) for name, (s, m, c) in state["steps"].items()}
        self._updates = int(state.get("updates", 0))  # absent from an older checkpoint

    def read(self, event: Event | None) -> dict[str, float | list[float]]:
        """The mean and max since the last read (empty when no update was seen), and
        ``updates``, the run's updates they cover; resets. In a run of several steps, each
        step's under its name (``D/grad_norm_mean``); in a sweep, lists of one per copy (NaN
        for a copy whose updates were all skipped).

        ``event``'s own outputs are added first if :meth:`update` has not seen them.
        """
        if event is not None:
            errors.reader_attached("GradNormMonitor", self, event, "norms")
            self.update(event)
        if not self._norms:
            self._updates = 0
            return {}
        names = list(self._norms)
        device = self._norms[names[-1]][0].device
        flat = [t.to(device).float() for name in names for t in self._norms[name]]
        values = torch.stack(flat).tolist()  # the one host read
        updates, self._norms, self._updates = self._updates, {}, 0
        record: dict[str, float | list[float]] = {}
        for i, name in enumerate(names):
            sweep = isinstance(values[3 * i], list)  # a sweep's sums are one per copy ([N])
            total, largest, count = (v if sweep else [v] for v in values[3 * i : 3 * i + 3])
            if not any(c > 0 for c in count):
                continue
            # A copy whose updates were all skipped has no norm: NaN, as its loss has.
            means = [t / c if c > 0 else math.nan for t, c in zip(total, count, strict=True)]
            maxes = [m if c > 0 else math.nan for m, c in zip(largest, count, strict=True)]
            prefix = f"{name}/" if name else ""
            record[prefix + "grad_norm_mean"] = means if sweep else means[0]
            record[prefix + "grad_norm_max"] = maxes if sweep else maxes[0]
        if record and updates:
            record["updates"] = updates  # as TrainMetrics' record says it
        return record


class LRMonitor:
    """A log source: the learning rate each parameter group holds after the update, the one
    the next update uses (the state's scheduler has stepped; a ``Scheduler`` handler steps its
    own at the epoch's end, after this read), read from the optimizer.

    Its names say so: one group is logged as ``next_lr``, several as ``next_lr/group0``, ...
    ``lr`` is the rate the update used (the step's record, ``TrainMetrics``; the first group's),
    one update behind on a schedule: under one name, a warmup's curve would be an update early.
    The optimizer keeps a float LR on the host, so reading it costs no device sync (a tensor LR
    is read with ``float``).

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from steplib import Event
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
        >>> LRMonitor().read(Event("step_end", state=SimpleNamespace(optimizer=opt)))
        {'next_lr/group0': 0.1, 'next_lr/group1': 0.1}
    """

    def read(self, event: Event) -> dict[str, float | list[float]]:
        """The current LR of every group (after this update's scheduler step); a sweep
        optimizer's, one per copy. A state of several optimizers: each one's under its name
        (``G/next_lr``, ``D/next_lr/group1``), not the first's alone as the run's."""
        state = event.state
        names = getattr(state, "names", ())
        if not names:
            return _rates(state.optimizer, "")
        return {
            k: v for name in names for k, v in _rates(state[name].optimizer, f"{name}/").items()
        }


def _rates(optimizer: Any, prefix: str) -> dict[str, float | list[float]]:
    rates = [_rate(group) for group in optimizer.param_groups]
    if len(rates) == 1:
        return {f"{prefix}next_lr": rates[0]}
    return {f"{prefix}next_lr/group{i}": rate for i, rate in enumerate(rates)}


def _rate(group: Mapping[str, Any]) -> float | list[float]:
    """A group's LR. A sweep optimizer's group (``steplib.sweep``) holds a per-copy factor in
    ``copies["lr"]`` and the schedule's in ``lr``: copy ``i``'s rate is their product, logged
    as a list as the step's ``out.lr`` is (``lr`` alone is no copy's rate)."""
    copies = group.get("copies")
    if isinstance(copies, Mapping) and "lr" in copies:
        rates: list[float] = (float(group["lr"]) * copies["lr"]).tolist()
        return rates
    return float(group["lr"])

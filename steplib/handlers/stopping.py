"""Stopping rules: handlers that decide whether training goes on.

* :class:`EarlyStopping`: stop when a monitored value (e.g. ``val_loss`` that
  :class:`~steplib.handlers.evaluation.Evaluator` puts in ``state.extras``) stopped improving.
* :class:`TimeLimit`: stop before a wall-clock budget runs out.
* :class:`StopFile`: stop when a file appears (``touch runs/exp/STOP``).

The watched value and its best so far are ``steplib.handlers.watched_value``'s.

Every stop decision is taken jointly when a process group is initialised (one small all-reduce
on the check's interval; early stopping checks its value is the same on every rank): a rank
that stops alone leaves the others waiting in a collective.

Imports ``events``, ``state``, ``errors``, ``distributed``, ``eval_sets``, ``watched_value`` (not
``loop``, ``step``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import torch

from steplib import errors
from steplib.cadence import due
from steplib.distributed.collectives import any_rank
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, Handler, Stop
from steplib.handlers.eval_sets import same_on_every_rank
from steplib.handlers.watched_value import BestValue, monitored_value


def _device(event: Event) -> torch.device | None:
    return getattr(event.state, "device", None)


class EarlyStopping(Handler):
    """Stop at the ``patience``-th check in a row without improvement of ``state.extras[monitor]``.

    ``patience`` means what it means in Lightning, Keras, Ignite and the HF Trainer:
    ``patience=3`` stops at the 3rd check without improvement (steplib 0.1.0 stopped at the
    4th: to keep an old run's behaviour, add one).

    Each call is one check. Give it the evaluator (built with ``monitor=``) and it checks
    after each of the evaluator's evaluations, with its metric and mode::

        evaluator = Evaluator(eval_step, val, metrics=..., every=500, monitor="val_loss")
        events = Events(evaluator, EarlyStopping(evaluator, patience=3))  # in either order

    or give it a name and register it after the evaluation handler, on the same interval:
    ``events.on("step_end", EarlyStopping("val_loss", patience=3), every=500)``.

    Args:
        monitor: an ``Evaluator`` built with ``monitor=...``, or the name in ``state.extras``
            (an evaluator's names carry its prefix: ``val_``).
        mode: ``"min"`` or ``"max"`` (default ``"min"``; the evaluator's when given one).
        patience: the number of checks in a row without improvement that stops training
            (1: stop at the first check that does not improve).
        min_delta: an improvement must beat the best by more than this.

    Raises:
        ConfigError: bad arguments; at a check, ``monitor`` missing from ``state.extras`` (the
            message lists the names that are there).

    Example:
        >>> stopper = EarlyStopping("val_loss", patience=2)
        >>> [stopper.update(v, step=s) is not None for s, v in enumerate([2.0, 1.0, 1.5, 1.2])]
        [False, False, False, True]
    """

    def __init__(
        self, monitor: Any, *, mode: str | None = None, patience: int = 3, min_delta: float = 0.0
    ) -> None:
        name, mode = errors.monitor_and_mode("EarlyStopping", monitor, mode)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(
                f"EarlyStopping(patience=...) received {describe(patience)}; it must be an int "
                ">= 1: the number of checks in a row without improvement that stops training "
                "(patience=1 stops at the first one), e.g. patience=3."
            )
        self.monitor = name
        self.patience = patience
        self.best = BestValue(mode=mode, min_delta=min_delta)
        self.wait = 0
        self.evaluator = None if isinstance(monitor, str) else monitor
        self._evaluations = 0  # of the evaluator's, when given one: one check per evaluation

    def on_attach(self, events: Events) -> None:
        """Refuse to be attached when built from a name (register the evaluator first: it
        checks on the events the evaluator runs on, after it).

        Raises:
            ConfigError: built from a name, which does not say when to check.
        """
        if self.evaluator is None:
            raise ConfigError(
                f"EarlyStopping({self.monitor!r}) was given a name, which does not say when to "
                "check. Give it the evaluator: EarlyStopping(evaluator, patience=...), or "
                f"register it: events.on('step_end', stopper, every=500)."
            )

    def on_fit_start(self, event: Event) -> Stop | None:
        """Refuse an evaluator that is not attached to the run (it would never evaluate); stop
        at once a run resumed after this stopper had stopped it (not one check later).

        Raises:
            ConfigError: the evaluator given is not attached to ``event.events``.
        """
        if self.evaluator is not None:
            errors.evaluator_attached("EarlyStopping", self.evaluator, event.events)
        if self.wait < self.patience:
            return None
        return Stop(
            f"early stopping: resumed after its stop ({self.monitor} had not improved for "
            f"{self.wait} checks; best {self.best.value} at step {self.best.step})"
        )

    def on_validation_end(self, event: Event) -> Stop | None:
        """Check after each of the evaluator's evaluations, on its ``validation_end``: the
        check sees this evaluation's value whichever was attached first (not the last one's)."""
        return self(event)

    def __call__(self, event: Event) -> Stop | None:
        """Check ``event.state.extras[monitor]`` (a host number: no device read)."""
        if self.evaluator is not None:
            evaluations = len(self.evaluator.history)
            if evaluations == self._evaluations:  # another evaluator's validation_end
                return None
            self._evaluations = evaluations
        value = monitored_value("EarlyStopping", self.monitor, event)
        if value is not None and self.evaluator is None:  # an evaluator checks its own values
            same_on_every_rank({self.monitor: value}, owner="EarlyStopping")
            fix = "Give it the evaluator, EarlyStopping(evaluator, ...): its name and mode."
            errors.same_mode("EarlyStopping", self.monitor, self.best.mode, event.events, fix=fix)
        return None if value is None else self.update(value, step=event.step)

    def update(self, value: float, *, step: int) -> Stop | None:
        """Count one check of ``value`` at ``step``; a :class:`Stop` when patience ran out."""
        if self.best.update(value, step=step):
            self.wait = 0
            return None
        self.wait += 1  # Lightning, Keras, Ignite, HF Trainer: stop when it reaches patience
        if self.wait < self.patience:
            return None
        return Stop(
            f"early stopping: {self.monitor} has not improved by more than "
            f"{self.best.min_delta} for {self.wait} checks (best {self.best.value} at step "
            f"{self.best.step}, now {value} at step {step})"
        )

    def state_dict(self) -> dict[str, Any]:
        """The best value, the checks waited and the evaluations seen. Attached to a run, it
        is saved with each checkpoint and restored on resume (``checkpoint.contents``)."""
        best = self.best.state_dict()
        return {**self._built(), "best": best, "wait": self.wait, "evaluations": self._evaluations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run keeps its patience;
        ``ConfigError`` for the state of one that watched another value)."""
        errors.same_handler("EarlyStopping", self._built(), state)
        self.best.load_state_dict(state["best"])
        self.wait = int(state["wait"])
        # Absent from a state saved before steplib 0.2.0: as if no evaluation had been seen.
        self._evaluations = int(state.get("evaluations", 0))

    def _built(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.best.mode}


class TimeLimit(Handler):
    """Stop before a wall-clock budget runs out: when the next update would likely cross it.

    The clock starts at ``fit_start`` (or at the first check without one). The estimate of
    the next update's time is the mean time per update so far, measured on the host: no tensor
    is read. The updates are counted from the run's first one, so a resumed run's estimate is
    its own whether this handler is attached before or after ``resume_from``.

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
        self._start_step: int | None = 0

    def on_fit_start(self, event: Event) -> None:
        """Start the clock; the updates are counted from the run's first ``step_end``."""
        # Not from event.step: a fit_start handler after this one may swap in another state
        # (a resume runs first, but a function of the user's may load one), and counting from 0
        # made a resumed run's updates look thousands of times faster than they are.
        self._start, self._start_step = self._clock(), None

    def on_step_end(self, event: Event) -> Stop | None:
        """Check every ``every`` updates."""
        if self._start_step is None:  # the run's first update
            self._start_step = event.step - 1
        return self(event) if due(self.every, event) else None

    def start(self, event: Event) -> None:
        """Start the clock now, counting updates from ``event.step``."""
        self._start, self._start_step = self._clock(), event.step

    def __call__(self, event: Event) -> Stop | None:
        """Stop when the time used plus one more update's worth reaches the budget."""
        if self._start is None:
            self.start(event)
            return None
        used = self._clock() - self._start
        start_step = event.step - 1 if self._start_step is None else self._start_step
        per_update = used / max(event.step - start_step, 1)
        if not any_rank(used + per_update >= self.seconds, device=_device(event)):
            return None
        return Stop(
            f"time limit: {used:.0f} s used of {self.seconds:.0f} s after {event.step} updates; "
            f"one more (about {per_update:.1f} s) would cross the budget"
        )


class StopFile(Handler):
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

    def on_step_end(self, event: Event) -> Stop | None:
        """Check every ``every`` updates."""
        return self(event) if due(self.every, event) else None

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

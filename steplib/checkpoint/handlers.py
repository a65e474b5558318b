"""``Checkpointer``: save a checkpoint every N updates or epochs (and prune old ones), as a
handler. Build it with ``checkpoint_every`` (``every.py``).

With its companions ``resume_from`` (``resume.py``) and ``preemption`` (``preemption.py``)::

    ckpt = checkpoint_every("runs/exp/ckpt", every=500, keep_last=3, step=step)
    events = Events(resume_from(ckpt), evaluator, ckpt, preemption(ckpt))
    state = run(step, state, loader, events=events, max_steps=10_000)

Each save holds, beyond the state, the position of the stateful loader ``run`` draws from and
the state of every handler with ``state_dict`` attached to the same ``Events``
(``checkpoint.attached``); ``resume_from`` restores them.

Imports ``events``, ``state``, ``errors`` and the checkpoint package only (never the loop or
the step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from steplib.cadence import Batches, due
from steplib.checkpoint import storage
from steplib.checkpoint.attached import run_data, with_handlers
from steplib.checkpoint.background import AsyncSaver
from steplib.checkpoint.contents import check_metrics
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.metrics import Metrics, default_metrics, stale_values
from steplib.checkpoint.reports import Reports, committed_info
from steplib.checkpoint.retention import check_ranked_metric, prune
from steplib.checkpoint.saving import save
from steplib.checkpoint.sharded.layout import prunes_here
from steplib.distributed import is_main
from steplib.errors import CheckpointError
from steplib.events import Emitted, Event, Events
from steplib.state import TrainState

_log = logging.getLogger("steplib.checkpoint")


class Checkpointer:
    """Saves a checkpoint every ``every`` updates and/or every ``epochs`` epochs, and prunes
    old ones. Build it with :func:`checkpoint_every`; register it with :meth:`attach` (or as a
    ``step_end`` handler).

    Its arguments are :func:`checkpoint_every`'s, which builds it and validates them (the
    constructor checks nothing).

    Each committed checkpoint (written, fsync'ed when ``durable``, old ones pruned) is
    reported as ``checkpoint_end`` on the ``Events`` it was last attached to, on the training
    thread, with its ``CheckpointInfo`` in ``event.checkpoint`` (see ``checkpoint.reports``).

    Each save holds the position of the stateful loader ``run`` draws from (``data=`` names
    another) and the state of every handler with ``state_dict`` / ``load_state_dict`` attached
    to :attr:`events` (see ``checkpoint.attached``), with the objects named in ``extras``.

    Attributes:
        last_saved: the URL of the last checkpoint this handler saved, or ``None``.
        events: the ``Events`` it reports ``checkpoint_end`` to and whose attached handlers'
            state it saves (``None`` until attached).

    Example:
        >>> from steplib.checkpoint import checkpoint_every
        >>> ckpt = checkpoint_every("memory://doctest-checkpointer/ckpt", every=100)
        >>> ckpt, ckpt.last_saved
        (checkpoint_every('memory://doctest-checkpointer/ckpt', every=100), None)
        >>> events = ckpt.attach(Events())
        >>> [events.has(name) for name in ("fit_start", "step_end", "fit_end", "exception")]
        [True, True, True, True]
    """

    def __init__(
        self,
        directory: str,
        *,
        every: int | Batches | None,
        epochs: int | None = None,
        keep_last: int | None,
        keep_best: int | None,
        metric: str | None,
        mode: str,
        data: Any,
        extras: Mapping[str, Any] | None,
        step: Any,
        metrics: Metrics | None,
        background: bool,
        at_end: bool,
        storage_options: StorageOptions,
        durable: bool = True,
        check_metric: bool = True,
    ) -> None:
        self.directory = directory
        self.every = every
        self.epochs = epochs
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.metric = metric
        self.mode = mode
        self.data = data
        self.extras = extras
        self.step = step
        self.metrics = metrics or default_metrics
        self.at_end = at_end
        self.storage_options = storage_options
        self.durable = durable
        self.check_metric = check_metric
        self._run_data: Any = None  # the stateful loader run() draws from (its fit_start's)
        self._saver = AsyncSaver() if background else None
        self._saved_at: tuple[int, int] | None = None
        self.last_saved: str | None = None
        self.events: Events | None = None
        self._reports = Reports()

    def attach(self, events: Events) -> Events:
        """Register on ``fit_start``, ``step_end`` (saves every ``every`` updates, and reports
        landed background saves), ``epoch_end`` (every ``epochs``), ``fit_end`` and
        ``exception``; ``checkpoint_end`` is emitted on ``events`` from now on.

        Returns:
            ``events``, so calls chain.
        """
        self.events = events
        events.on("fit_start", self.on_fit_start)
        # Last at each event: a save holds what every other handler did there (an evaluation,
        # a scheduler's step), in whatever order they were attached.
        events.on("step_end", self.on_step_end, last=True)
        if self.epochs is not None:
            events.on("epoch_end", self.on_epoch_end, every=self.epochs, last=True)
        events.on("fit_end", self.on_fit_end, last=True)
        events.on("exception", self.on_exception)
        return events

    def __call__(self, event: Event) -> Emitted | None:
        return self.on_step_end(event)

    def on_fit_start(self, event: Event) -> None:
        """Check that the directory can be written, remove what a killed save left in it, and
        remember where the run starts (a resumed state is not saved again at the end) and the
        stateful loader it draws from (``event.data``), whose position each save holds.

        Raises:
            CheckpointError: the directory cannot be created or written.
        """
        self._saved_at = _position(event.state)
        self._run_data = run_data(self.data, event)
        directory = storage.resolve(self.directory, self.storage_options, caller=repr(self))
        storage.check_writable(directory, caller=repr(self))
        if prunes_here(event.state) and (self._saver is None or not self._saver.pending):
            self._remove_leftovers()

    def on_step_end(self, event: Event) -> Emitted | None:
        """Save when ``event.step`` is a multiple of ``every`` (and not saved already); report
        the checkpoints committed since the last event.

        Raises:
            ConfigError: ``keep_best`` ranks by a ``metric`` this save's metrics do not hold.
        """
        if self.every is not None and due(self.every, event):
            return self.on_epoch_end(event)
        return self.report(event)

    def on_epoch_end(self, event: Event) -> Emitted | None:
        """Save unless this state was saved already (every ``epochs`` epochs; raises as
        above), and report."""
        return self._save_and_report(event, strict=True)

    def report(self, event: Event) -> Emitted | None:
        """Emit ``checkpoint_end`` for each checkpoint committed and not yet reported, oldest
        first, on the training thread (its handlers call it; so may a handler of yours that
        calls :meth:`save`).

        Args:
            event: the event being handled (its state is the reports' state).

        Returns:
            The outcome of those emissions, to return from the handler.
        """
        return self._reports.deliver(self.events, event)

    def on_fit_end(self, event: Event) -> Emitted | None:
        """Save the final state (with ``at_end``, if it moved since the last save or the
        start), wait for background writes, and report.

        Raises:
            CheckpointError: a background save failed.
        """
        earlier = self._save_and_report(event, strict=False) if self.at_end else None
        self.wait()
        return self._reports.deliver(self.events, event, earlier=earlier)

    def on_exception(self, event: Event) -> Emitted | None:
        """Let a background write finish (its error is logged, not raised over the first)
        and report what landed."""
        try:
            self.wait()
        except CheckpointError as err:
            _log.error("background checkpoint failed while the run was failing: %s", err)
        return self.report(event)

    def save(self, event: Event, *, blocking: bool = False) -> str:
        """Save ``event.state`` now (unless this position is already saved) and prune.

        Args:
            event: the event whose state to save (its output feeds the metrics).
            blocking: write in this thread even when the checkpointer saves in the background,
                and return once committed (what a preemption save needs).

        A save off the schedule (this one, the one at ``fit_end``, a preemption's) whose
        metrics lack ``metric`` is written but prunes nothing (no evaluation may have run yet);
        a scheduled save refuses it (:meth:`on_step_end`).

        Returns:
            The checkpoint's URL (the existing one if this position was already saved).
        """
        return self._save(event, blocking=blocking, strict=False)

    def _save_and_report(self, event: Event, *, strict: bool) -> Emitted | None:
        earlier = None
        if _position(event.state) != self._saved_at:
            # The save in flight lands and is reported before this one starts, so that its
            # checkpoint_end handlers find it in place (this save's pruning may remove it).
            self.wait()
            earlier = self.report(event)
            self._save(event, blocking=False, strict=strict)
        return self._reports.deliver(self.events, event, earlier=earlier)

    def _save(self, event: Event, *, blocking: bool, strict: bool) -> str:
        state: TrainState = event.state
        if self._saved_at == _position(state) and self.last_saved is not None:
            if blocking:
                self.wait()
            return self.last_saved
        metrics = self.metrics(event)
        # Not evaluated at this update (an earlier evaluation scored another model, or none
        # yet): this save records no score and does not compete for best, but may prune.
        known = not self.check_metric or self.metric in stale_values(state.extras, state.step)
        ranked = self.keep_best is None or self.metric in metrics or known
        if strict and not known:
            check_ranked_metric(
                "checkpoint_every", keep_best=self.keep_best, metric=self.metric, recorded=metrics
            )
        elif not ranked:
            _log.warning(
                "checkpoint_every(metric=%r): not among this checkpoint's metrics (%s); saved "
                "without pruning, so that no best checkpoint is lost",
                self.metric,
                ", ".join(sorted(metrics)) or "none",
            )
        arguments: dict[str, Any] = {
            "data": self.data if self.data is not None else self._run_data,
            "extras": with_handlers("checkpoint_every", self.extras, self.events),
            "step": self.step,
            "metrics": metrics,
            "storage_options": self.storage_options,
            "durable": self.durable,
        }
        # A sharded checkpoint is pruned by rank 0 alone: the ranks share one directory.
        prune = (self._prune if ranked else self._remove_leftovers) if prunes_here(state) else None
        taken = time.time()
        numbers = check_metrics(metrics, "checkpoint_every")

        def committed(url: str) -> None:  # in the writer's thread for a background save
            if prune is not None:
                prune()
            self._reports.add(committed_info(url, state, metrics=numbers, time=taken))

        if self._saver is not None and not blocking:
            url = self._saver.save(state, self.directory, after=committed, **arguments)
        else:
            self.wait()
            url = save(state, self.directory, **arguments)
            committed(url)
        self._saved_at = _position(state)
        self.last_saved = url
        return url

    def wait(self) -> None:
        """Wait for the background save, if any.

        Raises:
            CheckpointError: it failed.
        """
        if self._saver is not None:
            self._saver.wait()

    def _prune(self) -> None:
        prune(
            self.directory,
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            metric=self.metric,
            mode=self.mode,
            storage_options=self.storage_options,
            leftovers=self._leftovers(),
        )

    def _remove_leftovers(self) -> None:
        prune(
            self.directory,
            keep_last=None,
            storage_options=self.storage_options,
            leftovers=self._leftovers(),
        )

    def _leftovers(self) -> str:
        # Called only when this handler has no save in flight (at the start, or after its save
        # committed), so no leftover is one of its own. A save of another rank may still be
        # writing where each rank saves a whole checkpoint: only rank 0 removes the newest.
        return "all" if is_main() else "older"

    def __repr__(self) -> str:
        cadence = (f"{k}={v}" for k, v in (("every", self.every), ("epochs", self.epochs)) if v)
        return f"checkpoint_every({self.directory!r}, {', '.join(cadence)})"


def _position(state: TrainState) -> tuple[int, int]:
    return state.step, state.micro_step

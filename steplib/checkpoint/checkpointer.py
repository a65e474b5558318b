"""``checkpoint_every``: the checkpoint handler (a :class:`Checkpointer`), which saves every N
updates and/or epochs, prunes old checkpoints, and reports each committed one as
``checkpoint_end``.

With its companions ``resume_from`` and ``preemption``::

    ckpt = checkpoint_every("runs/exp/ckpt", every=500, keep_last=3, step=step)
    events = Events(resume_from(ckpt), evaluator, ckpt, preemption(ckpt))
    state = run(step, state, loader, events=events, max_steps=10_000)

Each save holds, beyond the state, the position of the stateful loader ``run`` draws from and
the state of every handler with ``state_dict`` attached to the same ``Events``; ``resume_from``
restores them. The directory, data, extras, step, storage options and durability are given
once (a ``pipeline.Checkpoints``), which ``resume_from(ckpt)`` and ``preemption(ckpt)`` reuse.

A background save commits in the writer's thread; handlers run on the training thread and may
return a ``Stop`` or a ``NewState``, so the writer only queues what it committed and the
checkpointer reports the queue at the next event it handles (a synchronous save at once).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib import errors
from steplib.checkpoint import storage
from steplib.checkpoint.background import AsyncSaver
from steplib.checkpoint.contents import check_metrics, run_data, with_handlers
from steplib.checkpoint.manifest import CheckpointInfo
from steplib.checkpoint.pipeline import Checkpoints, check_durable, prunes_here
from steplib.checkpoint.retention import check_ranked_metric, check_retention, prune
from steplib.checkpoint.storage import StorageOptions
from steplib.distributed import is_main
from steplib.errors import CheckpointError, ConfigError, describe
from steplib.events import Emitted, Event, Events
from steplib.state import EVALUATED_AT, TrainState

_log = logging.getLogger("steplib.checkpoint")
Metrics = Callable[[Event], Mapping[str, Any]]


def default_metrics(event: Event) -> dict[str, float]:
    """What a checkpoint records when no ``metrics`` function is given: the update's ``loss``
    and every number in ``state.extras`` (where an evaluation handler may put ``val_loss``)
    that belongs to this state: a value an evaluation of an earlier update left there (its
    update is in ``extras["evaluated_at"]``) is not this model's score and is left out.

    Args:
        event: the event whose state is saved; its ``output`` (a ``StepOutput``, on
            ``step_end``) gives ``loss``.

    Returns:
        ``{name: float}``: ``"loss"`` when the event carries a step output, and each entry of
        ``state.extras`` that is an int, a float or a one-element tensor (booleans, strings,
        larger tensors and earlier evaluations' values are left out). Reading a tensor is a
        host sync, made at save time only.

    Example:
        >>> import types
        >>> extras = {"val_loss": 0.25, "note": "x", "evaluated_at": {"val_loss": 4}}
        >>> default_metrics(Event("step_end", types.SimpleNamespace(extras=extras), step=4))
        {'val_loss': 0.25}
        >>> default_metrics(Event("step_end", types.SimpleNamespace(extras=extras), step=5))
        {}
    """
    numbers: dict[str, float] = {}
    output = getattr(event, "output", None)
    if output is not None and isinstance(getattr(output, "loss", None), torch.Tensor):
        numbers["loss"] = float(output.loss)  # a host sync, at save time only
    extras = getattr(event.state, "extras", {})
    stale = stale_values(extras, event.step)
    for name, value in extras.items():
        if name in stale:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
    return numbers


def stale_values(extras: Mapping[str, Any], step: int) -> set[str]:
    """The names in ``extras`` that an evaluation of another update than ``step`` put there
    (``extras["evaluated_at"]``, which the ``Evaluator`` writes).

    Example:
        >>> sorted(stale_values({"evaluated_at": {"val_loss": 4, "ood_loss": 6}}, 6))
        ['val_loss']
    """
    evaluated = extras.get(EVALUATED_AT, {})
    return {name for name, at in evaluated.items() if at != step}


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
        given: Checkpoints,
        *,
        every: int | None,
        epochs: int | None = None,
        keep_last: int | None,
        keep_best: int | None,
        metric: str | None,
        mode: str,
        metrics: Metrics | None,
        background: bool,
        at_end: bool,
        check_metric: bool = True,
    ) -> None:
        self.given = given
        self.every, self.epochs, self.at_end = every, epochs, at_end
        self.keep_last, self.keep_best, self.metric, self.mode = keep_last, keep_best, metric, mode
        self.metrics = metrics or default_metrics
        self.check_metric = check_metric
        self._run_data: Any = None  # the stateful loader run() draws from (its fit_start's)
        self._saver = AsyncSaver() if background else None
        self._saved_at: tuple[int, int] | None = None
        self.last_saved: str | None = None
        self.events: Events | None = None
        # Committed, not yet reported (appended by the writer thread: a deque's ends are atomic).
        self._committed: collections.deque[CheckpointInfo] = collections.deque()

    @property
    def directory(self) -> str:
        return self.given.directory

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
        self._run_data = run_data(self.given.data, event)
        directory = storage.resolve(self.directory, self.given.storage_options, caller=repr(self))
        storage.check_writable(directory, caller=repr(self))
        if prunes_here(event.state) and (self._saver is None or not self._saver.pending):
            self._remove_leftovers()

    def on_step_end(self, event: Event) -> Emitted | None:
        """Save when ``event.step`` is a multiple of ``every`` (and not saved already); report
        the checkpoints committed since the last event.

        Raises:
            ConfigError: ``keep_best`` ranks by a ``metric`` this save's metrics do not hold.
        """
        if self.every is not None and event.step % self.every == 0:
            return self.on_epoch_end(event)
        return self.report(event)

    def on_epoch_end(self, event: Event) -> Emitted | None:
        """Save unless this state was saved already (every ``epochs`` epochs; raises as
        above), and report."""
        return self._save_and_report(event, strict=True)

    def report(self, event: Event, *, earlier: Emitted | None = None) -> Emitted | None:
        """Emit ``checkpoint_end`` for each checkpoint committed and not yet reported, oldest
        first, on the training thread (its handlers call it; so may a handler of yours that
        calls :meth:`save`); each emission sees the state the previous one left.

        Args:
            event: the event being handled (its state is the reports' state).
            earlier: the outcome of an earlier report at this event, to go on from.

        Returns:
            The outcome of those emissions, to return from the handler.
        """
        if self.events is None:  # never attached: nobody to tell
            self._committed.clear()
        if not self._committed:
            return earlier
        state, stop = (event.state, None) if earlier is None else (earlier.state, earlier.stop)
        while self._committed:
            info = self._committed.popleft()
            assert self.events is not None
            emitted = self.events.emit(Event.at("checkpoint_end", state, checkpoint=info))
            state, stop = emitted.state, stop or emitted.stop
        return Emitted(state, stop)

    def on_fit_end(self, event: Event) -> Emitted | None:
        """Save the final state (with ``at_end``, if it moved since the last save or the
        start), wait for background writes, and report.

        Raises:
            CheckpointError: a background save failed.
        """
        earlier = self._save_and_report(event, strict=False) if self.at_end else None
        self.wait()
        return self.report(event, earlier=earlier)

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
        return self.report(event, earlier=earlier)

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
        given = dataclasses.replace(
            self.given,
            data=self.given.data if self.given.data is not None else self._run_data,
            extras=with_handlers("checkpoint_every", self.given.extras, self.events),
        )
        # A sharded checkpoint is pruned by rank 0 alone: the ranks share one directory.
        prune = (self._prune if ranked else self._remove_leftovers) if prunes_here(state) else None
        taken = time.time()
        numbers = check_metrics(metrics, "checkpoint_every")

        def committed(url: str) -> None:  # in the writer's thread for a background save
            if prune is not None:
                prune()
            name = url.rstrip("/").rsplit("/", 1)[-1]
            at = (state.step, state.micro_step, state.epoch)
            self._committed.append(CheckpointInfo(url, name, *at, taken, dict(numbers)))

        if self._saver is not None and not blocking:
            url = self._saver.submit(given, state, metrics=metrics, after=committed)
        else:
            self.wait()
            url = given.save(state, metrics=metrics)
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
            storage_options=self.given.storage_options,
            leftovers=self._leftovers(),
        )

    def _remove_leftovers(self) -> None:
        prune(
            self.directory,
            keep_last=None,
            storage_options=self.given.storage_options,
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


def checkpoint_every(
    directory: str,
    *,
    every: int | None = None,
    epochs: int | None = None,
    at_epoch_end: bool = False,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: Any = None,
    mode: str | None = None,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    metrics: Metrics | None = None,
    background: bool = False,
    at_end: bool = True,
    storage_options: StorageOptions = None,
    durable: bool = True,
) -> Checkpointer:
    """A handler that saves a checkpoint every ``every`` optimizer updates and/or at the end of
    every ``epochs``-th epoch.

    Each committed checkpoint is reported to the handlers of ``checkpoint_end``, with its
    ``CheckpointInfo`` in ``event.checkpoint`` (see :class:`Checkpointer` for when).

    Args:
        directory: a local path or fsspec URL of the directory of checkpoints.
        every: save when ``state.step`` is a multiple of this (an int >= 1), or ``None``.
        epochs: save at the end of an epoch when ``state.epoch`` (completed epochs) is a
            multiple of this (an int >= 1), or ``None``. With ``every`` too, both cadences
            save (an update saved by one is not saved again by the other).
        at_epoch_end: ``True`` is ``epochs=1``: save at the end of every epoch.
        keep_last: after each save keep the newest this many (``None``: keep all).
        keep_best: also keep the best this many by ``metric``.
        metric: the metric ``keep_best`` ranks by (one of those ``metrics`` returns), or the
            ``Evaluator`` that monitors it (its name and mode); every save checks that it is
            there, before anything is written or pruned.
        mode: ``"min"`` (default) or ``"max"``: whether lower or higher ``metric`` is better.
        data: the loader whose position to save (see ``steplib.data.resumable_loader``).
        extras: more objects with ``state_dict()`` to save by name.
        step: the Step; its composition is saved and checked on resume.
        metrics: ``event -> {name: number}`` recorded with each checkpoint; by default the
            update's ``loss`` and the numbers in ``state.extras`` (:func:`default_metrics`).
        background: write in a background thread (:class:`AsyncSaver`); training waits only
            for the copy of buffers and small states to CPU memory (the parameters and
            optimizer state are copied while the next forward and backward run). Errors
            surface at the next save or at ``fit_end``.
        at_end: also save at ``fit_end`` if the state changed since the last save.
        storage_options: passed to fsspec.
        durable: fsync each checkpoint before it counts as saved (see ``save``); ``False`` is
            faster, and a power loss soon after a save may lose that newest checkpoint.

    When the run starts (``fit_start``), the handler checks that ``directory`` can be
    written and removes what a killed save left there (``.tmp-*`` staging directories,
    uncommitted checkpoints; rank 0 alone on several ranks); each save removes them too.

    Returns:
        A :class:`Checkpointer`; call ``.attach(events)``.

    Raises:
        ConfigError: ``every`` is not an int >= 1, ``durable`` not a bool, or invalid
            retention settings; at a scheduled save (the first at the latest, before anything
            is written or pruned), a ``metric`` that the checkpoint's metrics do not hold (the
            message lists those they hold).
        CheckpointError: at ``fit_start``, ``directory`` cannot be created or written.

    Example:
        >>> import torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.checkpoint import list_checkpoints
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> events = checkpoint_every("memory://doctest-every/ckpt", every=2, keep_last=2,
        ...                           step=step).attach(Events())
        >>> state = run(step, state, [torch.ones(4, 2)] * 5, events=events)
        >>> [c.step for c in list_checkpoints("memory://doctest-every/ckpt")]
        [4, 5]
    """
    epochs = check_cadence(every, epochs, at_epoch_end)
    # A name typed by hand may be misspelt: a scheduled save refuses it when it is missing. An
    # evaluator's own name is not, and is missing only before its first evaluation.
    typed = isinstance(metric, str)
    if metric is not None:
        metric, mode = errors.monitor_and_mode("checkpoint_every", metric, mode)
    mode = mode or "min"
    check_retention(
        "checkpoint_every", keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode
    )
    check_durable(durable, "checkpoint_every")
    given = Checkpoints(directory, data, extras, step, storage_options, durable)
    return Checkpointer(
        given,
        every=every,
        epochs=epochs,
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        mode=mode,
        metrics=metrics,
        background=background,
        at_end=at_end,
        check_metric=typed,
    )


def check_cadence(every: Any, epochs: Any, at_epoch_end: Any) -> int | None:
    """The epoch cadence of ``checkpoint_every``: ``epochs``, or 1 for ``at_epoch_end=True``.

    Args:
        every: the update cadence (``None`` or an int >= 1).
        epochs: the epoch cadence (``None`` or an int >= 1).
        at_epoch_end: ``True`` is ``epochs=1``.

    Returns:
        The epoch cadence, or ``None`` for none.

    Raises:
        ConfigError: no cadence, a cadence that is not an int >= 1, ``at_epoch_end`` not a
            bool, or both ``at_epoch_end=True`` and ``epochs``.

    Example:
        >>> check_cadence(None, None, True), check_cadence(500, 2, False)
        (1, 2)
    """
    if at_epoch_end is not False and at_epoch_end is not True:
        raise ConfigError(
            f"checkpoint_every(at_epoch_end=...) received {describe(at_epoch_end)}; pass True "
            "(save at every epoch end) or False, or epochs=N for every N epochs."
        )
    if at_epoch_end and epochs is not None:
        raise ConfigError(
            f"checkpoint_every received at_epoch_end=True (every epoch) and epochs={epochs!r} "
            "(every that many epochs), which contradict each other. Pass one: epochs=1 is "
            "at_epoch_end=True."
        )
    if at_epoch_end:
        epochs = 1
    if every is None and epochs is None:
        raise ConfigError(
            "checkpoint_every received no cadence (every=None), so it would never save. Pass "
            "every=500 (optimizer updates between checkpoints), epochs=1 (every epoch end; "
            "at_epoch_end=True is the same), or both."
        )
    for label, value in (("every", every), ("epochs", epochs)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            unit = "optimizer updates" if label == "every" else "epochs"
            example = 500 if label == "every" else 2
            raise ConfigError(
                f"checkpoint_every({label}=...) received {describe(value)}; it is the number "
                f"of {unit} between checkpoints and must be an int >= 1, e.g. "
                f"{label}={example}."
            )
    return epochs

"""``checkpoint_every``: save a checkpoint every N updates (and prune old ones), as a handler.

With its companions ``resume_from`` (``resume.py``) and ``preemption`` (``preemption.py``)::

    ckpt = checkpoint_every("runs/exp/ckpt", every=500, keep_last=3, data=loader, step=step)
    events.on("fit_start", resume_from("runs/exp/ckpt", data=loader, step=step))
    ckpt.attach(events)
    preemption(ckpt).attach(events)   # SIGTERM / SIGUSR1: save at the next update, then stop
    state = run(step, state, loader, events=events, max_steps=10_000)

Imports ``events``, ``state``, ``errors`` and the checkpoint package only (never the loop or
the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib import errors
from steplib.checkpoint import storage
from steplib.checkpoint.background import AsyncSaver
from steplib.checkpoint.errors import CheckpointError
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.retention import check_ranked_metric, check_retention, prune
from steplib.checkpoint.saving import check_durable, save
from steplib.checkpoint.sharded.layout import prunes_here
from steplib.distributed import is_main
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events
from steplib.state import TrainState

_log = logging.getLogger("steplib.checkpoint")

Metrics = Callable[[Event], Mapping[str, Any]]


def default_metrics(event: Event) -> dict[str, float]:
    """What a checkpoint records when no ``metrics`` function is given: the update's ``loss``
    and every number in ``state.extras`` (where an evaluation handler may put ``val_loss``).

    Args:
        event: the event whose state is saved; its ``output`` (a ``StepOutput``, on
            ``step_end``) gives ``loss``.

    Returns:
        ``{name: float}``: ``"loss"`` when the event carries a step output, and each entry of
        ``state.extras`` that is an int, a float or a one-element tensor (booleans, strings
        and larger tensors are left out). Reading a tensor is a host sync, made at save time
        only.

    Example:
        >>> import types
        >>> state = types.SimpleNamespace(extras={"val_loss": 0.25, "note": "x"})
        >>> default_metrics(Event("step_end", state=state))
        {'val_loss': 0.25}
    """
    numbers: dict[str, float] = {}
    output = getattr(event, "output", None)
    if output is not None and isinstance(getattr(output, "loss", None), torch.Tensor):
        numbers["loss"] = float(output.loss)  # a host sync, at save time only
    for name, value in getattr(event.state, "extras", {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
    return numbers


class Checkpointer:
    """Saves a checkpoint every ``every`` updates and/or at each epoch's end, and prunes old
    ones. Build it with :func:`checkpoint_every`; register it with :meth:`attach` (or as a
    ``step_end`` handler).

    Its arguments are :func:`checkpoint_every`'s, which builds it and validates them (the
    constructor checks nothing).

    Attributes:
        last_saved: the URL of the last checkpoint this handler saved, or ``None``.

    Example:
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
        every: int | None,
        at_epoch_end: bool = False,
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
    ) -> None:
        self.directory = directory
        self.every = every
        self.at_epoch_end = at_epoch_end
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
        self._saver = AsyncSaver() if background else None
        self._saved_at: tuple[int, int] | None = None
        self.last_saved: str | None = None

    def attach(self, events: Events) -> Events:
        """Register on ``fit_start``, ``step_end`` and/or ``epoch_end``, ``fit_end`` and
        ``exception``.

        Returns:
            ``events``, so calls chain.
        """
        events.on("fit_start", self.on_fit_start)
        if self.every is not None:
            events.on("step_end", self.on_step_end)
        if self.at_epoch_end:
            events.on("epoch_end", self.on_epoch_end)
        events.on("fit_end", self.on_fit_end)
        events.on("exception", self.on_exception)
        return events

    def __call__(self, event: Event) -> None:
        self.on_step_end(event)

    def on_fit_start(self, event: Event) -> None:
        """Check that the directory can be written, remove what a killed save left in it, and
        remember where the run starts (a resumed state is not saved again at the end).

        Raises:
            CheckpointError: the directory cannot be created or written.
        """
        self._saved_at = _position(event.state)
        directory = storage.resolve(self.directory, self.storage_options, caller=repr(self))
        storage.check_writable(directory, caller=repr(self))
        if prunes_here(event.state) and (self._saver is None or not self._saver.pending):
            self._remove_leftovers()

    def on_step_end(self, event: Event) -> None:
        """Save when ``event.step`` is a multiple of ``every`` (and not saved already).

        Raises:
            ConfigError: ``keep_best`` ranks by a ``metric`` this save's metrics do not hold.
        """
        if self.every is not None and event.step % self.every == 0:
            self.on_epoch_end(event)

    def on_epoch_end(self, event: Event) -> None:
        """Save unless this state was saved already (``at_epoch_end``; raises as above)."""
        if _position(event.state) != self._saved_at:
            self._save(event, blocking=False, strict=True)

    def on_fit_end(self, event: Event) -> None:
        """Save the final state (with ``at_end``, if it moved since the last save or the
        start) and wait for background writes.

        Raises:
            CheckpointError: a background save failed.
        """
        if self.at_end and _position(event.state) != self._saved_at:
            self.save(event)
        self.wait()

    def on_exception(self, event: Event) -> None:
        """Let a background write finish; its error is logged, not raised over the first."""
        try:
            self.wait()
        except CheckpointError as err:
            _log.error("background checkpoint failed while the run was failing: %s", err)

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

    def _save(self, event: Event, *, blocking: bool, strict: bool) -> str:
        state: TrainState = event.state
        if self._saved_at == _position(state) and self.last_saved is not None:
            if blocking:
                self.wait()
            return self.last_saved
        metrics = self.metrics(event)
        ranked = self.keep_best is None or self.metric in metrics
        if strict:
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
            "data": self.data,
            "extras": self.extras,
            "step": self.step,
            "metrics": metrics,
            "storage_options": self.storage_options,
            "durable": self.durable,
        }
        # A sharded checkpoint is pruned by rank 0 alone: the ranks share one directory.
        prune = (self._prune if ranked else self._remove_leftovers) if prunes_here(state) else None
        if self._saver is not None and not blocking:
            url = self._saver.save(state, self.directory, after=prune, **arguments)
        else:
            self.wait()
            url = save(state, self.directory, **arguments)
            if prune is not None:
                prune()
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
        return f"checkpoint_every({self.directory!r}, every={self.every})"


def checkpoint_every(
    directory: str,
    *,
    every: int | None = None,
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
    every epoch.

    Args:
        directory: a local path or fsspec URL of the directory of checkpoints.
        every: save when ``state.step`` is a multiple of this (an int >= 1), or ``None``.
        at_epoch_end: save at the end of every epoch (at least one of the two).
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
    if (every is None and not at_epoch_end) or (
        every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1)
    ):
        raise ConfigError(
            f"checkpoint_every(every=...) received {describe(every)}; it is the number of "
            "optimizer updates between checkpoints and must be an int >= 1, e.g. every=500 "
            "(or at_epoch_end=True)."
        )
    if metric is not None:
        metric, mode = errors.monitor_and_mode("checkpoint_every", metric, mode)
    mode = mode or "min"
    check_retention(
        "checkpoint_every", keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode
    )
    check_durable(durable, "checkpoint_every")
    return Checkpointer(
        directory,
        every=every,
        at_epoch_end=at_epoch_end,
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        mode=mode,
        data=data,
        extras=extras,
        step=step,
        metrics=metrics,
        background=background,
        at_end=at_end,
        storage_options=storage_options,
        durable=durable,
    )


def _position(state: TrainState) -> tuple[int, int]:
    return state.step, state.micro_step

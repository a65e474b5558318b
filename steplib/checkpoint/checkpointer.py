"""``checkpoint_every``: saves every N updates and/or epochs with the loader's position and the
attached handlers' state, prunes, and reports each commit as ``checkpoint_end``."""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from steplib import errors
from steplib.cadence import Batches, check_every, due
from steplib.checkpoint import storage
from steplib.checkpoint.background import AsyncSaver
from steplib.checkpoint.contents import (
    as_number,
    check_metric_states,
    check_metrics,
    is_sharded,
    prunes_here,
    settle_schedulers,
    with_handlers,
)
from steplib.checkpoint.manifest import (
    CheckpointInfo,
    checkpoint_key,
    checkpoint_name,
    scan,
    sort_key,
)
from steplib.checkpoint.pipeline import Checkpoints, GlooGroup, check_options
from steplib.checkpoint.retention import check_retention, prune
from steplib.checkpoint.storage import Location, StorageOptions
from steplib.data.epoch_end import at_epoch_end
from steplib.distributed import is_main, world_size
from steplib.errors import CheckpointError, CheckpointWarning, ConfigError, listed
from steplib.events import Emitted, Event, Handler
from steplib.output import update_outputs
from steplib.state import EVALUATED_AT, TrainState

_log = logging.getLogger("steplib.checkpoint")
Metrics = Callable[[Event], Mapping[str, Any]]


def default_metrics(event: Event) -> dict[str, float]:
    """What a checkpoint records without ``metrics``: the update's ``loss`` (of several steps,
    each one's whose window closed here, ``D/loss``, as the logs name them) and each number in
    ``state.extras`` evaluated at this update."""
    outputs = update_outputs(event)
    losses = {f"{n}/loss" if n else "loss": getattr(o, "loss", None) for n, o in outputs.items()}
    extras = getattr(event.state, "extras", {})
    stale = stale_values(extras, event.step)
    fresh = {k: v for k, v in extras.items() if k not in stale}
    numbers = {name: as_number(value) for name, value in {**losses, **fresh}.items()}
    return {name: number for name, number in numbers.items() if number is not None}


def stale_values(extras: Mapping[str, Any], step: int) -> set[str]:
    """The names in ``extras`` that an evaluation of another update than ``step`` put there."""
    evaluated = extras.get(EVALUATED_AT, {})
    return {name for name, at in evaluated.items() if at != step}


@dataclasses.dataclass(eq=False, repr=False)
class Checkpointer(Handler):
    """The handler :func:`checkpoint_every` builds; ``last_saved``: its last checkpoint's URL.
    It saves the handlers of, and reports ``checkpoint_end`` to, the ``Events`` that emitted."""

    # Last at each event: a save holds what every other handler did there, whatever the order.
    last = True

    given: Checkpoints
    every: int | Batches | None
    epochs: int | None
    keep_last: int | None
    keep_best: int | None
    metric: str | None
    mode: str
    metrics: Metrics
    background: dataclasses.InitVar[bool]
    at_end: bool
    check_metric: bool  # a typed name, which may be misspelt (an evaluator's is not)
    last_saved: str | None = dataclasses.field(default=None, init=False)

    def __post_init__(self, background: bool) -> None:
        self._run = self.given  # with the loader and step(s) of run's fit_start
        self._saver = AsyncSaver() if background else None
        self._saved_at: tuple[int, int] | None = None
        self._update: Event | None = None  # the last step_end: its metrics are a save's there
        self._deferred = False  # a save due at an epoch's last update, made at its epoch_end
        self._committed: collections.deque[CheckpointInfo] = collections.deque()  # unreported
        self._group = GlooGroup()  # made on first use, by every rank
        self._typed = self.check_metric  # and no evaluator of the run monitors that name

    @property
    def directory(self) -> str:
        return self.given.directory

    def on_fit_start(self, event: Event) -> None:
        """Check the directory is writable (``CheckpointError``) and, where each rank saves its
        own state, this rank's alone (``ConfigError``); remove a killed save's debris; warn of
        newer checkpoints there."""
        self._saved_at, owner = _position(event.state), repr(self)
        self._run = self.given.for_run(event)
        directory = storage.resolve(self.directory, self.given.storage_options, caller=owner)
        storage.check_writable(directory, caller=owner)
        settle_schedulers(self._run.step, event.state, owner)  # a refusal before training
        if self.keep_best is not None and self.check_metric:  # a typed name, a default mode
            fix = "Pass metric=evaluator (its name and mode), or the evaluator's mode=..."
            self._typed = not errors.same_mode(
                owner, str(self.metric), self.mode, event.events, fix=fix
            )
        if world_size() > 1 and not is_sharded(event.state):  # pipeline stages, say
            self._check_apart(directory)
        if prunes_here(event.state):
            if self._saver is None or not self._saver.pending:
                self._prune(keep=self._continues(directory, event.state))
            _warn_newer(repr(self), directory, event.state)

    def on_step_end(self, event: Event) -> Emitted:
        self._update = event
        if self.every is not None and due(self.every, event):
            self._deferred = self.ends_epoch(event)
            if not self._deferred:
                return self._save_and_report(event, strict=True)
        return self.report(event)

    __call__ = on_step_end

    def on_epoch_end(self, event: Event) -> Emitted | None:
        deferred, self._deferred = self._deferred, False
        if deferred or (self.epochs is not None and due(self.epochs, event)):
            return self._save_and_report(event, strict=True)
        return None

    def ends_epoch(self, event: Event) -> bool:
        """Whether ``event`` is the update on its epoch's last batch. Saves due then wait for
        ``epoch_end``: before its handlers ran (a scheduler, an evaluation), a resume skips them."""
        return event.closes_epoch or (self._run.data is not None and at_epoch_end(self._run.data))

    def report(self, event: Event, *, earlier: Emitted | None = None) -> Emitted:
        """Emit ``checkpoint_end`` for each unreported commit, oldest first, after ``earlier``."""
        emitted = earlier or Emitted(event.state, None)
        while self._committed:
            info = self._committed.popleft()
            if event.events is not None:  # else not emitted by an Events: nobody to tell
                now = event.events.emit(Event.at("checkpoint_end", emitted.state, checkpoint=info))
                emitted = Emitted(now.state, emitted.stop or now.stop)
        return emitted

    def on_fit_end(self, event: Event) -> Emitted:
        """Save the final state (``at_end``, if it moved); wait for background writes; report."""
        earlier = self._save_and_report(event, strict=False) if self.at_end else None
        self.wait()
        self._forget_run()
        return self.report(event, earlier=earlier)

    def on_exception(self, event: Event) -> Emitted:
        """Let a background write finish (its error logged, not raised over the run's)."""
        try:
            self.wait()
        except CheckpointError as err:
            _log.error("background checkpoint failed while the run was failing: %s", err)
        self._forget_run()
        return self.report(event)

    def _forget_run(self) -> None:
        # The ended run's state (its DDP model, its process group) is the user's to free: kept
        # here, it outlived `del state` and shutdown(), and its gloo threads could abort the exit.
        self._update, self._run = None, self.given

    def _save_and_report(self, event: Event, *, strict: bool) -> Emitted:
        if _position(event.state) == self._saved_at:
            return self.report(event)
        self.wait()  # the save in flight is reported before this one's pruning may remove it
        earlier = self.report(event)
        self.save(event, strict=strict)
        return self.report(event, earlier=earlier)

    def save(self, event: Event, *, blocking: bool = False, strict: bool = False) -> str:
        """Save ``event.state`` (unless saved) and prune; return the URL. ``blocking``: committed
        on return (a preemption's); ``strict``: a scheduled save (``metric`` checked)."""
        state: TrainState = event.state
        if self._saved_at == _position(state) and self.last_saved is not None:
            if blocking:
                self.wait()
            return self.last_saved
        numbers = check_metrics(self.metrics(event), "checkpoint_every")
        update = self._update  # at an epoch_end or fit_end: its last update's loss too
        if update and update is not event and _position(update.state) == _position(state):
            numbers = {**check_metrics(self.metrics(update), "checkpoint_every"), **numbers}
        ranked = self._ranks(state, numbers)
        if not ranked:
            head = f"checkpoint_every(keep_best={self.keep_best}, metric={self.metric!r})"
            value = state.extras.get(str(self.metric))
            if isinstance(value, list | tuple):  # not "no such name": it is there, N of it
                found = (
                    f"{head}: {self.metric!r} is a list of {len(value)} (a sweep's, one per copy): "
                    "no one value ranks a checkpoint of every copy."
                )
                fix = (
                    "Keep checkpoints by keep_last alone; choose copies by their values "
                    "(SweepEarlyStopping, SuccessiveHalving, evaluator.history)."
                )
            else:
                recorded = ", ".join(sorted(numbers)) or "none"
                found = f"{head} found no {self.metric!r} in the metrics; they are: {recorded}."
                fix = (
                    "Name one (an evaluator's carry its prefix: 'val_accuracy'), pass "
                    "metric=evaluator, or metrics= a function that returns it."
                )
            if strict:  # a scheduled save: refused before anything is written or pruned
                raise ConfigError(f"{found} Nothing was saved or pruned. {fix}")
            # At fit end or a preemption, perhaps before any evaluation: saved, not refused.
            _log.warning("%s It was saved without pruning, so that no best one is lost.", found)
        extras = with_handlers("checkpoint_every", self.given.extras, event.events)
        given = dataclasses.replace(self._run, extras=extras)
        here, taken = prunes_here(state), time.time()

        def committed(url: str) -> None:  # in the writer's thread for a background save
            if here:
                self._prune(keep=ranked)
            name = url.rstrip("/").rsplit("/", 1)[-1]
            at = (state.step, state.micro_step, state.epoch)
            self._committed.append(CheckpointInfo(url, name, *at, taken, numbers))

        if self._saver is not None and not blocking:
            url = self._saver.submit(given, state, metrics=numbers, after=committed)
        else:
            self.wait()
            url = given.save(state, metrics=numbers)
            committed(url)
        self._saved_at, self.last_saved = _position(state), url
        return url

    def _ranks(self, state: TrainState, numbers: Mapping[str, Any]) -> bool:
        # Evaluated at another update: no score, no candidate for best, but it prunes.
        known = not self._typed or self.metric in stale_values(state.extras, state.step)
        return self.keep_best is None or self.metric in numbers or known

    def _continues(self, directory: Location, state: TrainState) -> bool:
        # Resumed from the newest checkpoint here, whose save a kill may have ended between its
        # commit and its prune: that prune is made now (if it ranks), else the older ones stay.
        newest = scan(directory)[0][-1:]
        return any(
            c.name == checkpoint_name(state) and self._ranks(state, c.metrics) for c in newest
        )

    def wait(self) -> None:
        """Wait for the background save, if any (``CheckpointError`` if it failed)."""
        if self._saver is not None:
            self._saver.wait()

    def _check_apart(self, directory: Location) -> None:
        # The same path on two nodes' own disks is two directories.
        host = socket.gethostname() if directory.is_local else ""
        places: list[Any] = [None] * world_size()
        where = (host, directory.fs.unstrip_protocol(directory.path))
        dist.all_gather_object(places, where, group=self._group.get())
        if shared := [str(rank) for rank, place in enumerate(places) if places.count(place) > 1]:
            ranks = f"{', '.join(shared[:-1])} and {shared[-1]}"
            raise ConfigError(
                f"checkpoint_every: ranks {ranks} save their own states into {self.directory!r} "
                "(not sharded): the last commit would win, and a resume load its model, RNG and "
                "data position into every rank. Give each rank its own directory (a pipeline stage"
                ": f'runs/ckpt/stage-{stage.stage_index}'), or shard it (apply_ddp, apply_fsdp)."
            )

    def _prune(self, keep: bool = True) -> None:
        # No save of this handler in flight; only rank 0 removes the newest leftovers.
        prune(
            self.directory,
            keep_last=self.keep_last if keep else None,
            keep_best=self.keep_best if keep else None,
            metric=self.metric,
            mode=self.mode,
            storage_options=self.given.storage_options,
            leftovers="all" if is_main() else "older",
        )

    def __repr__(self) -> str:
        cadence = (f"{k}={v}" for k, v in (("every", self.every), ("epochs", self.epochs)) if v)
        return f"checkpoint_every({self.directory!r}, {', '.join(cadence)})"


def _warn_newer(owner: str, directory: Location, state: TrainState) -> None:
    # Until the run passes them they are the newest: kept by keep_last over the run's own
    # (deleted as they are written) and loaded by a resume.
    here = checkpoint_key(state)
    if not any((sort_key(name) or here) > here for name in storage.list_names(directory)):
        return  # the usual case, from one listing: the manifests were read by prune already
    names = [c.name for c in scan(directory)[0]]
    newer = [name for name in names if (sort_key(name) or here) > here]
    if newer and checkpoint_name(state) not in names:  # the state was not loaded from here
        warnings.warn(
            f"{owner}: the directory holds checkpoints newer than this run's state (at update "
            f"{state.step}): {listed(newer)}, of another run or a rewound one: keep_last keeps "
            "them over this run's, and resume_from loads them. To continue that run, attach "
            "resume_from(ckpt); to start over, use an empty directory; to rewind, remove them.",
            CheckpointWarning,
            stacklevel=3,
        )


def _position(state: TrainState) -> tuple[int, int]:
    return state.step, state.micro_step


def checkpoint_every(
    directory: str,
    *,
    every: int | Batches | None = None,
    epochs: int | None = None,
    at_epoch_end: bool = False,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: Any = None,
    mode: str | None = None,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    metrics: Metrics | None = None,
    background: bool = False,
    at_end: bool = True,
    storage_options: StorageOptions = None,
    durable: bool = True,
    trainable_only: bool = False,
) -> Checkpointer:
    """A handler that saves every ``every`` updates and/or ``epochs`` epochs and reports each
    commit as ``checkpoint_end`` (its ``CheckpointInfo`` in ``event.checkpoint``).

    Args:
        directory: a local path or fsspec URL of the directory of checkpoints.
        every: save when ``state.step`` is a multiple of this int, at the update holding every
            n-th batch with ``Batches(n)``, or ``None``.
        epochs: save at the end of every this-many epochs (with ``every``, both save).
        at_epoch_end: ``True`` is ``epochs=1``.
        keep_last, keep_best: after each save keep the newest ``keep_last`` and the best
            ``keep_best`` by ``metric`` (``None``: all).
        metric: what ``keep_best`` ranks by: a metric's name, or the ``Evaluator`` monitoring it.
        mode: ``"min"`` (default) or ``"max"``: whether lower or higher ``metric`` is better.
        data, extras, storage_options, durable, trainable_only: as for ``save``. The stateful
            loader ``run`` draws from, the step(s) it calls and the attached handlers are saved
            without being named (``data`` names another loader).
        metrics: ``event -> {name: number}`` recorded with each save (:func:`default_metrics`).
        background: write in a background thread (:class:`AsyncSaver`); errors surface later.
        at_end: also save at ``fit_end`` if the state changed since the last save.

    Returns:
        A :class:`Checkpointer`; call ``.attach(events)``.

    Raises:
        ConfigError: a bad cadence, ``durable`` or retention setting; at a scheduled save
            (before anything is written or pruned), a ``metric`` its metrics do not hold.

    Example:
        >>> import torch
        >>> from steplib import make_train_step, run
        >>> from steplib.checkpoint import list_checkpoints
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> ckpt = checkpoint_every("memory://doctest-every/ckpt", every=2, keep_last=2)
        >>> _ = run(step, state, [torch.ones(4, 2)] * 5, events=[ckpt])
        >>> [c.step for c in list_checkpoints("memory://doctest-every/ckpt")]
        [4, 5]
    """
    caller = "checkpoint_every"
    choices = "True (save at every epoch end) or False, or epochs=N for every N epochs"
    errors.boolean(caller, "at_epoch_end", at_epoch_end, choices)
    if at_epoch_end and epochs is not None:
        raise ConfigError(
            f"checkpoint_every received at_epoch_end=True and epochs={epochs!r}, which "
            "contradict each other. Pass one: epochs=1 is at_epoch_end=True."
        )
    epochs = 1 if at_epoch_end else epochs
    if every is None and epochs is None:
        raise ConfigError(
            "checkpoint_every received no cadence (every=None), so it would never save. Pass "
            "every=500 (optimizer updates), epochs=1 or at_epoch_end=True (epoch ends), or both."
        )
    check_every(f"{caller}(every=...)", every)
    epochs = errors.optional_positive_int(caller, "epochs", epochs)
    typed = isinstance(metric, str)
    if metric is not None:
        metric, mode = errors.monitor_and_mode(caller, metric, mode)
    mode = mode or "min"
    check_retention(caller, keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode)
    given = Checkpoints(directory, data, extras, None, storage_options, durable, trainable_only)
    check_options(given, caller)
    if isinstance(extras, Mapping):  # refused when built, not at the first save
        check_metric_states(caller, extras)
    settings = (every, epochs, keep_last, keep_best, metric, mode, metrics or default_metrics)
    return Checkpointer(given, *settings, background, at_end, typed)

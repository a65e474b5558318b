"""How a run continues: ``resume_from`` loads the newest valid checkpoint at ``fit_start``;
``preemption`` turns SIGTERM / SIGUSR1 into a checkpoint and a clean stop."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import warnings
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from steplib.checkpoint.checkpointer import Checkpointer
from steplib.checkpoint.contents import is_sharded, with_handlers
from steplib.checkpoint.pipeline import Checkpoints, GlooGroup
from steplib.checkpoint.storage import StorageOptions
from steplib.distributed import world_size
from steplib.distributed.collectives import max_over_ranks
from steplib.errors import CheckpointWarning, ConfigError, describe
from steplib.events import Emitted, Event, Handler, NewState, Stop

_log = logging.getLogger("steplib.checkpoint")


class Resume(Handler):
    """The ``fit_start`` handler :func:`resume_from` builds; ``loaded``: the URL it loaded."""

    # Before every other handler, wherever attached: each starts from the resumed state and
    # its own resumed state (an early stopper that had stopped stops at once).
    first = True

    def __init__(self, given: Checkpoints) -> None:
        self.given = given
        self.loaded: str | None = None
        self._group = GlooGroup()  # ranks saving apart (pipeline stages) agree on the newest

    @property
    def directory(self) -> str:
        return self.given.directory

    def on_fit_start(self, event: Event) -> NewState | None:
        """Load the newest valid checkpoint into the state, its loader and its handlers."""
        extras = with_handlers("resume_from", self.given.extras, event.events)
        given = dataclasses.replace(self.given.for_run(event), extras=extras)
        apart = world_size() > 1 and not is_sharded(event.state)
        found = given.load_newest(event.state, group=self._group.get() if apart else None)
        if found is None:
            _log.info("no checkpoint in %s: starting fresh", self.directory)
            return None
        self.loaded, state = found
        _log.info("resumed from %s at step %d", self.loaded, state.step)
        if given.data is None and event.data is not None:  # batches without a saved position
            _warn_if_inside_an_epoch(self.loaded, state, event.data)
        return NewState(state)

    __call__ = on_fit_start

    def __repr__(self) -> str:
        return f"resume_from({self.directory!r})"


def _warn_if_inside_an_epoch(url: str, state: Any, data: Any) -> None:
    # run() iterates the data from its start: after a save inside an epoch, a batch already
    # trained on comes again. The counters tell where the save was (one batch a micro-step).
    kind, loader = type(data).__name__, "steplib.data.resumable_loader(dataset, batch_size=...)"
    try:
        done = state.micro_step - state.epoch * len(data)
        said = (
            f"{url} was saved after {done} batches of epoch {state.epoch}, but the run's data (a "
            f"{kind}) has no state_dict() to restore that position: this run trains on those "
            f"batches again. Draw batches from {loader}, or resume from a checkpoint taken at an "
            "epoch end (checkpoint_every(epochs=1))"
        )
    except TypeError:  # no length (a generator, an iterable dataset): where epochs end is
        done = state.micro_step  # unknown, so a save after a batch may be inside one
        said = (
            f"{url} was saved after {done} batches, but the run's data (a {kind}) has neither a "
            "length nor state_dict(): if the save was inside an epoch, this run draws that "
            "epoch's batches again (a generator starts over). Give the data state_dict() / "
            f"load_state_dict() (its position, and what it holds), or use {loader}"
        )
    if done > 0:
        warnings.warn(f"resume_from: {said}.", CheckpointWarning, stacklevel=2)


def resume_from(
    directory: str | Checkpointer,
    *,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    storage_options: StorageOptions = None,
) -> Resume:
    """A ``fit_start`` handler: continue from the newest valid checkpoint in ``directory``,
    with the loader ``run`` draws from and every attached handler with ``state_dict``. Corrupt
    checkpoints are skipped with a ``CheckpointWarning``; with none the run starts fresh. On
    another number of ranks, use ``resumable_loader(..., shard=True)``.

    Args:
        directory: the directory of checkpoints, or the ``checkpoint_every`` handler.
        data, extras, storage_options: as for ``load`` (by default the handler's, and the
            stateful loader ``run`` draws from); the step(s) ``run`` calls are checked against
            the checkpoint's composition.

    Returns:
        A :class:`Resume` handler: ``Events(resume_from(ckpt), ..., ckpt)``.

    Raises:
        CorruptCheckpointError: at ``fit_start``, when every checkpoint is corrupt.
        ConfigError: at ``fit_start``, when the newest does not fit (other handlers, model,
            step...).

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step, run
        >>> from steplib.checkpoint import checkpoint_every
        >>> from steplib.data import resumable_loader
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> data = resumable_loader(torch.ones(12, 2), batch_size=4)  # its position is saved
        >>> ckpt = checkpoint_every("memory://doctest-resume/ckpt", every=1)
        >>> [run(step, state, data, events=[resume_from(ckpt), ckpt]).step
        ...  for _ in range(2)]  # the second run resumes at 3, for its next epoch
        [3, 6]
    """
    if isinstance(directory, Checkpointer):  # its settings, where not given here
        own = directory.given
        directory, storage_options = own.directory, storage_options or own.storage_options
        data = own.data if data is None else data
        extras = own.extras if extras is None else extras
    return Resume(Checkpoints(directory, data, extras, None, storage_options))


class Preemption(Handler):
    """The handler :func:`preemption` builds; ``received``: the signal that preempted the run
    (any rank's, with several ranks) or ``None``; ``saved``: the URL saved because of it, or
    ``None``."""

    last = True  # its saves run after the other handlers', as the checkpointer's do

    def __init__(self, checkpointer: Checkpointer, *, signals: Sequence[int]) -> None:
        self.checkpointer = checkpointer
        self.signals = tuple(signals)
        self.received: int | None = None
        self.saved: str | None = None
        self._signalled: int | None = None  # set by the signal handler alone
        self._previous: dict[int, Any] = {}
        self._agree = False  # this run's ranks decide together (a sharded state)
        self._group = GlooGroup()

    @property
    def exit_code(self) -> int:
        """0 without a signal, else ``128 + signal`` (what SLURM and others read to requeue)."""
        return 0 if self.received is None else 128 + self.received

    def on_fit_start(self, event: Event) -> None:
        """Install the signal handlers (``ConfigError`` outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "preemption(...) must run in the main thread: Python delivers signals only "
                "there. Call run() from the main thread, or leave preemption out."
            )
        self.received, self.saved, self._signalled = None, None, None
        self._agree = world_size() > 1  # sharded, or each rank its own (pipeline stages)
        if self._agree:
            self._group.get()  # made here, where every rank is (a collective)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_step_end(self, event: Event) -> Stop | None:
        """After a signal (any rank's, with several ranks): save now (on an epoch's last update,
        at its epoch_end) and stop the loop."""
        decided = self._decide()
        if decided is None:
            return None
        name = signal.Signals(decided).name
        if self.checkpointer.ends_epoch(event):  # saved at its epoch_end, after its handlers
            return Stop(f"preempted by {name} at step {event.step}, the end of an epoch")
        self._save(event)
        return Stop(f"preempted by {name} at step {event.step}; saved {self.saved}")

    def on_epoch_end(self, event: Event) -> Emitted | None:
        """Save if preempted at the epoch's last update (and report it)."""
        if self.received is None or self.saved is not None:
            return None
        self._save(event)
        return self.checkpointer.report(event)

    def on_fit_end(self, event: Event) -> Emitted | None:
        """Save if a signal came after the last update (and report it: the checkpointer's
        fit_end ran before), then restore the signal handlers."""
        if self.saved is None and self._decide() is not None:  # every rank decides alike
            self.saved = self.checkpointer.save(event, blocking=True)
        self._uninstall()
        return self.checkpointer.report(event)

    def on_exception(self, event: Event) -> None:
        self._uninstall()

    def _save(self, event: Event) -> None:
        self.saved = self.checkpointer.save(event, blocking=True)
        self._uninstall()

    def _decide(self) -> int | None:
        # Sharded: the all-reduced flag alone. A rank that read its own flag again after the
        # all-reduce (a signal arriving meanwhile) would save while the others train on.
        local = self._signalled  # read once: the handler may set it at any moment
        decided = int(max_over_ranks(local or 0, group=self._group.get())) if self._agree else local
        if decided:
            self.received = decided
        return decided or None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving here could corrupt or deadlock whatever Python was doing.
        if self._signalled is None:
            self._signalled = signum
        else:  # asked twice: the signal's previous meaning (usually: end now)
            self._uninstall()
            signal.raise_signal(signum)

    def _uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def preemption(
    checkpointer: Checkpointer, *, signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1)
) -> Preemption:
    """A handler that turns a preemption signal into a checkpoint and a clean stop: the signal
    sets a flag; at the next update the state is saved synchronously with ``checkpointer``'s
    settings, and the loop stops. A second signal ends the process as it normally would.

    Args:
        checkpointer: the :class:`Checkpointer` whose directory and settings to save with.
        signals: the signals to catch (what Kubernetes and SLURM send before a kill).

    Returns:
        A :class:`Preemption` (``exit_code``: 128 + signal); attach it after the checkpointer.

    Raises:
        ConfigError: ``checkpointer`` is not a ``checkpoint_every`` handler, or no signals.

    Example:
        >>> import os, signal, torch
        >>> from steplib import TrainState, make_train_step, run
        >>> from steplib.checkpoint import checkpoint_every
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> def loss_fn(model, batch):
        ...     if batch == 2:
        ...         os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would
        ...     return model(torch.ones(4, 2)).pow(2).mean()
        >>> ckpt = checkpoint_every("memory://doctest-preempt/ckpt", every=100)
        >>> handler = preemption(ckpt)
        >>> run(make_train_step(loss_fn), state, range(10), events=[ckpt, handler]).step
        3
        >>> handler.saved, handler.exit_code
        ('memory://doctest-preempt/ckpt/step-00000003', 138)
    """
    if not isinstance(checkpointer, Checkpointer):
        raise ConfigError(
            f"preemption(checkpointer) received {describe(checkpointer)}; pass the handler "
            "checkpoint_every(...) returned, so that the preemption save uses its settings."
        )
    if not signals:
        raise ConfigError(
            "preemption(signals=...) received no signals; pass e.g. "
            "signals=(signal.SIGTERM, signal.SIGUSR1)."
        )
    return Preemption(checkpointer, signals=signals)

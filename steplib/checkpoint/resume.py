"""How a run continues: ``resume_from``, a ``fit_start`` handler that loads the newest valid
checkpoint with what the run holds beyond its state (the data position, the attached
handlers' state); and ``preemption``, which turns SIGTERM / SIGUSR1 into a checkpoint at the
next update boundary and a clean stop.

With a sharded state (DDP / FSDP2 / TP, one model or several: what ``is_sharded`` decides for
every save) the ranks decide a preemption from the all-reduced flag alone, at every update
boundary (one tiny all-reduce on a gloo group of their own), so every rank saves the same
update and stops, instead of one entering the save's collectives while another trains on.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch.distributed as dist

from steplib.checkpoint.checkpointer import Checkpointer
from steplib.checkpoint.contents import is_sharded, run_data, with_handlers
from steplib.checkpoint.pipeline import Checkpoints
from steplib.checkpoint.storage import StorageOptions
from steplib.distributed.collectives import max_over_ranks
from steplib.errors import ConfigError, describe
from steplib.events import Emitted, Event, Handler, NewState, Stop

_log = logging.getLogger("steplib.checkpoint")


class Resume(Handler):
    """The ``fit_start`` handler :func:`resume_from` builds.

    Attributes:
        given: the directory and what the load is given (``pipeline.Checkpoints``).
        loaded: the URL of the checkpoint it loaded, or ``None`` (none yet, or started fresh).
    """

    def __init__(self, given: Checkpoints) -> None:
        self.given = given
        self.loaded: str | None = None

    @property
    def directory(self) -> str:
        return self.given.directory

    def on_fit_start(self, event: Event) -> NewState | None:
        """Load (as a call does); attach it before the handlers that must see the resumed state."""
        return self(event)

    def __call__(self, event: Event) -> NewState | None:
        """Load the newest valid checkpoint into the state, its loader and its handlers."""
        given = dataclasses.replace(
            self.given,
            data=run_data(self.given.data, event),
            extras=with_handlers("resume_from", self.given.extras, event.events),
        )
        found = given.load_newest(event.state)
        if found is None:
            _log.info("no checkpoint in %s: starting fresh", self.directory)
            return None
        self.loaded, state = found
        _log.info("resumed from %s at step %d", self.loaded, state.step)
        return NewState(state)

    def __repr__(self) -> str:
        return f"resume_from({self.directory!r})"


def resume_from(
    directory: str | Checkpointer,
    *,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    storage_options: StorageOptions = None,
) -> Resume:
    """A ``fit_start`` handler: continue from the newest valid checkpoint in ``directory``.

    Given the checkpoint handler (``resume_from(ckpt)``) it takes its directory, ``data``,
    ``extras``, ``step`` and ``storage_options``: nothing is named twice. The state comes back
    with the position of the stateful loader ``run`` draws from and the state of every handler
    with ``state_dict`` attached to the run (a saved handler not attached now, or the reverse,
    is a ``ConfigError``). Corrupt checkpoints are skipped with a ``CheckpointWarning``; with
    none the run starts fresh. At ``fit_start`` it raises ``CorruptCheckpointError`` when every
    checkpoint is corrupt and ``ConfigError`` when the newest does not fit: never a silent
    restart. On another number of ranks pass ``resumable_loader(..., shard=True)`` (see
    ``docs/resume_on_another_world_size.md``).

    Args:
        directory: the directory ``checkpoint_every`` / ``save`` write into, or the
            ``checkpoint_every`` handler that writes it.
        data: the loader to continue (by default the stateful loader ``run`` draws from).
        extras: the objects saved with ``extras=``, to load into.
        step: the Step; a checkpoint of another composition raises ``ConfigError``.
        storage_options: passed to fsspec.

    Returns:
        A :class:`Resume` handler: ``Events(resume_from(ckpt), ..., ckpt)``.

    Example:
        >>> import torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.checkpoint import checkpoint_every
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> ckpt = checkpoint_every("memory://doctest-resume/ckpt", every=1, step=step)
        >>> events = Events(resume_from(ckpt), ckpt)
        >>> run(step, state, [torch.ones(4, 2)] * 3, events=events).step
        3
        >>> run(step, state, [torch.ones(4, 2)] * 3, events=events).step  # resumed at 3
        6
    """
    if isinstance(directory, Checkpointer):
        ckpt = directory.given
        return Resume(
            Checkpoints(
                ckpt.directory,
                data if data is not None else ckpt.data,
                extras if extras is not None else ckpt.extras,
                step if step is not None else ckpt.step,
                storage_options or ckpt.storage_options,
            )
        )
    return Resume(Checkpoints(directory, data, extras, step, storage_options))


class Preemption(Handler):
    """The handler :func:`preemption` builds.

    Attributes:
        received: the signal the run was preempted by (any rank's, sharded), or ``None``.
        saved: the URL of the checkpoint saved because of it, or ``None``.
    """

    last = True  # its saves run after the other handlers', as the checkpointer's do

    def __init__(self, checkpointer: Checkpointer, *, signals: Sequence[int]) -> None:
        self.checkpointer = checkpointer
        self.signals = tuple(signals)
        self.received: int | None = None
        self.saved: str | None = None
        # Set by the signal handler alone, and read once per boundary: what this process was
        # sent (``received`` is what the run decided, which may be another rank's signal).
        self._signalled: int | None = None
        self._previous: dict[int, Any] = {}
        self._agree = False  # this run's ranks decide together (a sharded state)
        self._group: Any = None  # the gloo group sharded ranks agree on, and its default group
        self._group_of: Any = None

    @property
    def exit_code(self) -> int:
        """0 without a signal, else ``128 + signal`` (the shell's code for "ended by signal",
        which schedulers such as SLURM read to requeue the job)."""
        return 0 if self.received is None else 128 + self.received

    def on_fit_start(self, event: Event) -> None:
        """Install the signal handlers (``ConfigError`` outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "preemption(...) must run in the main thread: Python delivers signals only "
                "there. Call run() from the main thread, or leave preemption out."
            )
        self.received, self.saved, self._signalled = None, None, None
        # Decided once per run, from the state, as a save decides who writes what: a save
        # that every rank makes together needs every rank to decide it at the same update.
        self._agree = is_sharded(event.state)
        if self._agree and (self._group is None or self._group_of is not dist.group.WORLD):
            # Created here, where every rank is (new_group is a collective), and reused.
            self._group = dist.new_group(backend="gloo")
            self._group_of = dist.group.WORLD
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_step_end(self, event: Event) -> Stop | None:
        """After a signal (any rank's, sharded): save now and stop the loop."""
        decided = self._decide(event)
        if decided is None:
            return None
        self.saved = self.checkpointer.save(event, blocking=True)
        name = signal.Signals(decided).name
        self._uninstall()
        return Stop(f"preempted by {name} at step {event.step}; saved {self.saved}")

    def on_fit_end(self, event: Event) -> Emitted | None:
        """Save if a signal came after the last update (and report it: the checkpointer's
        fit_end ran before), then restore the signal handlers."""
        if self.saved is None and self._decide(event) is not None:  # every rank decides alike
            self.saved = self.checkpointer.save(event, blocking=True)
        self._uninstall()
        return self.checkpointer.report(event)

    def on_exception(self, event: Event) -> None:
        """Restore the signal handlers."""
        self._uninstall()

    def _decide(self, event: Event) -> int | None:
        """The signal to save and stop for at this boundary, or ``None``. Sharded: the largest
        number any rank had received when it entered the all-reduce, and that alone. A signal
        that arrives during the all-reduce is acted on at the next boundary, by every rank: a
        rank that read its own flag again afterwards would save while the others train on."""
        local = self._signalled  # read once: the handler may set it at any moment
        decided = int(max_over_ranks(local or 0, group=self._group)) if self._agree else local
        if not decided:
            return None
        self.received = decided
        return decided

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving here would run in the middle of whatever Python was doing
        # (a half-applied optimizer step, a torch.save) and could corrupt or deadlock it.
        if self._signalled is not None:
            # Asked twice: give the signal its previous meaning (usually: end the process now).
            # Only this process's own signals count: a rank saving for another rank's signal
            # still takes the scheduler's own SIGTERM as the first (else it would die mid-save).
            self._uninstall()
            signal.raise_signal(signum)
            return
        self._signalled = signum

    def _uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def preemption(
    checkpointer: Checkpointer,
    *,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
) -> Preemption:
    """A handler that turns a preemption signal into a checkpoint and a clean stop.

    The signal handler only sets a flag. At the next update boundary the state is saved with
    ``checkpointer``'s settings, synchronously, and the handler returns ``Stop(...)``; the
    loop ends normally. A second signal ends the process as it normally would.
    ``handler.received`` and ``handler.exit_code`` (128 + signal) say how the run ended.

    Args:
        checkpointer: the :class:`Checkpointer` whose directory and settings to save with.
        signals: the signals to catch (what Kubernetes and SLURM send before a kill).

    Returns:
        A :class:`Preemption`; call ``.attach(events)`` after the checkpointer's.


    Example:
        >>> import os, signal, torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.checkpoint import checkpoint_every
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> def loss_fn(model, batch):
        ...     if batch == 2:
        ...         os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would
        ...     return model(torch.ones(4, 2)).pow(2).mean()
        >>> ckpt = checkpoint_every("memory://doctest-preempt/ckpt", every=100)
        >>> handler = preemption(ckpt)
        >>> events = handler.attach(ckpt.attach(Events()))
        >>> run(make_train_step(loss_fn), state, range(10), events=events).step
        3
        >>> handler.saved, handler.exit_code
        ('memory://doctest-preempt/ckpt/step-00000003', 138)
    """
    if not isinstance(checkpointer, Checkpointer):
        raise ConfigError(
            f"preemption(checkpointer) received {describe(checkpointer)}; pass the handler "
            "checkpoint_every(...) returned, so that the preemption save uses its directory "
            "and settings."
        )
    if not signals:
        raise ConfigError(
            "preemption(signals=...) received no signals; pass e.g. "
            "signals=(signal.SIGTERM, signal.SIGUSR1)."
        )
    return Preemption(checkpointer, signals=signals)

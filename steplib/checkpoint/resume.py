"""``resume_from``: a ``fit_start`` handler that continues from the newest valid checkpoint.

Imports ``events``, ``state``, ``errors`` and the checkpoint package only (never the loop or
the step).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from steplib.checkpoint.attached import run_data, with_handlers
from steplib.checkpoint.handlers import Checkpointer
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.loading import load_newest
from steplib.events import Event, Events, NewState

_log = logging.getLogger("steplib.checkpoint")


class Resume:
    """A ``fit_start`` handler that loads the newest valid checkpoint. Build it with
    :func:`resume_from`; register it with :meth:`attach` (or ``events.on("fit_start", ...)``).

    Args:
        directory: the directory ``checkpoint_every`` / ``save`` write into.
        data: the loader to continue from the saved position, or ``None``: the stateful
            loader ``run`` draws from (``event.data``), if any.
        extras: the objects saved with ``extras=``, to load into, or ``None``.
        step: the Step whose composition the checkpoint must match, or ``None``.
        storage_options: passed to fsspec.

    Attributes:
        loaded: the URL of the checkpoint it loaded, or ``None`` (not called yet, or no
            checkpoint found: the run started fresh).

    Example:
        >>> resume = resume_from("memory://doctest-resume-class/empty")
        >>> resume, resume.loaded
        (resume_from('memory://doctest-resume-class/empty'), None)
    """

    def __init__(
        self,
        directory: str,
        *,
        data: Any,
        extras: Mapping[str, Any] | None,
        step: Any,
        storage_options: StorageOptions,
    ) -> None:
        self.directory = directory
        self.data = data
        self.extras = extras
        self.step = step
        self.storage_options = storage_options
        self.loaded: str | None = None
        self.events: Events | None = None

    def attach(self, events: Events) -> Events:
        """Register on ``fit_start``: attach it before the handlers whose ``fit_start`` must
        see the resumed state (``Events(resume_from(ckpt), evaluator, ..., ckpt)``).

        Returns:
            ``events``, so calls chain.
        """
        self.events = events
        return events.on("fit_start", self)

    def __call__(self, event: Event) -> NewState | None:
        """Load the newest valid checkpoint into ``event.state``, its data position into the
        loader and the saved handlers' states into those attached to the run."""
        events = self.events if self.events is not None else event.events
        found = load_newest(
            self.directory,
            event.state,
            data=run_data(self.data, event),
            extras=with_handlers("resume_from", self.extras, events),
            step=self.step,
            storage_options=self.storage_options,
        )
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

    Give it the checkpoint handler (``resume_from(ckpt)``) and it resumes from its directory
    with its ``data``, ``extras``, ``step`` and ``storage_options``: nothing is named twice.
    What a checkpoint holds comes back: the state, the position of the stateful loader ``run``
    draws from, and the state of every handler with ``state_dict`` / ``load_state_dict``
    attached to the run (a saved handler with no counterpart attached, or the reverse, is a
    ``ConfigError``; see ``checkpoint.attached``).

    Corrupt checkpoints are skipped with a ``CheckpointWarning`` (the next older one is used);
    with no checkpoint at all the run starts fresh. Register it before other ``fit_start``
    handlers, so that they see the resumed state. The handler raises (at ``fit_start``)
    ``CorruptCheckpointError`` when every checkpoint is corrupt, and ``ConfigError`` when the
    newest valid one does not fit the state, the step or the attached handlers: none of these
    starts the run over silently.

    On another number of ranks (a sharded checkpoint: DCP reshards the model and optimizer),
    pass a loader built with ``resumable_loader(..., shard=True)``: the data continues where
    an uninterrupted run on the new world size would be. A per-rank position (no
    ``shard=True``) is refused there with ``ConfigError``, as is a sample count that is not
    a whole number of the new global batches (the message gives the ``batch_size`` to use);
    see ``docs/resume_on_another_world_size.md``.

    Args:
        directory: the directory ``checkpoint_every`` / ``save`` write into, or the
            ``checkpoint_every`` handler that writes it.
        data: the loader to continue from the saved position (``shard=True`` to resume on
            another number of ranks); by default the stateful loader ``run`` draws from.
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
        ckpt = directory
        return Resume(
            ckpt.directory,
            data=data if data is not None else ckpt.data,
            extras=extras if extras is not None else ckpt.extras,
            step=step if step is not None else ckpt.step,
            storage_options=storage_options or ckpt.storage_options,
        )
    return Resume(directory, data=data, extras=extras, step=step, storage_options=storage_options)

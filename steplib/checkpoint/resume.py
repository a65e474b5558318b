"""``resume_from``: a ``fit_start`` handler that continues from the newest valid checkpoint.

Imports ``events``, ``state``, ``errors`` and the checkpoint package only (never the loop or
the step).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.loading import load_newest
from steplib.events import Event, NewState

_log = logging.getLogger("steplib.checkpoint")


class Resume:
    """A ``fit_start`` handler that loads the newest valid checkpoint. Build it with
    :func:`resume_from`.

    Args:
        directory: the directory ``checkpoint_every`` / ``save`` write into.
        data: the loader to continue from the saved position, or ``None``.
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

    def __call__(self, event: Event) -> NewState | None:
        found = load_newest(
            self.directory,
            event.state,
            data=self.data,
            extras=self.extras,
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
    directory: str,
    *,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    storage_options: StorageOptions = None,
) -> Resume:
    """A ``fit_start`` handler: continue from the newest valid checkpoint in ``directory``.

    Corrupt checkpoints are skipped with a ``CheckpointWarning`` (the next older one is used);
    with no checkpoint at all the run starts fresh. Register it before other ``fit_start``
    handlers, so that they see the resumed state. The handler raises (at ``fit_start``)
    ``CorruptCheckpointError`` when every checkpoint is corrupt, and ``ConfigError`` when the
    newest valid one does not fit the state or the step: neither starts the run over silently.

    On another number of ranks (a sharded checkpoint: DCP reshards the model and optimizer),
    pass a loader built with ``resumable_loader(..., shard=True)``: the data continues where
    an uninterrupted run on the new world size would be. A per-rank position (no
    ``shard=True``) is refused there with ``ConfigError``, as is a sample count that is not
    a whole number of the new global batches (the message gives the ``batch_size`` to use);
    see ``docs/resume_on_another_world_size.md``.

    Args:
        directory: the directory ``checkpoint_every`` / ``save`` write into.
        data: the loader to continue from the saved position (``shard=True`` to resume on
            another number of ranks).
        extras: the objects saved with ``extras=``, to load into.
        step: the Step; a checkpoint of another composition raises ``ConfigError``.
        storage_options: passed to fsspec.

    Returns:
        A :class:`Resume` handler: ``events.on("fit_start", resume_from(...))``.

    Example:
        >>> import torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.checkpoint import checkpoint_every
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> events = Events().on("fit_start", resume_from("memory://doctest-resume/ckpt"))
        >>> events = checkpoint_every("memory://doctest-resume/ckpt", every=1).attach(events)
        >>> run(step, state, [torch.ones(4, 2)] * 3, events=events).step
        3
        >>> run(step, state, [torch.ones(4, 2)] * 3, events=events).step  # resumed at 3
        6
    """
    return Resume(directory, data=data, extras=extras, step=step, storage_options=storage_options)

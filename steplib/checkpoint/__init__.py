"""Checkpoints and exact resume through fsspec: atomic, verified, asynchronous, preemption-safe.

* :func:`save`, :func:`load`, :func:`latest`, :func:`list_checkpoints`, :func:`best_checkpoint`,
  :func:`prune`.
* :func:`load_weights`: the model's weights only (fine-tuning).
* :class:`AsyncSaver`: snapshot now, write in a background thread; :func:`wait_snapshot`.
* Handlers: :func:`checkpoint_every`, :func:`resume_from`, :func:`preemption`.

The same functions write and read sharded checkpoints (torch.distributed.checkpoint) when a
process group is initialised and the state's model is, or holds, a DDP or FSDP2 module, or
holds DTensor parameters (tensor parallel). The layout of this package and where a change
belongs: ``docs/architecture.md``.
"""

from steplib.checkpoint.background import AsyncSaver, wait_snapshot
from steplib.checkpoint.checkpointer import checkpoint_every
from steplib.checkpoint.manifest import CheckpointInfo, latest, list_checkpoints
from steplib.checkpoint.pipeline import load, save
from steplib.checkpoint.resume import preemption, resume_from
from steplib.checkpoint.retention import best_checkpoint, prune
from steplib.checkpoint.weights import load_weights
from steplib.errors import CheckpointError, CheckpointWarning, CorruptCheckpointError

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "best_checkpoint",
    "checkpoint_every",
    "latest",
    "list_checkpoints",
    "load",
    "load_weights",
    "preemption",
    "prune",
    "resume_from",
    "save",
    "wait_snapshot",
]

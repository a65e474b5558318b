"""Checkpoints and exact resume through fsspec: atomic, verified, asynchronous, preemption-safe.

* :func:`save`, :func:`load`, :func:`latest`, :func:`best_checkpoint`, :func:`list_checkpoints`,
  :func:`prune`.
* :func:`load_weights`: the model's weights only, from a checkpoint or an exported file
  (fine-tuning).
* :class:`AsyncSaver`: snapshot now, write in a background thread; :func:`wait_snapshot`.
* Handlers: :func:`checkpoint_every`, :func:`resume_from`, :func:`preemption`.

The same functions write and read sharded checkpoints (torch.distributed.checkpoint) when a
process group is initialised and the state's model is, or holds, a DDP or FSDP2 module, or
holds DTensor parameters (tensor parallel); see ``steplib.checkpoint.sharded``.
"""

from steplib.checkpoint.background import AsyncSaver, wait_snapshot
from steplib.checkpoint.every import checkpoint_every
from steplib.checkpoint.handlers import Checkpointer
from steplib.checkpoint.listing import CheckpointInfo, latest, list_checkpoints
from steplib.checkpoint.loading import load
from steplib.checkpoint.metrics import default_metrics
from steplib.checkpoint.preemption import Preemption, preemption
from steplib.checkpoint.resume import Resume, resume_from
from steplib.checkpoint.retention import best_checkpoint, prune, select_retained
from steplib.checkpoint.saving import save
from steplib.checkpoint.weights import load_weights
from steplib.errors import CheckpointError, CheckpointWarning, CorruptCheckpointError

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWarning",
    "Checkpointer",
    "CorruptCheckpointError",
    "Preemption",
    "Resume",
    "best_checkpoint",
    "checkpoint_every",
    "default_metrics",
    "latest",
    "list_checkpoints",
    "load",
    "load_weights",
    "preemption",
    "prune",
    "resume_from",
    "save",
    "select_retained",
    "wait_snapshot",
]

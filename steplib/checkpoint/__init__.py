"""Checkpoints and exact resume through fsspec: atomic, verified, asynchronous, preemption-safe,
sharded through torch.distributed.checkpoint for a DDP, FSDP2 or tensor-parallel state. The
layout of this package and where a change belongs: ``docs/architecture.md``.
"""

from steplib.checkpoint.background import AsyncSaver
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
]

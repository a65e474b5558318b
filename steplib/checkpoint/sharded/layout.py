"""Which states are saved as sharded checkpoints, and the names of their files (no DCP import:
every save asks, also a single-process one)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from steplib.distributed.parallelize import is_parallel_model
from steplib.errors import ConfigError

DCP_DIR = "dcp"
# The distribution may change between the saving and the resuming run (that is resharding).
DISTRIBUTION_WRAPPERS = frozenset({"ddp_wrap", "fsdp_wrap"})


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s train-state file inside a sharded checkpoint."""
    return f"rank-{rank:05d}.pt"


def is_sharded(state: Any) -> bool:
    """Whether ``state`` is saved as a sharded checkpoint: a process group is initialised and
    its model is, or holds, a DDP or FSDP2 module (a GAN's ``{"G": apply_ddp(g), "D":
    apply_ddp(d)}`` too), or holds DTensor parameters (``apply_tp``, FSDP2 x TP). The one
    decision of which ranks write what: a sharded checkpoint is written by every rank (each
    its RNG and data position) and committed once, by rank 0; any other by the process alone.

    A DTensor parameter is one rank's shard: written as a plain ``model.pt`` by every rank,
    the last writer's shards would win and load into every rank. So every DTensor state is
    sharded, and one without a process group (destroyed) is refused.

    Raises:
        ConfigError: the model holds DTensor parameters but no process group is initialised.
    """
    model = getattr(state, "model", None)
    if not isinstance(model, torch.nn.Module):
        return False
    grouped = dist.is_available() and dist.is_initialized()
    if grouped and any(is_parallel_model(m) for m in model.modules()):
        return True
    if holds_dtensor_parameters(model):
        if not grouped:
            raise ConfigError(
                f"the state's model ({type(model).__name__}) holds DTensor parameters "
                "(tensor parallel or FSDP2), each rank's shard, but no process group is "
                "initialised, so the shards cannot be written or read together. Save and load "
                "on every rank before dist.destroy_process_group(); to use the weights in one "
                "process, load the checkpoint into a plain (unsharded) model."
            )
        return True
    return False


def holds_only_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is, or holds, DDP modules and no FSDP2 one: an open accumulation
    window's gradients are then plain per-rank tensors, which a checkpoint can hold (for the
    same world size)."""
    parallel = [m for m in model.modules() if is_parallel_model(m)]
    return bool(parallel) and all(isinstance(m, DistributedDataParallel) for m in parallel)


def holds_dtensor_parameters(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (a shard or a replica on a mesh)."""
    # No DTensor exists before its module is imported: a single-process save need not import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(p, module.DTensor) for p in model.parameters())


def prunes_here(state: Any) -> bool:
    """Whether this process prunes after saving ``state``: rank 0 alone for a sharded
    checkpoint (the ranks share one directory), every process otherwise."""
    return not is_sharded(state) or dist.get_rank() == 0

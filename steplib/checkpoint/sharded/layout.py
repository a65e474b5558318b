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
    """Which ranks write what: the one decision that ``save``, ``load``, ``AsyncSaver``,
    retention and ``preemption`` all take from here.

    Sharded (``True``): a process group is initialised and some module of the state's model
    is DDP or FSDP2 (the model itself, or a named one: ``{"G": apply_ddp(g), "D":
    apply_ddp(d)}``), or the model holds DTensor parameters (``apply_tp``, FSDP2 x TP). The
    ranks train one run: every rank calls the save together, writes its own part (its shard
    through DCP, and its own train state: RNG states, data position, window) and rank 0 alone
    commits the one checkpoint, and prunes. Plain (``False``): this process writes and commits
    the whole checkpoint (one process; or a model of its own, such as a pipeline stage, saved
    into a directory of its own).

    A DTensor parameter is one rank's shard, and a DDP replica sits next to per-rank RNG
    states and data positions: written as one plain checkpoint by every rank, the last
    writer's would win and load into every rank (and the ranks' commits would race). So every
    such state is sharded, and a DTensor state without a process group (destroyed) is refused.

    Args:
        state: a TrainState (anything else is not sharded).

    Returns:
        Whether a save of ``state`` is the ranks' sharded checkpoint.

    Raises:
        ConfigError: the model holds DTensor parameters but no process group is initialised.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters())
        >>> is_sharded(TrainState.create(model=model, optimizer=optimizer))  # no process group
        False
    """
    model = getattr(state, "model", None)
    if not isinstance(model, torch.nn.Module):
        return False
    grouped = dist.is_available() and dist.is_initialized()
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
    return grouped and any(is_parallel_model(module) for module in model.modules())


def keeps_window_grads(model: torch.nn.Module) -> bool:
    """Whether a sharded checkpoint of ``model`` can hold an open accumulation window's
    gradients: every parallel module is DDP (each rank's unsynchronised gradients, whole);
    FSDP2 keeps them unsharded inside its parameter groups with no public way to read them,
    and a tensor-parallel model's are DTensors bound to the run's mesh."""
    parallel = [m for m in model.modules() if is_parallel_model(m)]
    return (
        bool(parallel)
        and all(isinstance(m, DistributedDataParallel) for m in parallel)
        and not holds_dtensor_parameters(model)
    )


def holds_dtensor_parameters(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (a shard or a replica on a mesh)."""
    # No DTensor exists before its module is imported: a single-process save need not import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(p, module.DTensor) for p in model.parameters())


def prunes_here(state: Any) -> bool:
    """Whether this process prunes after saving ``state``: rank 0 alone for a sharded
    checkpoint (the ranks share one directory), every process otherwise."""
    return not is_sharded(state) or dist.get_rank() == 0

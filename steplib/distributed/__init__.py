"""torch.distributed set-up for steplib: launch environment, process group, parallelism
(DDP, FSDP2, TP, PP), activation checkpointing, and the few collectives steplib needs."""

from steplib.distributed.activation_checkpointing import checkpoint_activations
from steplib.distributed.collectives import any_rank, every_rank, max_over_ranks, sum_window
from steplib.distributed.launch_env import LaunchEnv, first_slurm_host, read_launch_env
from steplib.distributed.parallelize import apply_ddp, apply_fsdp, is_parallel_model
from steplib.distributed.pipeline_split import split_model
from steplib.distributed.process_group import (
    barrier,
    init_distributed,
    is_main,
    rank,
    shutdown,
    world_size,
)
from steplib.distributed.sharding import shard_check
from steplib.distributed.tensor_parallel import apply_tp, parallel_cross_entropy

__all__ = [
    "LaunchEnv",
    "any_rank",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "barrier",
    "checkpoint_activations",
    "every_rank",
    "first_slurm_host",
    "init_distributed",
    "is_main",
    "is_parallel_model",
    "max_over_ranks",
    "parallel_cross_entropy",
    "rank",
    "read_launch_env",
    "shard_check",
    "shutdown",
    "split_model",
    "sum_window",
    "world_size",
]

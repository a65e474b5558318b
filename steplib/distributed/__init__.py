"""torch.distributed set-up for steplib: launch environment, process group, parallelism."""

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
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "barrier",
    "first_slurm_host",
    "init_distributed",
    "is_main",
    "is_parallel_model",
    "parallel_cross_entropy",
    "rank",
    "read_launch_env",
    "shard_check",
    "shutdown",
    "split_model",
    "world_size",
]

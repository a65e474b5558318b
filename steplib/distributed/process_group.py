"""Process-group set-up and the few queries handlers need. Nothing global is added: the
process group is torch.distributed's own, and every query works without one (one process)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from steplib.distributed.launch_env import LaunchEnv, read_launch_env
from steplib.errors import ConfigError


def init_distributed(
    *, backend: str | None = None, timeout: datetime.timedelta | None = None
) -> LaunchEnv:
    """Initialise the default process group from the launcher's environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise (``backend`` overrides), and
    sets the CUDA device to the local rank. Without a launcher it does nothing and reports a
    single process, so the same script runs in a notebook. Calling it again is a no-op.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or another torch.distributed backend; ``None`` picks.
        timeout: collective timeout (torch's default when ``None``).

    Returns:
        The :class:`LaunchEnv` this process runs in.

    Raises:
        ConfigError: a multi-process environment without a rendezvous address.

    Example:
        >>> init_distributed().world_size  # no launcher: one process, nothing initialised
        1
    """
    env = read_launch_env(os.environ)
    if env.world_size == 1 or dist.is_initialized():
        return env
    if env.master_addr is None or env.master_port is None:
        raise ConfigError(
            f"The {env.launcher} environment gives {env.world_size} processes but no "
            "MASTER_ADDR/MASTER_PORT to meet at. Launch with torchrun (it sets them), or export "
            "MASTER_ADDR=<first node> MASTER_PORT=29500 in the SLURM script."
        )
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen == "nccl":
        torch.cuda.set_device(env.local_rank)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(chosen, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this is rank 0: the process that prints, logs and writes metadata."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """Destroy the default process group if there is one.

    Free DDP/FSDP models first: a live DDP reducer at destroy time can hang the teardown.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

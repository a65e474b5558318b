"""Process-group set-up and the few queries handlers need. Nothing global is added: the
process group is torch.distributed's own, and every query works without one (one process)."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

# Imported now, before any process group exists, on purpose: torch.distributed.nn.functional's
# collectives take `group=group.WORLD` as a default argument, evaluated when the module is
# first imported. Imported after init_process_group (DDP's constructor imports torch._dynamo,
# which imports it), those defaults hold the default group for the life of the process:
# destroy_process_group cannot free it, gloo's worker threads outlive it, and one that drops a
# tensor while the interpreter finalizes aborts the process (SIGABRT after a finished run;
# docs/distributed.md). Imported first, the defaults hold no group. It costs ~7 ms.
if dist.is_available():
    import torch.distributed.nn.functional

from steplib.distributed.launch_env import LaunchEnv, read_launch_env
from steplib.errors import ConfigError


def init_distributed(
    *, backend: str | None = None, timeout: datetime.timedelta | None = None
) -> LaunchEnv:
    """Initialise the default process group from the launcher's environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise (``backend`` overrides), and
    sets the CUDA device to the local rank (with ``gloo`` too, where that GPU exists). Without
    a launcher it does nothing and reports a single process, so the same script runs in a
    notebook. Calling it again is a no-op.

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
    # With gloo too: else every rank's .to("cuda") lands on GPU 0. NCCL needs one GPU a rank.
    if chosen == "nccl" or env.local_rank < torch.cuda.device_count():
        torch.cuda.set_device(env.local_rank)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(chosen, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def rank() -> int:
    """This process's global rank (0 without a process group).

    Returns:
        ``torch.distributed.get_rank()`` when the default process group is initialised,
        else ``0``: a single process (a notebook, a plain ``python train.py``) is rank 0.

    Example:
        >>> rank()  # one process, no process group
        0
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 without a process group).

    Returns:
        ``torch.distributed.get_world_size()`` when the default process group is initialised,
        else ``1``.

    Example:
        >>> world_size()  # one process, no process group
        1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_rank() -> int:
    """This process's global rank: the process group's, else the launcher's (torchrun's
    ``RANK``, ``SLURM_PROCID``, ...), else 0: what a process is before ``init_distributed()``.

    Example:
        >>> global_rank()  # no process group, no launcher
        0
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return read_launch_env(os.environ).rank


def is_main() -> bool:
    """Whether this is rank 0: the process that prints, logs and writes metadata.

    Returns:
        ``global_rank() == 0``: before a process group exists the launcher's rank decides, so
        a logger or progress bar built before ``init_distributed()`` still writes on one rank;
        always ``True`` in a single process.

    Example:
        >>> is_main()  # one process, no process group
        True
        >>> if is_main():
        ...     print("only rank 0 prints this")
        only rank 0 prints this
    """
    return global_rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op in a single process).

    Every rank must call it, at the same point: a rank that does not leaves the others
    waiting until the process group's timeout.

    Example:
        >>> barrier()  # one process: returns at once, without a process group
        >>> world_size()
        1
    """
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    """End the distributed part of a run: wait for every rank, then destroy every process
    group (the default one and the groups made from it: the gloo groups of ``preemption`` and
    ``AsyncSaver``).

    It first collects reference cycles, which can hold a model the script freed (and so its
    group). The barrier lets every rank leave its last collective before any tears its
    connections down; freeing the groups joins gloo's worker threads, so none is left to
    abort the interpreter's exit (SIGABRT after a finished run; docs/distributed.md says what
    held them before).

    Call it on every rank, after the run (``run`` waits for background checkpoints at its end;
    close an ``AsyncSaver`` of your own first) and after freeing DDP/FSDP models (a live DDP
    reducer at destroy time can hang the teardown). Safe to call more than once, and in a
    single process without a process group (a no-op), so the same script ends the same way
    everywhere.

    Example:
        >>> import torch.distributed as dist
        >>> shutdown()  # no process group: nothing to destroy
        >>> dist.is_initialized()
        False
    """
    if dist.is_available() and dist.is_initialized():
        # A model the script freed can still be held by a reference cycle (torch's DCP
        # state_dict helpers leave one); until a collection frees it, its group lives on.
        gc.collect()
        if dist.get_world_size() > 1:
            dist.barrier()  # every rank is out of its last collective before any leaves
        dist.destroy_process_group()  # all groups: the default one last

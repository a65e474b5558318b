"""Rank, world size, local rank and rendezvous read from the launcher's environment.

torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; SLURM's
``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` and the node list; Open MPI's
``mpirun`` sets ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``; MPICH's and Intel MPI's
``mpiexec`` (Hydra) set ``PMI_RANK``/``PMI_SIZE`` and ``MPI_LOCALRANKID``. MPI launchers give no
rendezvous: export ``MASTER_ADDR``/``MASTER_PORT`` (``mpirun -x MASTER_ADDR -x MASTER_PORT``),
or, inside a SLURM allocation, the first node of the allocation is used. Reading them is a pure
function of a mapping, so every launcher is testable with a faked environment.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from steplib.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this node (selects the GPU).
        master_addr: rendezvous host, or ``None`` when the launcher gives none.
        master_port: rendezvous port, or ``None``.
        launcher: ``"torchrun"``, ``"slurm"``, ``"openmpi"``, ``"mpi"`` (MPICH / Intel MPI
            Hydra) or ``"single"`` (no launcher: one process).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """The launch environment described by ``environ`` (usually ``os.environ``).

    Precedence: torchrun, then SLURM, then MPI; no launcher at all means a single process.
    torchrun's variables win (``torchrun`` inside an ``srun`` allocation is common). SLURM's
    win over MPI's when both describe this process alike (``srun --mpi=pmi2`` sets both), but
    not when they disagree: ``mpirun`` inside an ``sbatch`` script starts every process with
    the batch step's ``SLURM_PROCID``, so a disagreement means the SLURM values were inherited
    and the MPI launcher is the one that started this process.

    Args:
        environ: the environment variables to read, e.g. ``os.environ`` or a dict in a test.
            Only the launchers' variables are looked at; others are ignored.

    Returns:
        The :class:`LaunchEnv`: rank, world size, local rank, rendezvous address and port
        (``None`` where the launcher gives none), and which launcher set them;
        ``LaunchEnv(0, 1, 0, None, None, "single")`` when no launcher's variables are set.

    Raises:
        ConfigError: a variable that is not an integer, or a rank outside the world.

    Example:
        >>> read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
        1
        >>> read_launch_env({}).launcher
        'single'
        >>> env = read_launch_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
        ...                        "SLURM_JOB_NODELIST": "gpu[03-04]"})
        >>> env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher
        (3, 8, 3, 'gpu03', 'slurm')
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = LaunchEnv(
            rank=_int(environ, "RANK"),
            world_size=_int(environ, "WORLD_SIZE"),
            local_rank=_int(environ, "LOCAL_RANK", default=0),
            master_addr=environ.get("MASTER_ADDR"),
            master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
            launcher="torchrun",
        )
    elif _slurm_started_this(environ):
        env = LaunchEnv(
            rank=_int(environ, "SLURM_PROCID"),
            world_size=_int(environ, "SLURM_NTASKS"),
            local_rank=_int(environ, "SLURM_LOCALID", default=0),
            master_addr=_rendezvous_host(environ),
            master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
            launcher="slurm",
        )
    elif (mpi := _mpi_names(environ)) is not None:
        launcher, rank_name, size_name, local_name = mpi
        env = LaunchEnv(
            rank=_int(environ, rank_name),
            world_size=_int(environ, size_name),
            local_rank=_int(environ, local_name, default=0),
            master_addr=_rendezvous_host(environ),
            master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
            launcher=launcher,
        )
    else:
        return LaunchEnv(0, 1, 0, None, None, "single")
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(
            f"The {env.launcher} environment gives rank {env.rank} for a world of "
            f"{env.world_size}; a rank must be in [0, world size). Check the launch command."
        )
    return env


# (launcher, rank, world size, local rank) variables of each MPI launcher, in precedence order.
_MPI_VARIABLES = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH and Intel MPI (Hydra)
)


def _mpi_names(environ: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    """The variable names of the MPI launcher whose rank and size are set, if any."""
    for names in _MPI_VARIABLES:
        if names[1] in environ and names[2] in environ:
            return names
    return None


def _slurm_started_this(environ: Mapping[str, str]) -> bool:
    """Whether the SLURM variables describe this process (see :func:`read_launch_env`)."""
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return False
    mpi = _mpi_names(environ)
    if mpi is None:
        return True
    slurm = (_int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS"))
    return slurm == (_int(environ, mpi[1]), _int(environ, mpi[2]))


def _rendezvous_host(environ: Mapping[str, str]) -> str | None:
    """``MASTER_ADDR``, else the first node of the SLURM allocation (rank 0 runs there by
    default under both srun and mpirun), else ``None``."""
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return environ.get("MASTER_ADDR") or (first_slurm_host(nodes) if nodes else None)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``.

    Args:
        nodelist: a SLURM node list (``SLURM_JOB_NODELIST``): comma-separated hosts, each
            either a name or a prefix with bracketed numbers and ranges.

    Returns:
        The first host's name, zero padding kept (where rank 0 runs by default, hence the
        rendezvous host when ``MASTER_ADDR`` is not set).

    Raises:
        ConfigError: a node list that cannot be read (e.g. empty).

    Example:
        >>> first_slurm_host("gpu[03-05,09],cpu1")
        'gpu03'
        >>> first_slurm_host("node7")
        'node7'
    """
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise ConfigError(f"Cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR.")
    prefix, ranges = first.group(1), first.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(environ: Mapping[str, str], name: str, *, default: int | None = None) -> int:
    if name not in environ and default is not None:
        return default
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"The environment variable {name}={value!r} is not an integer; the launcher "
            "(torchrun / srun / mpirun) sets it. Unset it or fix the launch script."
        ) from None

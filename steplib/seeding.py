"""Seeding and determinism: one call seeds every generator a run draws from.

* :func:`seed_everything` seeds Python's ``random``, numpy's global generator (when numpy is
  installed) and torch's CPU and CUDA generators, optionally offset by the global rank, and
  optionally turns on torch's deterministic algorithms.
* :func:`loader_generator` and :func:`seeded_worker_init_fn` make ``DataLoader`` workers
  reproducible: the generator fixes the shuffle order and the seed each worker starts from;
  the init function derives every worker's ``random``/numpy/torch seeds from that seed and the
  global rank, so two ranks with the same seed still augment differently.

Seeding makes a run repeatable on the same machine, software and process count; bit-equality
across GPU models, library versions or world sizes is not something seeding can give.

Imports ``errors``, ``distributed.process_group`` and ``rng_state`` only.

Capturing and restoring them (``capture_rng`` / ``restore_rng``, defined in ``steplib.rng_state``)
are here too: a checkpoint holds the state of every generator, so that a resume continues where
the run was.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterable, Iterator

import torch

from steplib.distributed.process_group import global_rank
from steplib.errors import ConfigError, describe
from steplib.rng_state import (
    RngState,
    capture_rng,
    restore_rng,
    rng_is_own,
    warn_rng_not_restored,
)

try:  # numpy is optional: seeded only when installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the dev extra
    np = None  # type: ignore[assignment]

__all__ = [
    "RngState",
    "capture_rng",
    "forked_rng",
    "loader_generator",
    "restore_rng",
    "rng_is_own",
    "seed_everything",
    "seeded_worker_init_fn",
    "warn_rng_not_restored",
]

_MAX_SEED = 2**32 - 1  # numpy's legacy global generator takes seeds in [0, 2**32)
# cuBLAS is deterministic only with a fixed workspace; this is the setting torch's docs give.
_CUBLAS_CONFIG = ":4096:8"


def seed_everything(seed: int, *, deterministic: bool = False, rank_offset: bool = False) -> int:
    """Seed ``random``, numpy (when installed) and torch on CPU and every CUDA device.

    Call it first in a script, before the model is built (its initial weights are the first
    draw) and before CUDA is used (``CUBLAS_WORKSPACE_CONFIG`` is read when cuBLAS starts).

    ``deterministic=True`` costs speed, and it can make a run fail:

    * ``torch.use_deterministic_algorithms(True)``: ops with a deterministic implementation use
      it (on CUDA, e.g. ``index_add_``/``scatter_add_`` and some backward passes switch to
      slower kernels); ops without one raise ``RuntimeError`` naming the op.
    * ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``: convolutions
      lose cuDNN's autotuning and may run a slower algorithm.
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset: cuBLAS keeps a fixed workspace (torch's
      docs: about 24 MiB more GPU memory).

    On CPU most ops are deterministic already, so the cost there is usually small. The flags
    are process-wide; ``deterministic=False`` leaves them as they are (turn them off with
    ``torch.use_deterministic_algorithms(False)``).

    Args:
        seed: an int in ``[0, 2**32)``.
        deterministic: also turn on deterministic algorithms (above).
        rank_offset: seed with ``seed + global rank``, so that each rank draws different
            dropout masks and augmentations. The rank comes from the process group when one
            is initialised, else from the launcher's environment (torchrun, SLURM, MPI).

    Returns:
        The seed actually used (``seed``, or ``seed + rank`` with ``rank_offset``).

    Raises:
        ConfigError: ``seed`` is not an int in ``[0, 2**32)`` (with the offset too).

    Example:
        >>> seed_everything(7)
        7
        >>> a = torch.rand(2)
        >>> _ = seed_everything(7)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ConfigError(
            f"seed_everything(seed) received {describe(seed)}; a seed must be an int in "
            f"[0, 2**32) because numpy's global generator takes no other. Pass e.g. "
            "seed_everything(0)."
        )
    used = seed + (global_rank() if rank_offset else 0)
    if used > _MAX_SEED:
        raise ConfigError(
            f"seed_everything({seed}, rank_offset=True) gives seed {used} on rank {used - seed}, "
            "beyond 2**32 - 1. Pass a smaller seed, e.g. seed_everything(0, rank_offset=True)."
        )
    random.seed(used)
    if np is not None:
        np.random.seed(used)
    torch.manual_seed(used)  # seeds every CUDA device too (lazily, once CUDA starts)
    if deterministic:
        _use_deterministic_algorithms()
    return used


def _use_deterministic_algorithms() -> None:
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_CONFIG
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn(
                "seed_everything(deterministic=True) set CUBLAS_WORKSPACE_CONFIG after CUDA "
                "started, so cuBLAS may have chosen its workspace already and matrix products "
                "may stay non-deterministic. Call seed_everything before using CUDA, or export "
                f"CUBLAS_WORKSPACE_CONFIG={_CUBLAS_CONFIG} in the launch environment.",
                RuntimeWarning,
                stacklevel=3,
            )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def loader_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``, for ``DataLoader(generator=...)``.

    The loader draws its shuffle order and, at each epoch, the base seed of its workers from
    this generator instead of torch's global one, so the data order does not depend on what
    else drew random numbers (model init, dropout) before the epoch started.

    Args:
        seed: an int in ``[0, 2**64)``.

    Returns:
        The seeded generator.

    Raises:
        ConfigError: ``seed`` is not a non-negative int below ``2**64``.

    Example:
        >>> loader = torch.utils.data.DataLoader(range(4), shuffle=True,
        ...                                      generator=loader_generator(0))
        >>> [int(x) for x in loader] == [int(x) for x in torch.utils.data.DataLoader(
        ...     range(4), shuffle=True, generator=loader_generator(0))]
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ConfigError(
            f"loader_generator(seed) received {describe(seed)}; pass a non-negative int below "
            "2**64, e.g. DataLoader(..., generator=loader_generator(0))."
        )
    return torch.Generator().manual_seed(seed)


def seeded_worker_init_fn(worker_id: int) -> None:
    """``DataLoader(worker_init_fn=seeded_worker_init_fn)``: seed ``random``, numpy and torch
    in a worker from its torch seed and the global rank.

    torch already gives worker ``i`` the seed ``base_seed + i`` (``base_seed`` drawn from the
    loader's generator each epoch), but the same ``base_seed`` on every rank: two ranks seeded
    alike would apply the same random augmentations. Mixing in the rank gives each (rank,
    worker, epoch) its own reproducible stream. Use it with :func:`loader_generator` (or after
    :func:`seed_everything`) so ``base_seed`` itself is reproducible.

    Args:
        worker_id: the worker's index (the DataLoader passes it).

    Raises:
        ConfigError: called outside a DataLoader worker.

    Example:
        Pass it to a loader with workers; each worker calls it once when it starts (the
        workers start when the loader is first iterated):

        >>> loader = torch.utils.data.DataLoader(range(8), batch_size=2, shuffle=True,
        ...                                      num_workers=2, generator=loader_generator(0),
        ...                                      worker_init_fn=seeded_worker_init_fn)
        >>> loader.worker_init_fn is seeded_worker_init_fn
        True

        It seeds a worker process; called in the main process, it refuses:

        >>> seeded_worker_init_fn(0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: seeded_worker_init_fn(0) was called outside a DataLoader ...
    """
    info = torch.utils.data.get_worker_info()
    if info is None:
        raise ConfigError(
            f"seeded_worker_init_fn({worker_id}) was called outside a DataLoader worker; it "
            "seeds a worker process. Pass it to the loader instead: "
            "DataLoader(..., num_workers=2, worker_init_fn=seeded_worker_init_fn)."
        )
    words = _mix(info.seed, global_rank())
    seed = words[0] << 32 | words[1]
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(words)  # a uint32 array: all 128 bits, as torch seeds numpy in workers


def _mix(seed: int, rank: int) -> list[int]:
    """Four 32-bit words from ``(seed, rank)`` (splitmix64: nearby inputs give unrelated
    outputs, with no dependency on numpy)."""
    mask = 2**64 - 1
    state = (seed ^ (rank * 0x9E3779B97F4A7C15)) & mask
    words = []
    for _ in range(2):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        words += [z >> 32, z & 0xFFFFFFFF]
    return words


@contextlib.contextmanager
def forked_rng(devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Run a block, then give every global generator back the state it had before: torch's
    CPU generator, the CUDA generators of ``devices``, numpy's and Python's.

    Evaluation runs inside it (``steplib.handlers.evaluate``, and so every ``Evaluator``):
    starting a ``DataLoader`` iterator draws its base seed from torch's generator, a sampler
    that shuffles draws from it, and so may an eval step. Without the fork, turning
    evaluation on or off would change every later dropout mask and shuffle of training.

    Args:
        devices: the devices whose CUDA generators to fork as well (CPU devices are ignored:
            the CPU generator is always forked). Naming only the devices in use avoids
            creating a CUDA context on every visible GPU.

    Yields:
        Nothing; the block runs with the generators as they were, and whatever it draws is
        forgotten at its end (on error too).

    Example:
        >>> import torch
        >>> a = torch.rand(1)
        >>> _ = torch.manual_seed(0)
        >>> with forked_rng():
        ...     _ = torch.rand(3)  # what evaluation draws ...
        >>> after = torch.rand(1)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.rand(1))  # ... is not seen by what follows
        True
    """
    cuda = sorted({_cuda_index(d) for d in devices if d.type == "cuda"})
    python = random.getstate()
    numpy_state = np.random.get_state() if np is not None else None
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(python)
            if numpy_state is not None:
                np.random.set_state(numpy_state)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()

"""The state of every random generator a run draws from, as plain data: captured into a
checkpoint (``capture_rng``) and restored in the process that captured it (``restore_rng``,
``rng_is_own``), so that a resume continues where the run was. Re-exported by
``steplib.seeding``; imports ``errors`` and ``distributed.process_group`` only.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

from steplib.distributed.process_group import global_rank, rank, world_size
from steplib.errors import CheckpointWarning

try:  # numpy is optional: captured only when installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the dev extra
    np = None  # type: ignore[assignment]

# Capture and restore every random number generator a training step may draw from.
#
# Dropout, random data transforms and samplers draw from process-global generators: torch's CPU
# generator, one generator per CUDA device, numpy's legacy global ``RandomState`` and Python's
# ``random``. A resume is exact only if all of them continue where they were, so a checkpoint
# holds their states.
#
# The captured value is plain data (tensors, ints, strings, lists and dicts), so that it loads
# with ``torch.load(..., weights_only=True)``: numpy's key array becomes an int64 tensor and
# Python's state tuple becomes lists.

RngState = dict[str, Any]


def capture_rng(*, cuda: bool = True) -> RngState:
    """The current state of every global generator, as plain data.

    Args:
        cuda: also capture the CUDA generators. ``False`` in a forked ``DataLoader`` worker,
            where starting CUDA fails (``"cuda"`` is then ``None``).

    Returns:
        ``{"torch": ByteTensor, "cuda": [ByteTensor per device] or None, "numpy": dict or None,
        "python": list, "process": [rank, world size]}``. ``cuda`` is ``None`` when CUDA is not
        available; ``numpy`` when numpy is not installed; ``process`` is whose they are.

    Example:
        >>> import torch
        >>> state = capture_rng()
        >>> a = torch.rand(2)
        >>> restore_rng(state)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    cuda_states = None
    if cuda and torch.cuda.is_available():
        # One state per device: a process may drive several GPUs (model parallel).
        cuda_states = [s.clone() for s in torch.cuda.get_rng_state_all()]
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        numpy_state = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda_states,
        "numpy": numpy_state,
        "python": [version, list(internal), gauss_next],
        "process": [rank(), world_size()],  # see rng_is_own
    }


def restore_rng(state: RngState) -> None:
    """Set every global generator to a state returned by :func:`capture_rng`.

    A generator missing from ``state`` (numpy was not installed when it was captured) or from
    this process (no CUDA here) is left as it is.

    Args:
        state: a value returned by :func:`capture_rng` (possibly after a save and load).

    Raises:
        ValueError: ``state`` holds a different number of CUDA devices than this process sees
            (restoring part of them would not be an exact resume).

    Example:
        >>> state = capture_rng()
        >>> a = random.random()
        >>> restore_rng(state)
        >>> random.random() == a
        True
    """
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"restore_rng received CUDA generator states for {len(cuda)} device(s), but this "
                f"process sees {torch.cuda.device_count()}. Resume with the same number of "
                "visible devices (CUDA_VISIBLE_DEVICES) as the run that saved it."
            )
        torch.cuda.set_rng_state_all(cuda)
    numpy_state = state.get("numpy")
    if numpy_state is not None and np is not None:
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def rng_is_own(state: RngState | None, *, checkpoint: str) -> bool:
    """Whether a checkpoint's :func:`capture_rng` is this process's: captured by this rank of as
    many ranks (or before steplib recorded whose). Restored in another process, it would make
    that one draw as its own did: a single-process checkpoint loaded on every rank of a DDP run
    would give every rank the same dropout masks. Else :func:`warn_rng_not_restored`.

    Args:
        state: a checkpoint's ``capture_rng()`` (``None``: none saved).
        checkpoint: the checkpoint's URL, for the warning.

    Returns:
        Whether to restore ``state`` here.

    Example:
        >>> rng_is_own(capture_rng(), checkpoint="ckpt/7")  # one process, its own
        True
    """
    saved = None if state is None else state.get("process")
    if saved is None or list(saved) == [rank(), world_size()]:
        return True
    warn_rng_not_restored(
        saved_world_size=saved[1], world_size=world_size(), checkpoint=checkpoint, owner=saved[0]
    )
    return False


def warn_rng_not_restored(
    *, saved_world_size: int, world_size: int, checkpoint: str, owner: int | None = None
) -> None:
    """Warn, once for the run's ranks, that a checkpoint written by ``saved_world_size`` ranks
    (each its generators), or by rank ``owner`` of as many alone (a single-process one), and
    loaded on ``world_size`` restores no rank's generators but the owner's own: they cannot
    map one to one onto these ranks, so every other rank goes on from its own generators.

    Args:
        saved_world_size: the number of ranks of the saving run.
        world_size: the number of ranks loading it.
        checkpoint: the checkpoint's URL, for the message.
        owner: the rank whose generators a single-process checkpoint holds (``None``: a
            sharded checkpoint, one state per saving rank).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_rng_not_restored(saved_world_size=4, world_size=2, checkpoint="ckpt/7")
        >>> print(seen[0].message)  # doctest: +ELLIPSIS
        load: checkpoint ckpt/7 was written by 4 ranks and is loaded on 2: ...
    """
    kept = owner if saved_world_size == world_size else None  # the rank that restores its own
    if global_rank() != (1 if kept == 0 else 0):  # the first rank that restores none
        return
    kind = "torch's CPU and CUDA, numpy's, Python's"
    if owner is None:
        said = (
            f"was written by {saved_world_size} ranks and is loaded on {world_size}: it holds "
            f"each saving rank's random generators ({kind}), which cannot map one to one onto "
            f"another number of ranks, so none of its {saved_world_size} states is restored and "
            "every rank"
        )
    else:
        kept_by = "none is restored and every rank"
        if kept is not None:
            kept_by = f"rank {kept}'s own alone is restored and every other rank"
        said = (
            f"holds the random generators ({kind}) of rank {owner} of {saved_world_size} alone, "
            f"and is loaded on {world_size} ranks: restored on each, they would make every rank "
            f"draw what that one drew (the same dropout masks), so {kept_by}"
        )
    warnings.warn(
        f"load: checkpoint {checkpoint} {said} here goes on from its generators as its process "
        "left them. Dropout masks, random augmentations in the main process and every other "
        "random draw differ from the saved run's; the model, optimizer, counters and a "
        "shard=True data position are restored exactly. For draws that follow the update and "
        "the rank alone (a resume then draws what an uninterrupted run on this number of ranks "
        "draws), seed each update from its number: see 'Resuming on another number of ranks' "
        "in docs/seeding.md.",
        CheckpointWarning,
        stacklevel=3,
    )

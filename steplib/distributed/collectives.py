"""The few collectives steplib needs, each written once. Every one works without a process group
(one process: the value itself), so handlers and steps call them unconditionally."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def first_other(mine: Any) -> tuple[int, Any] | None:
    """``(rank, theirs)`` of the first rank whose ``mine`` differs from this rank's, else
    ``None``: one ``all_gather_object``, for build-time checks that every rank did alike.

    Example:
        >>> first_other({"seed": 0}) is None  # no process group: no other rank
        True
    """
    if not _active(None):
        return None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # once, at build time: a host sync is fine here
    return next(((rank, theirs) for rank, theirs in enumerate(every) if theirs != mine), None)


def max_over_ranks(value: float, *, device: torch.device | None = None, group: Any = None) -> float:
    """The largest ``value`` over the ranks of ``group`` (default: all), NaN when any rank's
    is NaN (as ``torch.max``). A host read: call it from handlers, never inside a step.

    Args:
        value: this rank's number.
        device: where the reduction runs (NCCL reduces CUDA tensors only: pass the state's
            device); ``None`` is the CPU.
        group: the process group, ``None`` for the default one.

    Returns:
        The largest value, the same on every rank; NaN when any rank gave NaN.

    Example:
        >>> max_over_ranks(3.0)  # no process group: the value itself
        3.0
    """
    if not _active(group):
        return float(value)
    # A NaN travels as a flag: the backends' MAX keeps or drops a NaN depending on which
    # rank holds it (gloo: max(1, nan) on ranks 0, 1 is 1; max(nan, 1) is nan).
    nan = math.isnan(value)
    tensor = torch.tensor(
        [-math.inf if nan else float(value), float(nan)], dtype=torch.float64, device=device
    )
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    largest, any_nan = tensor.tolist()
    return math.nan if any_nan else float(largest)


def any_rank(flag: bool, *, device: torch.device | None = None, group: Any = None) -> bool:
    """``flag`` OR-ed over the ranks (one small all-reduce; ``flag`` itself in one process).

    Args:
        flag: this rank's answer.
        device: where the reduction runs (the state's device under NCCL).
        group: the process group, ``None`` for the default one.

    Returns:
        True on every rank when any rank said True.

    Example:
        >>> any_rank(True)
        True
    """
    return max_over_ranks(1.0 if flag else 0.0, device=device, group=group) > 0


def every_rank(flag: bool, *, device: torch.device | None = None, group: Any = None) -> bool:
    """``flag`` AND-ed over the ranks; also a barrier.

    Args:
        flag: this rank's answer.
        device: where the reduction runs (the state's device under NCCL).
        group: the process group, ``None`` for the default one.

    Returns:
        True on every rank when every rank said True.

    Example:
        >>> every_rank(False)
        False
    """
    return not any_rank(not flag, device=device, group=group)


def sum_window(
    loss_sum: torch.Tensor, targets: torch.Tensor | int, *, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's loss sum and target count summed over the ranks of ``group``, in one
    all-reduce that stays on the device (no host read: steps call it).

    Both travel as float32 whatever the default dtype, so that every rank sends the same
    layout (a rank that counted a Python int and one that counted a tensor agree).

    Args:
        loss_sum: this rank's window loss sum, a 0-dim tensor.
        targets: this rank's target count, an int or a 0-dim tensor.
        group: the process group, ``None`` for the default one.

    Returns:
        ``(loss_sum, targets)`` over every rank, float32 0-dim tensors on ``loss_sum``'s device.

    Example:
        >>> loss, count = sum_window(torch.tensor(6.0), 3)
        >>> float(loss), float(count)
        (6.0, 3.0)
    """
    counts = (
        targets.to(loss_sum.device, torch.float32)
        if isinstance(targets, torch.Tensor)
        # a fill, not a host-to-device copy
        else torch.full((), float(targets), dtype=torch.float32, device=loss_sum.device)
    )
    packed = torch.stack([loss_sum.to(torch.float32), counts])
    if _active(group):
        dist.all_reduce(packed, group=group)
    return packed[0], packed[1]

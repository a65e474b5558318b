"""What a stopped copy of a sweep is inside the step: its buffers are put back after each
forward and backward (:func:`stopped_buffers_kept`), and a copy that skipped more than
``max_consecutive`` updates in a row is stopped (:func:`count_and_stop`).

Outside a sweep, ``skip_nonfinite(max_consecutive=n)`` raises ``TooManySkipsError`` once more
than ``n`` updates in a row were skipped: training diverged. In a sweep one diverged copy is no
reason to end the others' runs, and no reason to go on paying its share of every update either:
the copy is stopped, as ``SweepEarlyStopping`` stops one, and the others train on, bit for bit
as they would have. The run raises ``TooManySkipsError`` once such a stop leaves no copy to
train (the error a diverged run gets; a stopped copy can never train again).

Everything the update needs stays on the device: each copy's skips in a row are a ``[N]``
int64 tensor in the sweep optimizer's ``param_groups[0]["consecutive_skips"]``, beside the
``"active"`` mask and saved with it (a resume continues each copy's count), and a copy whose
count passes the limit is masked out of ``"active"`` in the same update, so where it stops does
not depend on when the host learns of it. The host learns through a host copy of the stop,
read once it has landed (``SkipMemory.landed``: on the CPU at once, on CUDA an update or two
later, never waited for): a warning naming the copy, its hyper-parameters and the update.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from steplib.errors import TooManySkipsError
from steplib.step.plan import Plan
from steplib.sweep.copies import Copies
from steplib.sweep.per_copy_optimizer import PerCopyOptimizer

COUNT = "consecutive_skips"  # the key of each copy's count in param_groups[0]


def count_and_stop(
    optimizer: PerCopyOptimizer,
    applied: torch.Tensor,
    skipped: torch.Tensor,
    *,
    plan: Plan,
    update: int,
) -> None:
    """After an update: count each copy's skips in a row (a stopped copy's count stays as it
    was), stop the copies whose count passed ``limit`` (``None``: none), and report the stops
    that have landed on the host.

    Raises:
        TooManySkipsError: a landed update left no copy active, some stopped for skips.
    """
    group = optimizer.param_groups[0]
    before = group.get(COUNT)
    if before is None:  # a new optimizer, or one saved before steplib kept the count
        before = torch.zeros(applied.shape, dtype=torch.int64, device=applied.device)
    counts = torch.where(skipped, before + 1, before.masked_fill(applied, 0))
    # Replaced, not changed in place: a state dict taken before keeps its own values.
    group[COUNT] = counts
    limit = plan.max_consecutive_skips
    if limit is None:
        return
    diverged = counts > limit  # a stopped copy's count stays: stopped for skips, now or before
    over = group["active"] & diverged
    active = group["active"] = group["active"] & ~over  # the next update leaves these alone
    posted = torch.stack([over, active, diverged])
    landed = plan.skips.landed(optimizer, "stopped", posted, update)
    for (stopped, left, gone), made_at in landed:
        which = [i for i, s in enumerate(stopped) if s]
        # Not only when this update stopped the last copy: on CUDA that stop lands an update
        # or two late, so a save between holds no active copy, and a run resumed from it
        # would otherwise update no copy to its end without a word.
        if not any(left) and any(gone):
            named = which or [i for i, g in enumerate(gone) if g]
            when = f"at step {made_at}" if which else f"before step {made_at}"
            raise TooManySkipsError(
                f"skip_nonfinite: every copy of this sweep is stopped: {_copies(optimizer, named)} "
                f"skipped more than max_consecutive={limit} updates in a row, {when}"
                f"{'' if len(named) == len(stopped) else ', the others were stopped before'}. "
                "Training has diverged: lower the learning rates, add clip(step, "
                "max_norm=1.0), check the data for NaN/inf and empty batches, or resume a "
                "checkpoint saved before the stop with a higher max_consecutive."
            )
        if which:
            warnings.warn(
                f"skip_nonfinite: {_copies(optimizer, which)} of this sweep skipped more than "
                f"max_consecutive={limit} updates in a row, at step {made_at}: diverged, and "
                "stopped (its parameters and optimizer state stay as they were; the other "
                "copies train on). Give it a lower learning rate in the next sweep, or resume "
                "a checkpoint saved before the stop with a higher max_consecutive.",
                stacklevel=5,
            )


def _copies(optimizer: PerCopyOptimizer, which: list[int]) -> str:
    """``copy 3 (lr=0.3, weight_decay=0.1)``: the hyper-parameters that differ between the
    copies (what the sweep sweeps; a sweep of seeds has none). A host read of them, made only
    when a copy is stopped."""
    values: dict[str, Any] = {
        name: value.tolist() for name, value in optimizer.param_groups[0]["copies"].items()
    }
    swept = {name: v for name, v in values.items() if len(set(v)) > 1}
    named = []
    for i in which:
        settings = ", ".join(f"{name}={v[i]:g}" for name, v in swept.items())
        named.append(f"copy {i}" + (f" ({settings})" if settings else ""))
    return ", ".join(named)


@contextlib.contextmanager
def stopped_buffers_kept(optimizer: Any, copies: Copies) -> Iterator[None]:
    """Put a stopped copy's buffers back after forward and backward (backward may read them as
    forward left them): a stopped copy is done, and its running statistics (BatchNorm's) must
    not go on moving with the other copies' batches, as its own run, stopped there, would not.
    On the device, a clone and a ``where`` per buffer: no host read of the mask."""
    buffers = list(copies.stacked.buffers()) if isinstance(optimizer, PerCopyOptimizer) else []
    saved = [b.clone() for b in buffers]
    yield
    if buffers:
        active = optimizer.param_groups[0]["active"]
        with torch.no_grad():
            for buffer, old in zip(buffers, saved, strict=True):
                here = active.view((-1,) + (1,) * (buffer.ndim - 1))
                torch.where(here, buffer, old, out=buffer)

"""``reference_loop``: the plain PyTorch loop that steplib's laws are stated against.

Nothing in it uses steplib: it is the loop the PyTorch docs write, with gradient accumulation
done the token-weighted way (sum the losses, count the targets, divide once per window).
Compare a step with it to show that the step is "just" this loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn


class UpdateRecord(NamedTuple):
    """What happened at one optimizer update of :func:`reference_loop`.

    Attributes:
        loss: the window's loss, sum of loss sums / total targets (float32, detached).
        num_targets: the window's total target count (an int, or a tensor when ``loss_fn``
            counts with tensors).
        grad_norm: the total gradient norm before clipping, when ``max_norm`` is given.
        did_update: False when a float16 ``scaler`` skipped the update (inf/NaN gradients).
        lr: the learning rate of the first parameter group used by this update.
    """

    loss: torch.Tensor
    num_targets: torch.Tensor | int
    grad_norm: torch.Tensor | None
    did_update: bool
    lr: float


def reference_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], Any],
    scheduler: Any = None,
    max_norm: float | None = None,
    accumulation: int = 1,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> list[UpdateRecord]:
    """Train ``model`` over ``batches`` with a plain loop; one record per optimizer update.

    On CPU in float32 it gives ``make_train_step`` 's parameters bit for bit (law 1); with
    ``accumulation=k`` it is what ``accumulate(step, k)`` must match (law 2, a last shorter
    window included); with ``max_norm`` what ``clip`` must match (law 3); with
    ``autocast_dtype`` / ``scaler`` what ``amp_wrap`` must match (law 4).

    Args:
        model: the module to train (changed in place).
        optimizer: its optimizer.
        batches: the micro-batches, in order; every ``accumulation`` of them make one update.
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss_sum,
            num_targets)``, optionally followed by a dict of aux tensors (ignored here).
        scheduler: an LR scheduler stepped after every applied update (a window of no
            targets applies none).
        max_norm: clip the total gradient norm to this (``clip_grad_norm_``).
        accumulation: micro-batches per update, >= 1.
        autocast_dtype: run the forward under ``torch.autocast`` with this dtype.
        scaler: a ``torch.amp.GradScaler`` for float16.

    Returns:
        One :class:`UpdateRecord` per update.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> records = reference_loop(model, opt, batches=[torch.ones(3, 2)] * 4,
        ...                          loss_fn=lambda m, b: m(b).pow(2).mean(), accumulation=2)
        >>> len(records), records[0].num_targets
        (2, 2)
    """
    device_type = next(model.parameters()).device.type
    params = [p for group in optimizer.param_groups for p in group["params"]]
    records = []
    for start in range(0, len(batches), accumulation):
        window = batches[start : start + accumulation]  # the last window may be shorter
        lr = float(optimizer.param_groups[0]["lr"])  # the LR this update uses
        loss_sum: torch.Tensor | None = None
        targets: torch.Tensor | int = 0
        for batch in window:
            # Forward under autocast (disabled, i.e. a no-op, without autocast_dtype).
            with torch.autocast(
                device_type,
                dtype=autocast_dtype or torch.bfloat16,
                enabled=autocast_dtype is not None,
            ):
                batch_sum, count = _sum_and_count(loss_fn(model, batch))
            # Backward of the SUM: gradients of the window's micro-batches add up in .grad.
            # A float16 scaler multiplies the loss first, so small gradients do not underflow.
            (batch_sum if scaler is None else scaler.scale(batch_sum)).backward()
            # Summed in float32 at least, as the step sums: a float64 loss stays float64.
            partial = batch_sum.detach().to(torch.promote_types(batch_sum.dtype, torch.float32))
            loss_sum = partial if loss_sum is None else loss_sum + partial
            targets = targets + count  # a plain scalar loss counts as one target
        assert loss_sum is not None  # a window holds at least one batch
        # Undo the scale before anything reads the gradients (division, clipping).
        if scaler is not None:
            scaler.unscale_(optimizer)
        # Divide once by the window's target count: the gradient of the window's mean over
        # its targets, whatever the split into micro-batches (0 targets: zero gradients).
        divisor: torch.Tensor | int | None = None
        if isinstance(targets, torch.Tensor):
            divisor = torch.where(targets > 0, targets, torch.ones_like(targets))
        elif targets > 1:  # 1: nothing to divide; 0: the gradients are zero anyway
            divisor = targets
        if divisor is not None:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(divisor)
        grad_norm = None
        if max_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # A window of no targets (all padding) makes no update, as the step's: an optimizer
        # with momentum or weight decay would move the parameters on zero gradients.
        empty = int(targets) == 0
        if scaler is not None:
            scale_before = scaler.get_scale()
            if not empty:
                scaler.step(optimizer)  # skipped when unscale_ found inf/NaN
            scaler.update()
            did_update = not empty and scaler.get_scale() >= scale_before  # a back-off: skipped
        else:
            if not empty:
                optimizer.step()
            did_update = not empty
        optimizer.zero_grad(set_to_none=True)
        # The scheduler counts updates, not micro-batches, and not skipped updates.
        if scheduler is not None and did_update:
            scheduler.step()
        records.append(UpdateRecord(loss_sum / targets, targets, grad_norm, did_update, lr))
    return records


def _sum_and_count(result: Any) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(loss_sum, num_targets)`` from any accepted ``loss_fn`` result, aux dropped."""
    if isinstance(result, torch.Tensor):
        return result, 1
    if len(result) == 2 and isinstance(result[1], Mapping):  # (loss, aux)
        return result[0], 1
    return result[0], result[1]  # (loss_sum, num_targets) or (loss_sum, num_targets, aux)

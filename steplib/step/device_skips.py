"""Skipping a non-finite update without reading the decision on the host.

A step that may skip (a float16 ``GradScaler`` or ``skip_nonfinite``) knows whether the window
was finite only as a device tensor. Reading it on the host (``bool(flag)``) stalls a GPU step
until every queued kernel has run. Three things need the decision, and each is moved onto the
device when the optimizer and the scheduler allow it:

* **the optimizer update**: torch's fused optimizers (``fused=True``: Adam, AdamW, SGD, Adagrad)
  take a ``found_inf`` tensor and skip the update inside their kernel, step counter included
  (the same mechanism ``GradScaler.step`` uses for them);
* **the learning rate**: a ``LambdaLR`` is a function of its position, so its rates are put in
  a table on the device, one row per position, and the position is a device counter advanced
  only by applied updates; the optimizer's ``lr`` becomes a tensor that is refilled from that
  table. The host-side scheduler object is brought up to date when a checkpoint reads it
  (``TrainState.settle_scheduler``);
* **the skip counters**: ``skipped_updates`` / ``consecutive_skips`` become device tensors; the
  ``max_consecutive`` limit is checked on a host copy of the counter once that copy has landed
  (:class:`HostCopy`: a CUDA event is queried, never waited on), so on CUDA the error can come
  an update or two late; those updates were skipped too.

Any other optimizer or scheduler keeps the host read, once per update (torch's own
``GradScaler.step`` does the same for non-fused optimizers). :func:`decides_on_device` says which.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from steplib.state import TrainState

LambdaLR = torch.optim.lr_scheduler.LambdaLR


def decides_on_device(optimizer: torch.optim.Optimizer, scheduler: Any) -> bool:
    """Whether a skip decision can stay on the device for this optimizer and scheduler: a fused
    optimizer (it skips inside its kernel) and no scheduler or a ``LambdaLR`` (a function of
    its position, so its rates can be tabulated).

    Example:
        >>> import torch
        >>> w = [torch.nn.Parameter(torch.zeros(2))]
        >>> decides_on_device(torch.optim.AdamW(w, fused=True), None)
        True
        >>> decides_on_device(torch.optim.AdamW(w), None)  # foreach: no in-kernel skip
        False
    """
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    return fused and (scheduler is None or type(scheduler) is LambdaLR)


class HostCopy:
    """A host copy of a small device tensor, readable once the device has produced it.

    On CUDA the copy goes to pinned memory with ``non_blocking=True`` and an event is recorded
    after it; :meth:`ready` queries the event (it never waits). On the CPU the tensor already
    is in host memory and is ready at once.
    """

    __slots__ = ("_event", "_host")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: Any = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def read(self) -> float:
        """The value (an int for an integer tensor); call only when :meth:`ready` (it is then a
        read of host memory)."""
        return self._host.item()


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceSkips:
    """The bookkeeping of a step whose skip decision stays on the device (kept in
    ``TrainState.device_skips``; replaced, never changed, by each update).

    Attributes:
        position: the scheduler's position (``LambdaLR.last_epoch``) as a 0-dim int64 device
            tensor, advanced by applied updates only; ``None`` without a scheduler.
        bound: the largest value ``position`` can hold (it starts at the scheduler's position
            and every update may add one), known on the host.
        lr_table: ``[rows, param groups]`` learning rates on the device, row ``p`` holding the
            rates at position ``p``; rows up to ``bound`` are filled. ``None`` without a
            scheduler.
        pending: the host copy of ``consecutive_skips`` not yet checked against
            ``max_consecutive``, or ``None``.
    """

    position: torch.Tensor | None
    bound: int
    lr_table: torch.Tensor | None
    pending: HostCopy | None

    def settle(self, scheduler: Any) -> None:
        """Set the host-side ``LambdaLR`` to the position on the device (one host read); what
        ``TrainState.settle_scheduler`` calls.

        Example:
            >>> import torch
            >>> from steplib import TrainState, make_train_step, skip_nonfinite
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
            >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5**n)
            >>> state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
            >>> step = skip_nonfinite(make_train_step(lambda m, b: m(b).sum()))
            >>> state, out = step(state, torch.ones(1, 2))
            >>> sched.last_epoch  # the position is on the device
            0
            >>> state.settle_scheduler()
            >>> sched.last_epoch, sched.get_last_lr()
            (1, [0.05])
        """
        if self.position is None:
            return
        position = int(self.position)
        # Through the scheduler's own state format: what stepping it once per applied update
        # would have left (a fresh scheduler steps once when it is built, hence the + 1).
        settled = scheduler.state_dict()
        settled.update(
            last_epoch=position, _last_lr=lr_row(scheduler, position), _step_count=position + 1
        )
        scheduler.load_state_dict(settled)


def lr_row(scheduler: Any, position: int) -> list[float]:
    """The learning rates ``LambdaLR`` sets at ``position``: its own formula."""
    return [
        base * fn(position)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]


def start(optimizer: torch.optim.Optimizer, scheduler: Any, device: torch.device) -> DeviceSkips:
    """The bookkeeping for the first update decided on the device; without a scheduler there is
    nothing to tabulate. With one, each group's ``lr`` becomes a device tensor (float64 on the
    CPU, as exact as the float it replaces; float32 on CUDA, the dtype fused CUDA kernels read)
    that later updates refill from the table."""
    if scheduler is None:
        return DeviceSkips(position=None, bound=0, lr_table=None, pending=None)
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            # torch.full is a fill kernel; torch.tensor would be a blocking host-to-device copy.
            group["lr"] = torch.full((), lr, dtype=dtype, device=device)
        elif lr.device != device or lr.dtype != dtype:  # e.g. loaded from a checkpoint
            group["lr"] = lr.to(device=device, dtype=dtype)
    position = scheduler.last_epoch
    rows = max(64, 2 * (position + 1))
    table = torch.empty((rows, len(optimizer.param_groups)), dtype=torch.float64, device=device)
    _fill_row(table, position, lr_row(scheduler, position))
    return DeviceSkips(
        position=torch.full((), position, dtype=torch.int64, device=device),
        bound=position,
        lr_table=table,
        pending=None,
    )


def _fill_row(table: torch.Tensor, row: int, values: list[float]) -> None:
    host = torch.tensor(values, dtype=table.dtype, pin_memory=table.device.type == "cuda")
    table[row].copy_(host, non_blocking=True)


def advance(
    record: DeviceSkips,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    applied: torch.Tensor,
) -> DeviceSkips:
    """After an update whose ``applied`` flag is a device tensor: move the position by it and
    refill the optimizer's ``lr`` tensors from the table row at the new position."""
    if record.position is None or record.lr_table is None:
        return record
    table, bound = record.lr_table, record.bound + 1
    if bound >= table.shape[0]:  # doubling: a device copy at 64, 128, 256, ... updates
        grown = table.new_empty((2 * table.shape[0], table.shape[1]))
        grown[: table.shape[0]].copy_(table)
        table = grown
    # Row `bound` is a pure function of its index, so writing it again (a notebook re-running a
    # cell from an older state) writes the same values: older states are not changed.
    _fill_row(table, bound, lr_row(scheduler, bound))
    position = record.position + applied.to(torch.int64)
    row = table.index_select(0, position.view(1))[0]
    lrs = [group["lr"] for group in optimizer.param_groups]
    values = [value.to(lr.dtype) for value, lr in zip(row.unbind(), lrs, strict=True)]
    torch._foreach_copy_(lrs, values)
    return dataclasses.replace(record, position=position, bound=bound, lr_table=table)


def check_consecutive(
    record: DeviceSkips, consecutive: torch.Tensor, limit: int
) -> tuple[DeviceSkips, int | None]:
    """Read the host copy of an earlier ``consecutive_skips`` if it has landed, and post a copy
    of this update's. Returns the record and a count read that exceeds ``limit``, else ``None``.
    On the CPU a copy lands at once, so the count read is this update's."""
    pending = record.pending
    if pending is None:
        pending = HostCopy(consecutive)
    elif pending.ready():  # an earlier copy landed: check it, then copy this update's
        seen = int(pending.read())
        if seen > limit:
            return dataclasses.replace(record, pending=None), seen
        pending = HostCopy(consecutive)
    if pending.ready():  # at once on the CPU
        seen = int(pending.read())
        return dataclasses.replace(record, pending=None), (seen if seen > limit else None)
    return dataclasses.replace(record, pending=pending), None


def count(
    state: TrainState, applied: torch.Tensor, limit: int | None
) -> tuple[DeviceSkips, dict[str, Any], int | None]:
    """After an update decided on the device: the new record (the scheduler's position moved
    by ``applied``), the skip counters as device tensors, and a consecutive-skip count read
    back that exceeds ``limit`` (else ``None``)."""
    record = state.device_skips or start(state.optimizer, state.scheduler, state.device)
    record = advance(record, optimizer=state.optimizer, scheduler=state.scheduler, applied=applied)
    skipped = (~applied).to(torch.int64)
    consecutive = (state.consecutive_skips + skipped) * skipped
    seen = None
    if limit is not None:
        record, seen = check_consecutive(record, consecutive, limit)
    counters = {
        "skipped_updates": state.skipped_updates + skipped,
        "consecutive_skips": consecutive,
    }
    return record, counters, seen

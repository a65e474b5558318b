"""Skipping an update without reading the decision on the host, and the memory that needs.

A step that may skip (a float16 ``GradScaler``, ``skip_nonfinite``, or a token-weighted window
that may hold no targets) knows whether to skip only as a device tensor. Reading it on the host
(``bool(flag)``) stalls a GPU step until every queued kernel has run. Three things need the
decision, and each is moved onto the device when the optimizer and the scheduler allow it:

* **the optimizer update**: torch's fused optimizers (``fused=True``: Adam, AdamW, SGD, Adagrad)
  take a ``found_inf`` tensor and skip the update inside their kernel, step counter included
  (the same mechanism ``GradScaler.step`` uses for them);
* **the learning rate**: a ``LambdaLR`` is a function of its position, so its rates are put in
  a table on the device, one row per position, and the position is a device counter advanced
  only by applied updates; the optimizer's ``lr`` becomes a tensor that is refilled from that
  table. The scheduler object is set to the position once a host copy of it has landed (on the
  CPU at once, so after every call; on CUDA an update or two later, never waited for);
* **the skip counters**: ``skipped_updates`` / ``consecutive_skips`` are device tensors; the
  ``max_consecutive`` limit is checked on a host copy of the counter once that copy has landed
  (:class:`HostCopy`: a CUDA event is queried, never waited on), so on CUDA the error can come
  an update or two late; those updates were skipped too.

The position, the table and the copies in flight are this memory's (:class:`SkipMemory`, one
per step, as a compiled step's caches are its runner's), kept per optimizer and held weakly:
the state carries none of it. Any other optimizer or scheduler keeps the host read, once per
update (torch's own ``GradScaler.step`` does the same for non-fused optimizers).
:func:`decides_on_device` says which.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from steplib.errors import EmptyWindowError

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

    def wait(self) -> None:
        """Wait until the copy has landed (a host wait: only where a value is needed now)."""
        if self._event is not None:
            self._event.synchronize()

    def read(self) -> Any:
        """The value as Python numbers (an int for an integer tensor, nested lists for a
        tensor of several elements); call only when :meth:`ready` (it is then a read of host
        memory)."""
        return self._host.tolist()


@dataclasses.dataclass
class _Schedule:
    """One ``LambdaLR``'s position kept on the device.

    Attributes:
        position: the position (``last_epoch``) as a 0-dim int64 device tensor, advanced by
            applied updates only.
        bound: the largest value ``position`` can hold (it starts at the scheduler's position
            and every update may add one), known on the host.
        table: ``[rows, param groups]`` learning rates on the device, row ``p`` holding the
            rates at position ``p``; rows up to ``bound`` are filled.
        written: the position last set on the scheduler object: another value there means it
            was set from outside (a checkpoint loaded), and the device position starts again.
        landing: host copies of ``position`` not yet set on the scheduler, oldest first.
    """

    position: torch.Tensor
    bound: int
    table: torch.Tensor
    written: int
    landing: list[HostCopy] = dataclasses.field(default_factory=list)


class SkipMemory:
    """What a step whose skip decisions stay on the device remembers between updates, per
    optimizer: the scheduler's position on the device (:class:`_Schedule`) and the host copies
    in flight (:meth:`landed`: skips in a row, window counts, a sweep's stopped copies).
    Mutable on purpose, and the step's (``step.plan.skips``), never the state's."""

    def __init__(self) -> None:
        self._schedules: weakref.WeakKeyDictionary[Any, _Schedule] = weakref.WeakKeyDictionary()
        self._zeros: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()
        # the last count of skips in a row computed on the host, with the tensor that holds it
        self._host_counts: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, int]] = (
            weakref.WeakKeyDictionary()
        )
        # host copies in flight, per optimizer and kind of value (see landed)
        self._posted: weakref.WeakKeyDictionary[Any, dict[str, list[tuple[HostCopy, int]]]] = (
            weakref.WeakKeyDictionary()
        )

    def zero(self, optimizer: Any, device: torch.device) -> torch.Tensor:
        """``consecutive_skips`` after an applied update: one zero per optimizer, made once
        (a counter is replaced, never changed in place), so an update makes no kernel for it."""
        zero = self._zeros.get(optimizer)
        if zero is None or zero.device != device:
            zero = self._zeros[optimizer] = torch.zeros((), dtype=torch.int64, device=device)
        return zero

    def advance(self, optimizer: torch.optim.Optimizer, scheduler: Any, applied: Any) -> None:
        """After an update decided on the device (``applied`` a bool tensor): move the
        scheduler's position by it, refill the optimizer's ``lr`` tensors from the table row at
        the new position, and set the landed positions on the scheduler object."""
        if scheduler is None:
            return
        schedule = self._schedules.get(scheduler)
        if schedule is None or schedule.written != scheduler.last_epoch:
            schedule = self._schedules[scheduler] = _start(optimizer, scheduler)
        table, bound = schedule.table, schedule.bound + 1
        if bound >= table.shape[0]:  # doubling: a device copy at 64, 128, 256, ... updates
            grown = table.new_empty((2 * table.shape[0], table.shape[1]))
            grown[: table.shape[0]].copy_(table)
            table = grown
        _fill_row(table, bound, lr_row(scheduler, bound))
        position = schedule.position + applied.to(torch.int64)
        row = table.index_select(0, position.view(1))[0]
        lrs = [group["lr"] for group in optimizer.param_groups]
        values = [value.to(lr.dtype) for value, lr in zip(row.unbind(), lrs, strict=True)]
        torch._foreach_copy_(lrs, values)
        schedule.position, schedule.bound, schedule.table = position, bound, table
        schedule.landing.append(HostCopy(position))
        landed = None
        while schedule.landing and schedule.landing[0].ready():  # in order; on the CPU at once
            landed = int(schedule.landing.pop(0).read())
        if landed is not None and landed != schedule.written:
            _set_position(scheduler, landed)
            schedule.written = landed

    def written(self, scheduler: Any) -> int | None:
        """The position this memory last set on ``scheduler`` (``None``: it keeps none): the
        object holds another only if something else set it."""
        schedule = self._schedules.get(scheduler)
        return None if schedule is None else schedule.written

    def settle(self, scheduler: Any) -> None:
        """Set the scheduler object to its device position now, waiting for the last host copy:
        what a checkpoint saves must be the position, not one an update or two old."""
        schedule = self._schedules.get(scheduler)
        if schedule is None or not schedule.landing:
            return
        schedule.landing[-1].wait()
        landed = int(schedule.landing[-1].read())
        schedule.landing.clear()
        if landed != schedule.written:
            _set_position(scheduler, landed)
            schedule.written = landed

    def check_not_empty(self, optimizer: Any, targets: torch.Tensor, step: int) -> None:
        """Post a host copy of an applied window's target count and read those that have
        landed (on the CPU at once): a window that held none was updated, and is an error.

        Raises:
            EmptyWindowError: a landed count is 0 (the update it names was applied).
        """
        for count, update in self.landed(optimizer, "targets", targets, step + 1):
            if count <= 0:
                self.forget(optimizer, "targets")
                raise EmptyWindowError(
                    f"update {update} was made from a window that held no targets (its "
                    "num_targets summed to 0, e.g. all padding): its gradients were zero, yet "
                    f"{type(optimizer).__name__} moved the parameters (momentum, weight decay) "
                    "and the scheduler advanced. This optimizer cannot skip an update on the "
                    "device. Create it with fused=True (it then skips inside its kernel, no "
                    "host read), or wrap the step with skip_nonfinite(step) (the decision is "
                    "then read on the host once per update), or drop empty batches from the data."
                )

    def landed(
        self, optimizer: Any, what: str, tensor: torch.Tensor, update: int
    ) -> list[tuple[Any, int]]:
        """Post a host copy of ``tensor``, made by ``update``, and return the values of the
        copies that have landed, oldest first, each with its update (on the CPU this one, at
        once; on CUDA an update or two later, never waited for). ``what`` names the values:
        one line of copies in flight per optimizer and name."""
        in_flight = self._posted.setdefault(optimizer, {}).setdefault(what, [])
        in_flight.append((HostCopy(tensor), update))
        values = []
        while in_flight and in_flight[0][0].ready():
            copy, made_at = in_flight.pop(0)
            values.append((copy.read(), made_at))
        return values

    def forget(self, optimizer: Any, what: str) -> None:
        """Drop the host copies of ``what`` in flight: one of them raised, and the others are
        of the updates that led to it (read, they would raise again at the next call)."""
        self._posted.get(optimizer, {}).pop(what, None)

    def too_many(
        self, state: Any, consecutive: torch.Tensor, limit: int, *, on_host: bool
    ) -> tuple[int, int] | None:
        """The first count of skips in a row above ``limit`` known on the host and the update
        that made it (``state.step`` after it, as the other step errors name it), else ``None``.

        A skip decided on the host (``on_host``) after a count the host knows (this memory's
        zero, the one zero of ``TrainState.create``, or a count it computed) is counted there:
        the decision was the update's one read. Otherwise a host copy of ``consecutive`` is
        posted and those that have landed are read, in order (on the CPU at once)."""
        optimizer, before, update = state.optimizer, state.consecutive_skips, state.step + 1
        if on_host:
            known = self._host_counts.get(optimizer)
            if before is self._zeros.get(optimizer) or before is state.skipped_updates:
                count: int | None = 1
            elif known is not None and known[0] is before:
                count = known[1] + 1
            else:
                count = None
            if count is not None:
                self._host_counts[optimizer] = (consecutive, count)
                return (count, update) if count > limit else None
        for seen, made_at in self.landed(optimizer, "consecutive", consecutive, update):
            if seen > limit:
                self.forget(optimizer, "consecutive")
                return seen, made_at
        return None


def lr_row(scheduler: Any, position: int) -> list[float]:
    """The learning rates ``LambdaLR`` sets at ``position``: its own formula."""
    return [
        base * fn(position)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]


def _set_position(scheduler: Any, position: int) -> None:
    # Through the scheduler's own state format: what stepping it once per applied update would
    # have left (a fresh scheduler steps once when it is built, hence the + 1).
    settled = scheduler.state_dict()
    settled.update(
        last_epoch=position, _last_lr=lr_row(scheduler, position), _step_count=position + 1
    )
    scheduler.load_state_dict(settled)


def _start(optimizer: torch.optim.Optimizer, scheduler: Any) -> _Schedule:
    """The device position for the first update decided on the device (or the first after the
    scheduler was set from outside). Each group's ``lr`` becomes a device tensor (float64 on the
    CPU, as exact as the float it replaces; float32 on CUDA, the dtype fused CUDA kernels read)
    that later updates refill from the table."""
    device = optimizer.param_groups[0]["params"][0].device
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
    return _Schedule(
        position=torch.full((), position, dtype=torch.int64, device=device),
        bound=position,
        table=table,
        written=position,
    )


def _fill_row(table: torch.Tensor, row: int, values: list[float]) -> None:
    host = torch.tensor(values, dtype=table.dtype, pin_memory=table.device.type == "cuda")
    table[row].copy_(host, non_blocking=True)

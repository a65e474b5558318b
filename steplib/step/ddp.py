"""``ddp_wrap``: DistributedDataParallel with gradient all-reduce only on the last micro-batch.

The wrapper owns the whole micro-step: forward *and* backward of a non-final micro-batch run
inside ``model.no_sync()`` (a forward outside it with a backward inside leaves DDP's reducer in
the wrong state: gradients silently synchronised too early or not at all).

Token weighting across ranks: each rank's window loss sum and target count are summed over all
ranks in one small all-reduce on the device (no host sync); DDP has averaged the gradients over
the ``W`` ranks, so they are divided by ``global_targets / W``, which makes 2 ranks x k
micro-batches equal one batch of all the data, whatever the counts per rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from steplib.distributed.collectives import sum_window
from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.core import Step, add_part
from steplib.step.parts import GradSync, Part


class RankSync(GradSync):
    """Shared by DDP and FSDP2: the window's loss sum and target count summed over the ranks
    (one small all-reduce on the device), gradients averaged over the ranks by the wrapper."""

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        total, count = sum_window(loss_sum, targets)
        return total, count, dist.get_world_size()

    def describe(self) -> dict[str, Any]:
        return {"world_size": dist.get_world_size()}


class DdpSync(RankSync):
    """The ``GradSync`` of ``ddp_wrap``: a manual all-reduce for a window closed by ``flush``."""

    def sync_unsynced(self, state: TrainState) -> None:
        # The data ended mid-window: the last backward ran under no_sync. Average the gradients
        # as DDP's reducer would have (every parameter, so every rank sends the same layout).
        params = [p for p in _ddp_model(state).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for grad, synced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(synced)  # type: ignore[union-attr]


def _no_sync(state: TrainState, sync: bool) -> contextlib.AbstractContextManager[Any]:
    # Around forward *and* backward: DDP's reducer must see both inside no_sync.
    model = _ddp_model(state)
    return contextlib.nullcontext() if sync else model.no_sync()


def ddp_wrap(step: Step) -> Step:
    """Run the step under DistributedDataParallel; synchronise gradients once per update.

    The state's model must be a ``DistributedDataParallel`` module
    (``steplib.distributed.apply_ddp(model)`` or ``DistributedDataParallel(model)``), and the
    default process group must be initialised before the step is built. Apply ``ddp_wrap``
    after the other wrappers: it checks, with one collective, that every rank built the same
    composition (a mismatch would otherwise hang or silently diverge).

    Args:
        step: the step to wrap.

    Returns:
        The wrapped step.

    Raises:
        ConfigError: no initialised process group; ``step`` already distributed; the ranks
            built different compositions. Calling the step with a model that is not wrapped
            in ``DistributedDataParallel`` raises ``ConfigError`` naming the call to make.

    Example:
        In one process without a process group, the wrapper refuses when the step is built
        (not at the first update):

        >>> import torch
        >>> from steplib import make_train_step
        >>> step = make_train_step(lambda model, batch: model(batch).pow(2).mean())
        >>> ddp_wrap(step)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: ddp_wrap needs an initialised default process group, ...

        Under ``torchrun`` (see ``tests/test_law6_ddp_equals_one_process.py``):

        >>> steplib.distributed.init_distributed()  # doctest: +SKIP
        >>> model = steplib.distributed.apply_ddp(model)  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> state = TrainState.create(model=model, optimizer=optimizer)  # doctest: +SKIP
        >>> step = ddp_wrap(clip(make_train_step(loss_fn), max_norm=1.0))  # doctest: +SKIP
    """
    part = Part(name="ddp_wrap", micro_context=_no_sync, sync=DdpSync())
    return check_distributed_step(step, part)


def check_distributed_step(step: Step, part: Part) -> Step:
    """``step`` with ``part`` added, once every rank is known to have built the same
    composition (one collective at build time; a mismatch would otherwise hang or silently
    diverge). Shared by ``ddp_wrap`` and ``fsdp_wrap``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{part.name} needs an initialised default process group, and none is. Launch with "
            "torchrun and call steplib.distributed.init_distributed() (or "
            "torch.distributed.init_process_group(...)) before building the step."
        )
    wrapped = add_part(step, part)
    mine = wrapped.describe()
    compositions: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(compositions, mine)  # once, at build time: a host sync is fine here
    for rank, theirs in enumerate(compositions):
        if theirs != mine:
            raise ConfigError(
                f"{part.name}: rank {dist.get_rank()} built the step {mine} but rank {rank} "
                f"built {theirs}. Every rank must compose the same wrappers with the same "
                "settings (build the step from the same code and configuration on every rank)."
            )
    return wrapped


def _ddp_model(state: TrainState) -> DistributedDataParallel:
    model = state.model
    if not isinstance(model, DistributedDataParallel):
        raise ConfigError(
            f"ddp_wrap: the state's model is a {type(model).__name__}, not a "
            "DistributedDataParallel module, so gradients would never be synchronised. Wrap it "
            "before creating the state: model = steplib.distributed.apply_ddp(model) (or "
            "DistributedDataParallel(model)), then TrainState.create(model=model, ...)."
        )
    return model

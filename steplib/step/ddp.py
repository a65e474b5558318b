"""``ddp_wrap``: DistributedDataParallel with gradient all-reduce only on the last micro-batch.

The wrapper owns the whole micro-step: forward *and* backward of a non-final micro-batch run
inside ``model.no_sync()`` (a forward outside it with a backward inside leaves DDP's reducer in
the wrong state: gradients silently synchronised too early or not at all).

Token weighting across ranks: each rank's window loss sum and target count are summed over all
ranks in one small all-reduce on the device (no host sync); DDP has averaged the gradients over
the ``W`` ranks, so they are divided by ``global_targets / W``, which makes 2 ranks x k
micro-batches equal one batch of all the data, whatever the counts per rank.

With several models under DDP (a GAN, one step each), see ``steplib.step.ddp_models``: the
other steps' models stay under ``no_sync``, and a model fed from an earlier step is averaged
by hand.
"""

from __future__ import annotations

import contextlib
from typing import Any

from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.core import Step
from steplib.step.ddp_models import average_grads, check_synced, ddp_models, several_models
from steplib.step.parts import Part
from steplib.step.ranks import RankSync, check_distributed_step


class DdpSync(RankSync):
    """The ``GradSync`` of ``ddp_wrap``: a manual all-reduce for a window closed by ``flush``."""

    def sync_unsynced(self, state: TrainState) -> None:
        # The data ended mid-window: the last backward ran under no_sync.
        average_grads(ddp_models(state)[0])


def _no_sync(state: TrainState, sync: bool) -> contextlib.AbstractContextManager[Any]:
    # Around forward *and* backward: DDP's reducer must see both inside no_sync.
    mine, others = ddp_models(state)  # first: an unwrapped model is refused on every call
    _refuse_static_graph(others if sync else [*mine, *others])
    if sync:  # once per window: an unfreeze since DDP was built is refused before it syncs
        check_synced(mine)
    if others:
        return several_models(mine, others, sync)
    if sync:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for model in mine:
        stack.enter_context(model.no_sync())
    return stack


def _refuse_static_graph(under_no_sync: list[Any]) -> None:
    """Refuse a DDP module built with ``static_graph=True`` that is about to run under
    ``no_sync`` (``apply_ddp`` refuses it when it is built; ``DistributedDataParallel(...)``
    does not)."""
    if any(model.static_graph for model in under_no_sync):
        raise ConfigError(
            "ddp_wrap: a DistributedDataParallel module built with static_graph=True is about "
            "to run a micro-batch under no_sync (accumulation, or another step's model): "
            "torch's reducer then fails (torch 2.13: 'expect_autograd_hooks_ INTERNAL ASSERT "
            "FAILED'), and some torch versions silently stop averaging the gradients. Build it "
            "without static_graph: model = steplib.distributed.apply_ddp(model)."
        )


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

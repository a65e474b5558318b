"""``fsdp_wrap``: FSDP2 (``fully_shard``) with gradient reduce-scatter only on the last
micro-batch of a window, or on every one (``reduce_every_micro_batch=True``).

Memory trade-off: with gradient sync off, FSDP2 keeps each micro-batch's gradients
*unsharded* until the window's last backward reduce-scatters them, so accumulation costs a full
copy of the gradients per rank (what sharding otherwise saves) in exchange for one
reduce-scatter per update instead of one per micro-batch. With little memory to spare, pass
``reduce_every_micro_batch=True`` (torchtitan's choice: k reduce-scatters, sharded gradients
accumulate), or use ``accumulate(step, 1)`` and larger micro-batches. Not wrapping is no
option: each rank would divide its gradients by its own window's count.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.core import Step
from steplib.step.parts import Part
from steplib.step.ranks import RankSync, check_distributed_step


def _gradient_sync(state: TrainState, sync: bool) -> contextlib.AbstractContextManager[Any]:
    # A setting, not a context: each micro-batch sets it, so the last one turns sync back on.
    _fsdp_model(state).set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _always_sync(state: TrainState, sync: bool) -> contextlib.AbstractContextManager[Any]:
    # Every micro-batch reduce-scatters (FSDP2 adds the shards up): nothing is left unsynced.
    return _gradient_sync(state, True)


class FsdpSync(RankSync):
    """The ``GradSync`` of ``fsdp_wrap``."""

    def sync_unsynced(self, state: TrainState) -> None:
        raise ConfigError(
            "fsdp_wrap cannot close a window after the data ended: FSDP2 holds the last "
            "micro-batch's gradients unsharded and has no public call to reduce-scatter them "
            "afterwards. Close the window on the last batch instead: give run() sized data "
            "(a DataLoader with a length), or call step(state, batch, close_window=True), or "
            "reduce-scatter every micro-batch: fsdp_wrap(step, reduce_every_micro_batch=True)."
        )


class FsdpSyncEach(RankSync):
    """The ``GradSync`` of ``fsdp_wrap(..., reduce_every_micro_batch=True)``: every gradient
    is reduce-scattered by its own backward, so a window closed after the data ended has none
    left to sync."""


def fsdp_wrap(step: Step, *, reduce_every_micro_batch: bool = False) -> Step:
    """Run the step on an FSDP2-sharded model; reduce-scatter gradients once per update.

    The state's model must be sharded by ``steplib.distributed.apply_fsdp(model)`` (or
    ``fully_shard``) and the optimizer built from it afterwards. Token-weighted accumulation is
    exact across ranks, as with ``ddp_wrap``; clipping computes the global norm of the sharded
    gradients.

    Args:
        step: the step to wrap.
        reduce_every_micro_batch: reduce-scatter after every micro-batch's backward and keep
            only the sharded gradients (torchtitan's train step: less memory, k reduce-scatters
            an update) instead of once per update from unsharded gradients. The same update up
            to the order of the sums (rank then micro-batch, instead of micro-batch then rank).

    Returns:
        The wrapped step.

    Raises:
        ConfigError: no initialised process group, a step already distributed, ranks with
            different compositions; on the first call, a model that is not sharded.

    Example:
        In one process without a process group, the wrapper refuses when the step is built
        (not at the first update):

        >>> import torch
        >>> from steplib import make_train_step
        >>> step = make_train_step(lambda model, batch: model(batch).pow(2).mean())
        >>> fsdp_wrap(step)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: fsdp_wrap needs an initialised default process group, ...

        Under ``torchrun`` (see ``tests/test_law6_fsdp_equals_one_process.py``):

        >>> steplib.distributed.init_distributed()  # doctest: +SKIP
        >>> model = steplib.distributed.apply_fsdp(model, blocks=model.layers)  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> state = TrainState.create(model=model, optimizer=optimizer)  # doctest: +SKIP
        >>> step = fsdp_wrap(clip(make_train_step(loss_fn), max_norm=1.0))  # doctest: +SKIP
    """
    if reduce_every_micro_batch:
        part = Part(
            name="fsdp_wrap",
            settings={"reduce_every_micro_batch": True},
            micro_context=_always_sync,
            sync=FsdpSyncEach(),
        )
    else:
        part = Part(name="fsdp_wrap", micro_context=_gradient_sync, sync=FsdpSync())
    return check_distributed_step(step, part)


def _fsdp_model(state: TrainState) -> Any:
    from torch.distributed.fsdp import FSDPModule

    model = state.model
    if isinstance(model, torch.nn.ModuleDict) and not isinstance(model, FSDPModule):
        raise ConfigError(
            f"fsdp_wrap: the state holds several models ({', '.join(model)}), and fsdp_wrap "
            "trains one FSDP2-sharded model. Train several models on several ranks under DDP: "
            "model={'G': apply_ddp(g), 'D': apply_ddp(d)} and ddp_wrap(step) for each step "
            "(docs/several_models.md)."
        )
    if not isinstance(model, FSDPModule):
        raise ConfigError(
            f"fsdp_wrap: the state's model is a {type(model).__name__}, not an FSDP2-sharded "
            "module. Shard it before building the optimizer and the state: "
            "model = steplib.distributed.apply_fsdp(model, blocks=model.layers)."
        )
    return model

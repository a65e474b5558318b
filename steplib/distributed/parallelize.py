"""Applying data parallelism is a function on the model, not a flag on a trainer.

The order that matters: activation checkpointing, then ``torch.compile`` of the blocks, then
sharding (``apply_fsdp``) or replication (``apply_ddp``); build the optimizer *after*, from the
wrapped model's parameters (FSDP2 replaces them with sharded DTensors).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from steplib.errors import ConfigError


def _require_group(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{what} needs an initialised process group. Call "
            "steplib.distributed.init_distributed() first (under torchrun or srun)."
        )


def apply_ddp(model: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap ``model`` in ``DistributedDataParallel`` on this rank's device.

    Args:
        model: the module, already on its device (``cuda:<local_rank>`` or CPU).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).
            ``static_graph=True`` is refused: with ``no_sync`` some torch versions silently
            stop averaging gradients.

    Returns:
        The DDP module; pass it to ``TrainState.create`` and build the optimizer from it.

    Raises:
        ConfigError: no process group, or ``static_graph=True``.

    Example:
        In one process without a process group, it refuses (before touching the model):

        >>> import torch
        >>> apply_ddp(torch.nn.Linear(4, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: apply_ddp needs an initialised process group. ...

        Under ``torchrun`` (see ``tests/test_law6_ddp_equals_one_process.py``):

        >>> steplib.distributed.init_distributed()  # doctest: +SKIP
        >>> model = apply_ddp(build_model().to(device))  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    """
    _require_group("apply_ddp")
    if ddp_kwargs.get("static_graph"):
        raise ConfigError(
            "apply_ddp(static_graph=True) is refused: combined with no_sync during gradient "
            "accumulation, some torch versions silently stop averaging gradients. Drop it."
        )
    device = next(model.parameters()).device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, **ddp_kwargs)


def apply_fsdp(
    model: nn.Module,
    *,
    blocks: Iterable[nn.Module] = (),
    mp_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    Each module in ``blocks`` (e.g. the transformer layers) is sharded as its own unit, then the
    root, so that only one block's parameters are gathered at a time.

    Args:
        model: the module to shard, in place.
        blocks: sub-modules to shard individually, before the root.
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (e.g. bf16 parameters, fp32 reduction).
        reshard_after_forward: free gathered parameters after forward (less memory, one more
            all-gather in backward).

    Returns:
        The same module, now an ``FSDPModule``; build the optimizer from it afterwards.

    Raises:
        ConfigError: no process group.

    Example:
        In one process without a process group, it refuses (the model is left as it was):

        >>> import torch
        >>> apply_fsdp(torch.nn.Linear(4, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: apply_fsdp needs an initialised process group. ...

        Under ``torchrun`` (see ``tests/test_law6_fsdp_equals_one_process.py``):

        >>> steplib.distributed.init_distributed()  # doctest: +SKIP
        >>> model = apply_fsdp(model, blocks=model.layers)  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    """
    _require_group("apply_fsdp")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def holds_dtensor_parameters(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2 shards, tensor parallel), each rank a
    share of them."""
    # No DTensor exists before its module is imported: a plain model need not import it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(p, module.DTensor) for p in model.parameters())


def is_parallel_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is wrapped by DDP or sharded by FSDP2.

    Args:
        model: any module.

    Returns:
        ``True`` for a ``DistributedDataParallel`` module or an ``FSDPModule`` (what
        :func:`apply_ddp` and :func:`apply_fsdp` return), else ``False`` (a plain module, or
        one parallelised by ``apply_tp`` only).

    Example:
        >>> import torch
        >>> is_parallel_model(torch.nn.Linear(4, 2))
        False
    """
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, DistributedDataParallel | FSDPModule)


def inner_module(model: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile`` wrappers, in any nesting: the one whose
    parameter names carry no ``module.`` / ``_orig_mod.`` prefix.

    Args:
        model: any module.

    Returns:
        ``model`` itself when nothing wraps it.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> inner_module(torch.compile(layer)) is layer
        True
    """
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner, nn.Module):
            model = inner
        else:
            return model


def plain_name(model: nn.Module, name: str) -> str:
    """The name of a parameter or submodule of ``model`` without the ``module.`` and
    ``_orig_mod.`` that DDP and ``torch.compile`` wrappers put in it, at any depth (a
    ``ModuleDict`` of DDP models too): how DCP names it, so that what a checkpoint records by
    name finds its module on another world size, wrapped otherwise.

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(2, 1))
        >>> plain_name(torch.compile(layer), "_orig_mod.0.weight")
        '0.weight'
    """
    module: Any = model
    kept = []
    for part in name.split(".") if name else ():
        inner = getattr(module, "_orig_mod", None) if part == "_orig_mod" else None
        ddp = part == "module" and isinstance(module, DistributedDataParallel)
        if not (ddp or isinstance(inner, nn.Module)):
            kept.append(part)
        module = getattr(module, part, None)
    return ".".join(kept)

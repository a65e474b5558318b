"""The whole weights of a model on rank 0, however the ranks hold them: gathered from FSDP2
shards, from the ranks' parts of a model split among them (pipeline stages), or read on rank 0
where every rank holds the same model. What :func:`steplib.handlers.export_model` writes.

Imports ``state``, ``errors`` and ``distributed`` only.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from steplib.distributed import rank, world_size
from steplib.distributed.parallelize import holds_dtensor_parameters, inner_module
from steplib.errors import ConfigError, describe
from steplib.state import TrainState


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of ``model`` on CPU, on rank 0 (``{}`` on the other ranks).

    With a process group of several ranks it is a collective: call it on every rank.
    FSDP2-sharded parameters are gathered with
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict``. Otherwise the ranks
    compare the names they hold (one ``all_gather_object``): where every rank holds the same
    ones (replicated, DDP) rank 0's are the model's; where the ranks hold different parts
    (pipeline stages, one per process) each rank's part is gathered onto rank 0, so that no
    stage is left out.

    Args:
        model: the module (DDP's and ``torch.compile``'s wrappers are looked through).

    Returns:
        ``{name: tensor}`` with detached CPU tensors on rank 0; ``{}`` on the other ranks.

    Raises:
        ConfigError: the ranks hold different parts of the model and two of them hold the
            same name (raised on every rank).

    Example:
        >>> sorted(full_state_dict(torch.nn.BatchNorm1d(2)))
        ['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight']
    """
    model = exported_module(model)
    if holds_dtensor_parameters(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        gathered = get_model_state_dict(model, options=options)
        return cast(dict[str, torch.Tensor], gathered)  # a model's state: tensors only
    if world_size() > 1 and not _same_names_on_every_rank(model):
        return _parts_gathered(model)
    if rank() != 0:
        return {}
    return _on_cpu(model)


def _on_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}


def _same_names_on_every_rank(model: nn.Module) -> bool:
    """Whether every rank holds the same ``state_dict`` names (a replicated model), else
    refuse a name held by several ranks of a model split among them. One
    ``all_gather_object`` of the names: rank 0 alone may hold only a part of the model."""
    every: list[Any] = [None] * world_size()
    dist.all_gather_object(every, list(model.state_dict()))
    if all(names == every[0] for names in every):
        return True
    seen: dict[str, int] = {}
    for holder, names in enumerate(every):
        for name in names:
            if name in seen:
                raise ConfigError(
                    f"export_model: the ranks hold different parts of the model, and rank "
                    f"{seen[name]} and rank {holder} both hold {name!r}, so the parts cannot "
                    "be put together into one model. Give each part the whole model's names "
                    "(steplib.distributed.split_model keeps them for pipeline stages)."
                )
            seen[name] = holder
    return False


def _parts_gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's part of the model on rank 0 (``{}`` elsewhere), in rank order."""
    parts: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(_on_cpu(model), parts, dst=0)
    return {} if parts is None else {k: v for part in parts for k, v in part.items()}


def exported_module(state: Any) -> nn.Module:
    """The module ``export_model`` writes: the state's model (or ``state`` itself), with the
    DDP and ``torch.compile`` wrappers looked through."""
    model: Any = state.model if isinstance(state, TrainState) else state
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"export_model received {describe(state)} where a TrainState or an nn.Module was "
            "expected. Pass the state (its model is exported) or the module itself."
        )
    return inner_module(model)  # DDP(compile(m)), compile(DDP(m)), ...

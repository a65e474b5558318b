"""The optimizers of a sharded checkpoint: the state's one optimizer, or its named ones (a GAN
under DDP: ``{"G": opt_g, "D": opt_d}``), each through ``get_optimizer_state_dict`` over the
whole model, whose parameter names (``"D.0.weight"``) say which module a tensor belongs to.

One optimizer keeps the layout it always had (``"optimizer"`` in the DCP tree and in each
rank file); several are keyed by name under ``"optimizers"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.state import TrainState

ONE = "optimizer"
SEVERAL = "optimizers"


def by_name(state: TrainState) -> dict[str | None, torch.optim.Optimizer]:
    """The state's optimizers by name, ``{None: optimizer}`` for a single one."""
    return {name: state[name].optimizer for name in state.names} or {None: state.optimizer}


def keyed(parts: Mapping[str | None, Any]) -> dict[str, Any]:
    """``parts`` (one entry per optimizer, by :func:`by_name`'s names) as a checkpoint stores
    them: ``{"optimizer": part}`` for a single optimizer, ``{"optimizers": {name: part}}``."""
    if None in parts:
        return {ONE: parts[None]}
    return {SEVERAL: dict(parts)}


def unkeyed(tree: Mapping[str, Any]) -> dict[str | None, Any]:
    """The reverse of :func:`keyed`: the parts by optimizer name (``None``: a single one)."""
    if ONE in tree:
        return {None: tree[ONE]}
    return dict(tree.get(SEVERAL, {}))


def describe_info(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a rank file keeps of an optimizer beside its DCP tensors: whether it has state
    yet, its groups' settings and sizes."""
    return {
        "has_state": bool(optimizer.state),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
    }


def state_dicts(model: torch.nn.Module, state: TrainState) -> dict[str, Any]:
    """The DCP tree of every optimizer of ``state`` (keyed as :func:`keyed`).

    ``get_optimizer_state_dict`` initialises an empty optimizer state by stepping it once with
    lr=0, which changes what the next real step computes (Adam's step count). Before an
    optimizer's first update there is no state to save anyway: only its hyperparameters are
    saved (:func:`describe_info`).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return keyed(
        {
            name: get_optimizer_state_dict(model, optimizer) if optimizer.state else {}
            for name, optimizer in by_name(state).items()
        }
    )


def check_names(saved: Mapping[str | None, Any], state: TrainState, *, checkpoint: str) -> None:
    """Raise ``ConfigError`` unless the checkpoint holds the state's optimizers, by name.

    Raises:
        ConfigError: other names, or one optimizer where the state has several (or the reverse).
    """
    names = [name for name in saved if name is not None]
    if names != list(state.names):

        def say(found: list[str]) -> str:
            return f"the optimizers {found}" if found else "one unnamed optimizer"

        raise ConfigError(
            f"load: checkpoint {checkpoint} holds {say(names)}, this state "
            f"{say(list(state.names))}. Create the state as the run that saved it did: "
            "TrainState.create(optimizer=...) with the same names in the same order."
        )


def load_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Load the groups' settings saved before an optimizer's first update (no per-parameter
    state): the optimizer's own ``load_state_dict`` takes them and empties its state, as it
    was."""
    params: list[list[int]] = []
    start = 0
    for group in optimizer.param_groups:
        params.append(list(range(start, start + len(group["params"]))))
        start += len(group["params"])
    optimizer.load_state_dict(
        {
            "state": {},
            "param_groups": [dict(g, params=p) for g, p in zip(groups, params, strict=True)],
        }
    )

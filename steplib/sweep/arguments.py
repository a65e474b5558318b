"""Reading a sweep optimizer's arguments: its parameters (tensors, or parameter groups), a
hyper-parameter as one number for every copy or a sequence of one per copy, and a setting shared
by every copy (``nesterov``, ``decoupled``) as one bool. Each refusal names the argument and the
fix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from steplib.errors import ConfigError, describe


def is_sequence(value: Any) -> bool:
    """Whether ``value`` gives one value per copy (a sequence or a tensor, not a string)."""
    return isinstance(value, Sequence | torch.Tensor) and not isinstance(value, str)


def number(owner: str, name: str, value: Any) -> float:
    """``value`` as a float (a bool, a string or None refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{owner}({name}=...) received {describe(value)}; pass a number, or a list with one "
            f"number per copy, e.g. {name}=[1e-3, 3e-3]."
        )
    return float(value)


def flag(owner: str, name: str, value: Any) -> bool:
    """A setting shared by every copy: a list (one per copy) would be read as True for all."""
    if not isinstance(value, bool):
        raise ConfigError(
            f"{owner}({name}=...) received {describe(value)}; {name} is one bool for every "
            f"copy, {name}=True or {name}=False. To compare both, run two sweeps."
        )
    return value


def per_copy_values(owner: str, name: str, value: Any, n: int) -> list[float]:
    """One float per copy: ``value`` repeated, or its ``n`` values (another length refused)."""
    if not is_sequence(value):
        return [number(owner, name, value)] * n
    values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    if len(values) != n:
        raise ConfigError(
            f"{owner}({name}=...) received {len(values)} values for {n} copies; pass one per "
            f"copy, or a single number for all of them."
        )
    return [number(owner, name, v) for v in values]


def given_groups(owner: str, params: Any) -> list[dict[str, Any]]:
    """``params`` as torch.optim reads it, a list of groups (``{"params": [tensors], ...}``):
    tensors make one group; each group's ``params`` read into a list once (a generator, such as
    ``model.parameters()``, can be read only once)."""
    listable = isinstance(params, Iterable) and not isinstance(params, torch.Tensor | set)
    given = list(params) if listable else None
    if given and all(isinstance(g, dict) for g in given):
        groups = [{**g, "params": tensor_list(g.get("params"))} for g in given]
    else:
        groups = [{"params": tensor_list(given)}]
    if any(g["params"] is None for g in groups) or not any(g["params"] for g in groups):
        raise ConfigError(
            f"{owner} received params={describe(params)}; pass the sweep's parameters, "
            "copies.parameters(), or parameter groups of them: [{'params': [...], "
            "'weight_decay': 0.1}, {'params': [...], 'weight_decay': 0.0}] "
            "(steplib.param_groups.weight_decay_groups(copies, 0.1) makes those two)."
        )
    return groups


def tensor_list(params: Any) -> list[torch.Tensor] | None:
    """``params`` as a list of tensors; ``None`` for anything else (a named pair, a number)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if not isinstance(params, Iterable) or isinstance(params, str | dict | set):
        return None  # a set: its order, so the state's, would change between runs
    listed = list(params)
    return listed if all(isinstance(p, torch.Tensor) for p in listed) else None

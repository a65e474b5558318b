"""Reading a sweep optimizer's arguments: a hyper-parameter is one number for every copy or a
sequence of one per copy, and a setting shared by every copy (``nesterov``, ``decoupled``) is
one bool. Each refusal names the argument and the fix."""

from __future__ import annotations

from collections.abc import Sequence
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

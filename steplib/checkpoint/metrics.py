"""What a checkpoint records with itself: ``default_metrics``, the numbers ``checkpoint_every``
writes into each manifest unless given a ``metrics`` function (``keep_best`` ranks by them).

Imports ``events`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib.events import Event

Metrics = Callable[[Event], Mapping[str, Any]]


def default_metrics(event: Event) -> dict[str, float]:
    """What a checkpoint records when no ``metrics`` function is given: the update's ``loss``
    and every number in ``state.extras`` (where an evaluation handler may put ``val_loss``).

    Args:
        event: the event whose state is saved; its ``output`` (a ``StepOutput``, on
            ``step_end``) gives ``loss``.

    Returns:
        ``{name: float}``: ``"loss"`` when the event carries a step output, and each entry of
        ``state.extras`` that is an int, a float or a one-element tensor (booleans, strings
        and larger tensors are left out). Reading a tensor is a host sync, made at save time
        only.

    Example:
        >>> import types
        >>> state = types.SimpleNamespace(extras={"val_loss": 0.25, "note": "x"})
        >>> default_metrics(Event("step_end", state=state))
        {'val_loss': 0.25}
    """
    numbers: dict[str, float] = {}
    output = getattr(event, "output", None)
    if output is not None and isinstance(getattr(output, "loss", None), torch.Tensor):
        numbers["loss"] = float(output.loss)  # a host sync, at save time only
    for name, value in getattr(event.state, "extras", {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
    return numbers

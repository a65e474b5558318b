"""What a checkpoint records with itself: ``default_metrics``, the numbers ``checkpoint_every``
writes into each manifest unless given a ``metrics`` function (``keep_best`` ranks by them).

Imports ``events`` and ``state`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib.events import Event
from steplib.state import EVALUATED_AT

Metrics = Callable[[Event], Mapping[str, Any]]


def default_metrics(event: Event) -> dict[str, float]:
    """What a checkpoint records when no ``metrics`` function is given: the update's ``loss``
    and every number in ``state.extras`` (where an evaluation handler may put ``val_loss``)
    that belongs to this state: a value an evaluation of an earlier update left there (its
    update is in ``extras["evaluated_at"]``) is not this model's score and is left out.

    Args:
        event: the event whose state is saved; its ``output`` (a ``StepOutput``, on
            ``step_end``) gives ``loss``.

    Returns:
        ``{name: float}``: ``"loss"`` when the event carries a step output, and each entry of
        ``state.extras`` that is an int, a float or a one-element tensor (booleans, strings,
        larger tensors and earlier evaluations' values are left out). Reading a tensor is a
        host sync, made at save time only.

    Example:
        >>> import types
        >>> extras = {"val_loss": 0.25, "note": "x", "evaluated_at": {"val_loss": 4}}
        >>> default_metrics(Event("step_end", types.SimpleNamespace(extras=extras), step=4))
        {'val_loss': 0.25}
        >>> default_metrics(Event("step_end", types.SimpleNamespace(extras=extras), step=5))
        {}
    """
    numbers: dict[str, float] = {}
    output = getattr(event, "output", None)
    loss = getattr(output, "loss", None)
    # A sweep's loss is one per copy: no single number to rank the checkpoint by.
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        numbers["loss"] = float(loss)  # a host sync, at save time only
    extras = getattr(event.state, "extras", {})
    stale = stale_values(extras, event.step)
    for name, value in extras.items():
        if name in stale:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers[name] = float(value)
    return numbers


def stale_values(extras: Mapping[str, Any], step: int) -> set[str]:
    """The names in ``extras`` that an evaluation of another update than ``step`` put there
    (``extras["evaluated_at"]``, which the ``Evaluator`` writes).

    Example:
        >>> sorted(stale_values({"evaluated_at": {"val_loss": 4, "ood_loss": 6}}, 6))
        ['val_loss']
    """
    evaluated = extras.get(EVALUATED_AT, {})
    return {name for name, at in evaluated.items() if at != step}

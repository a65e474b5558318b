"""Moving a batch to the model's device: ``to_device`` and the ``to_device=True`` option of
``make_train_step`` / ``make_eval_step`` (``on_model_device``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor in it moved to ``device``: tensors inside tuples, lists and
    dicts (and named tuples) are moved, anything else is left as it is. A tensor already there
    is not copied; one in pinned memory is copied without blocking the host.

    ``make_train_step(loss_fn, to_device=True)`` and ``make_eval_step(..., to_device=True)``
    call it on every batch, with the model's device.

    Args:
        batch: a tensor, or a (nested) tuple, list or dict holding tensors.
        device: where to move them.

    Returns:
        The batch, in the same structure, on ``device``.

    Example:
        >>> x, meta = to_device((torch.ones(2), {"ids": torch.arange(2), "name": "a"}), "cpu")
        >>> x.device.type, meta["ids"].device.type, meta["name"]
        ('cpu', 'cpu', 'a')
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def on_model_device(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``fn(model, batch)`` called with the batch moved to the model's device (that of its
    first parameter, or buffer): what ``to_device=True`` of ``make_train_step`` and
    ``make_eval_step`` wraps the user's function in.

    Args:
        fn: a ``loss_fn(model, batch)`` or ``eval_fn(model, batch)``.

    Returns:
        The wrapped function, same signature.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> loss_fn = on_model_device(lambda m, b: m(b).sum())
        >>> loss_fn(model, torch.ones(3, 2)).shape
        torch.Size([])
    """

    def on_device(model: Any, batch: Any) -> Any:
        first = next(iter(model.parameters()), None)
        if first is None:
            first = next(iter(model.buffers()), None)
        return fn(model, batch if first is None else to_device(batch, first.device))

    on_device.__wrapped__ = fn  # type: ignore[attr-defined]  # inspect.signature sees fn's
    return on_device

"""Reading what a user's ``loss_fn`` returned, with errors that say what to return instead.

Checks use tensor metadata only (``ndim``, ``dtype``, ``requires_grad``): no host sync.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from steplib.errors import LossFnError, describe

_FORMS = (
    "Return one of: a scalar loss tensor; (loss_sum, num_targets) for a token-weighted loss; "
    "(loss, aux) or (loss_sum, num_targets, aux) where aux is a dict of tensors."
)


NO_AUX: Mapping[str, torch.Tensor] = types.MappingProxyType({})


class LossOutput(NamedTuple):
    """A ``loss_fn`` result in one shape: the loss to back-propagate, its target count, aux;
    and, from a runner that ran phase 2 with the window's closing micro-batch (``compile_step``
    runs them as one graph), that phase's report (a ``steplib.step.parts.GradReport``)."""

    loss_sum: torch.Tensor
    num_targets: torch.Tensor | int
    aux: Mapping[str, torch.Tensor]
    report: Any = None


def parse_loss_output(result: Any) -> LossOutput:
    """Normalise a ``loss_fn`` result; a plain scalar loss counts as one target.

    Raises:
        LossFnError: the result is not one of the accepted forms, the loss is not a scalar
            tensor with a gradient, ``num_targets`` is not an int or a 0-dim tensor of 32 bits
            or more, or ``aux`` is not a mapping of names to tensors.
    """
    if isinstance(result, torch.Tensor):  # the common case first: a plain scalar loss
        _check_loss(result)
        return LossOutput(result, 1, NO_AUX)
    aux: Any = NO_AUX
    count: Any = 1
    form = ""
    if isinstance(result, tuple | list) and len(result) == 2:
        loss, second = result
        if type(second) is dict or isinstance(second, Mapping):  # dict first: ABC checks are slow
            aux, form = second, "(loss, aux)"
        else:
            count, form = second, "(loss_sum, num_targets)"
    elif isinstance(result, tuple | list) and len(result) == 3:
        loss, count, aux = result
        form = "(loss_sum, num_targets, aux)"
    elif isinstance(result, tuple | list):
        raise LossFnError(f"loss_fn returned a sequence of {len(result)} items. {_FORMS}")
    else:
        loss = result  # let _check_loss say what is wrong with it (e.g. a float from .item())
    if form and isinstance(loss, torch.Tensor) and loss.ndim != 0:
        raise LossFnError(_misread_tuple(result, form))
    _check_loss(loss)
    _check_count(count)
    if aux is not NO_AUX:
        _check_aux(aux)
    return LossOutput(loss, count, aux)


def _is_scalar_loss(loss: Any) -> bool:
    return isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()


def _misread_tuple(result: tuple[Any, ...] | list[Any], form: str) -> str:
    """What to say when the first item of a returned tuple is a tensor that is not a scalar:
    the fix depends on how the tuple was read and on the other items, not on the first alone
    ("return loss.mean()" is wrong for nanoGPT's (logits, loss))."""
    first = result[0]
    message = (
        f"loss_fn returned a {type(result).__name__} of {len(result)} items, read as {form}; "
        "its first item must be the scalar loss to back-propagate, and it is a tensor of "
        f"shape {tuple(first.shape)} and dtype {first.dtype}. "
    )
    losses = [
        i for i, item in enumerate(result[1:], 1) if _is_scalar_loss(item) and item.requires_grad
    ]
    if losses:
        # nanoGPT's model(x, y) returns (logits, loss); returned as is, logits read as the loss.
        return message + (
            f"Item {losses[0]} is a scalar with a gradient: if this is a model's output such as "
            "nanoGPT's (logits, loss) = model(x, y), return the loss alone: "
            "`logits, loss = model(x, y); return loss` (or return (loss, {'name': tensor}) to "
            "keep other tensors as aux)."
        )
    return message + (
        "Put the loss first and reduce it to a scalar (loss.mean(), or loss.sum() with "
        "num_targets for token weighting). " + _FORMS
    )


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise LossFnError(
            f"loss_fn returned a loss of {describe(loss)}, not a tensor. Return the loss tensor "
            "itself (not loss.item(), which also costs a host sync). " + _FORMS
        )
    if loss.ndim != 0:
        raise LossFnError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}; a scalar is needed to "
            "back-propagate. Reduce it: return loss.mean(), or (loss.sum(), num_targets) for "
            "token weighting."
        )
    if not loss.is_floating_point():
        raise LossFnError(
            f"loss_fn returned a loss of dtype {loss.dtype}; gradients need a floating-point "
            "loss. Compute it with a floating-point criterion, e.g. F.cross_entropy."
        )
    if not loss.requires_grad:
        raise LossFnError(
            "loss_fn returned a loss that does not require grad, so backward() cannot reach the "
            "parameters. It was computed under torch.no_grad(), detached, or from a model "
            "whose parameters have requires_grad=False: compute it from model(batch) directly."
        )


def _check_count(count: Any) -> None:
    if isinstance(count, bool) or not isinstance(count, int | torch.Tensor):
        raise LossFnError(
            f"loss_fn returned num_targets={describe(count)}; it must be an int or a 0-dim "
            "tensor counting the targets in loss_sum, e.g. (mask.sum(), ...) or labels.numel()."
        )
    if isinstance(count, int) and count < 0:
        # A negative count would turn the update around (the gradient divided by it).
        raise LossFnError(
            f"loss_fn returned num_targets={count}; a count of targets cannot be negative. "
            "Return how many targets loss_sum sums over (0 for a micro-batch with none), e.g. "
            "(loss_sum, int((labels != -100).sum())) or (loss_sum, (labels != -100).sum())."
        )
    if isinstance(count, torch.Tensor) and (count.ndim != 0 or count.dtype == torch.bool):
        raise LossFnError(
            f"loss_fn returned num_targets as a tensor of shape {tuple(count.shape)} and dtype "
            f"{count.dtype}; it must be a 0-dim numeric tensor. Reduce it: mask.sum()."
        )
    if isinstance(count, torch.Tensor) and (count.dtype.itemsize < 4 or count.dtype.is_complex):
        # The window adds the counts in their dtype: float16 counts exactly only to 2048,
        # bfloat16 to 256, int8/int16 wrap around; the gradient is then divided by a wrong count.
        raise LossFnError(
            f"loss_fn returned num_targets as a tensor of dtype {count.dtype}, which cannot hold "
            "a window's target count exactly (the counts are summed in it over the window). "
            "Count in int64 or float32: mask.sum() or mask.sum(dtype=torch.int64), not a "
            "float16/bfloat16/int8/int16 sum."
        )


def _check_aux(aux: Any) -> None:
    if not isinstance(aux, Mapping):
        raise LossFnError(f"loss_fn returned aux={describe(aux)}; it must be a dict. " + _FORMS)
    for key, value in aux.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise LossFnError(
                f"loss_fn returned aux[{key!r}]={describe(value)}; aux must map str names to "
                "tensors (kept on the device; read them in a handler)."
            )

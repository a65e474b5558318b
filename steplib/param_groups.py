"""Optimizer parameter groups: weight decay on the weights, none on biases and normalisation.

What nanoGPT's ``configure_optimizers`` (and many others) write by hand::

    torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from steplib.errors import ConfigError, describe
from steplib.sweep.copies import Copies

__all__ = ["weight_decay_groups"]

# torch's normalisation layers with parameters (a lazy one becomes its BatchNorm/InstanceNorm
# class once it has them). Their weights are 1-D, so the dim rule covers them too: the types
# also cover a subclass that reshapes them.
NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
EMBEDDINGS: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def weight_decay_groups(
    model: nn.Module,
    weight_decay: float | Sequence[float],
    *,
    decay_embeddings: bool = True,
    no_decay: Sequence[type[nn.Module]] = (),
) -> list[dict[str, Any]]:
    """Two optimizer parameter groups: ``weight_decay`` on the weights, ``0.0`` on the rest.

    A parameter decays unless it is a bias or a normalisation weight: any parameter with fewer
    than 2 dimensions (nanoGPT's rule: biases, norm gains, scalars), and every parameter of a
    normalisation layer (LayerNorm, RMSNorm, BatchNorm, GroupNorm, InstanceNorm, by type),
    or of a module of a type in ``no_decay``. Embeddings decay, as in nanoGPT, unless
    ``decay_embeddings=False``. Only parameters with ``requires_grad`` are listed; a shared
    (tied) parameter is listed once, and does not decay if any module that holds it does not.
    For a sweep's ``Copies`` the dimensions are counted per copy (a stacked bias ``[N, out]``
    is a bias), and ``weight_decay`` may be one value per copy (``SweepAdamW`` reads it so).

    Args:
        model: the module (DDP and ``torch.compile`` wrappers hold the same parameters).
        weight_decay: the decay of the first group, a number >= 0 (for ``Copies``, or a list
            of one per copy).
        decay_embeddings: ``False`` puts ``nn.Embedding`` / ``nn.EmbeddingBag`` weights in the
            group without decay.
        no_decay: more module types whose parameters never decay (your own norm layer with a
            2-D parameter, say).

    Returns:
        ``[{"params": [...], "weight_decay": weight_decay}, {"params": [...], "weight_decay":
        0.0}]``, in ``model.parameters()`` order: pass it to any ``torch.optim`` optimizer.
        Either list may be empty.

    Raises:
        ConfigError: ``weight_decay`` is not a finite number >= 0 (or, for ``Copies``, a list
            of one per copy), ``no_decay`` is not a tuple
            of module types, or ``model`` is not a module or has no trainable parameter.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> groups = weight_decay_groups(model, 0.1)
        >>> [(len(g["params"]), g["weight_decay"]) for g in groups]  # weight | bias, LN w + b
        [(1, 0.1), (3, 0.0)]
        >>> optimizer = torch.optim.AdamW(groups, lr=1e-3)
    """
    exempt_types = _check(model, weight_decay, no_decay)
    if not decay_embeddings:
        exempt_types += EMBEDDINGS
    exempt: set[int] = set()
    for module in model.modules():
        if isinstance(module, exempt_types):
            exempt.update(id(p) for p in module.parameters(recurse=False))
    # A sweep's tensors have the copies' leading dimension: a bias is [N, out], 1-D per copy.
    stacked = 1 if isinstance(model, Copies) else 0
    decay: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    for p in model.parameters():  # each shared parameter once
        if p.requires_grad:
            (other if p.dim() - stacked < 2 or id(p) in exempt else decay).append(p)
    rate: float | list[float]  # a list only for Copies (refused above otherwise)
    if isinstance(weight_decay, int | float):
        rate = float(weight_decay)
    else:
        rate = [float(v) for v in weight_decay]
    return [
        {"params": decay, "weight_decay": rate},
        {"params": other, "weight_decay": 0.0},
    ]


def _check(model: Any, weight_decay: Any, no_decay: Any) -> tuple[type[nn.Module], ...]:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"weight_decay_groups received model={describe(model)}, which is not an "
            "nn.Module. Pass the model: weight_decay_groups(model, 0.1)."
        )
    # A sweep's may give one per copy (a SweepAdamW reads a list in a group as per copy).
    per_copy = isinstance(model, Copies) and isinstance(weight_decay, list | tuple)
    values = list(weight_decay) if per_copy else [weight_decay]
    if (per_copy and len(values) != model.n) or not all(
        not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v >= 0
        for v in values
    ):
        raise ConfigError(
            f"weight_decay_groups received weight_decay={describe(weight_decay)}; it must be a "
            "finite number >= 0 (the decay of the weights; biases and norms get 0), or for a "
            "sweep's Copies one such number per copy. Pass e.g. weight_decay_groups(model, 0.1)."
        )
    if not isinstance(no_decay, tuple | list) or not all(
        isinstance(t, type) and issubclass(t, nn.Module) for t in no_decay
    ):
        raise ConfigError(
            f"weight_decay_groups(no_decay=...) received {describe(no_decay)}; pass a tuple of "
            "module classes, e.g. no_decay=(MyNorm,)."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"weight_decay_groups: the model ({type(model).__name__}) has no parameter with "
            "requires_grad=True, so there is nothing to optimize. Unfreeze what should train "
            "(p.requires_grad_(True)) before building the optimizer."
        )
    return (*NORMS, *no_decay)

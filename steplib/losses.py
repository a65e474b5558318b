"""Loss helpers that return what exact token-weighted accumulation needs: ``(loss_sum,
num_targets)``.

A ``loss_fn`` that returns a *mean* loss weighs every micro-batch alike, so a window of
micro-batches with unequal numbers of targets is not the mean over its targets (the 2024
Hugging Face accumulation bug). Returning the sum and the count lets the step divide once per
window, across ranks too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from steplib.errors import ConfigError


def token_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the targets that are not ``ignore_index``, and their count.

    Return it from a ``loss_fn`` as is: ``return token_cross_entropy(model(x), y)``. The count
    stays a device tensor (no host read).

    Args:
        logits: ``(..., classes)`` scores, e.g. ``(batch, seq, vocab)``.
        targets: ``(...)`` class indices of the same leading shape, ``ignore_index`` where
            there is no target (padding).
        ignore_index: the target value that counts as no target.

    Returns:
        ``(loss_sum, num_targets)``: a scalar loss sum and a 0-dim int64 count.

    Raises:
        ConfigError: ``logits`` and ``targets`` do not have the same leading shape.

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 classes
        >>> targets = torch.tensor([[1, 2, -100]])
        >>> loss_sum, count = token_cross_entropy(logits, targets)
        >>> round(float(loss_sum / count), 4), int(count)  # ln(4)
        (1.3863, 2)
    """
    if logits.shape[:-1] != targets.shape:
        raise ConfigError(
            f"token_cross_entropy received logits of shape {tuple(logits.shape)} and targets "
            f"of shape {tuple(targets.shape)}; the targets must have the logits' shape without "
            "the last (class) dimension, e.g. logits (B, T, V) and targets (B, T)."
        )
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, (targets != ignore_index).sum()


__all__ = [
    "token_cross_entropy",
]

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
    stays a device tensor (no host read). ``targets[..., t]`` is the target of
    ``logits[..., t, :]``: for a causal LM whose labels are its inputs (Hugging Face's), use
    :func:`causal_lm_loss`, which shifts them.

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


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token loss of a causal language model: :func:`token_cross_entropy` of the
    logits at position ``t`` against the label at ``t + 1``.

    Hugging Face causal LMs (``AutoModelForCausalLM``: GPT-2, Llama, ...) take ``labels`` equal
    to ``input_ids`` (padding at ``ignore_index``) and shift them inside the model; their
    ``logits`` are not shifted. ``token_cross_entropy(logits, labels)`` on them trains the model
    to predict the token it is given. Shift here instead::

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return causal_lm_loss(logits, batch["labels"])

    ``loss_sum / num_targets`` equals the model's own ``model(input_ids, labels=labels).loss``
    on one batch; under ``accumulate`` the sum and the count make the window's loss the mean
    over all its targets, which the model's per-micro-batch mean is not when the micro-batches
    hold unequal numbers of real tokens.

    Args:
        logits: ``(batch, seq, vocab)`` scores; position ``t`` scores the token at ``t + 1``.
        labels: ``(batch, seq)`` token ids aligned with the inputs (usually ``input_ids``
            itself), ``ignore_index`` where there is no target (padding, a prompt).
        ignore_index: the label value that counts as no target.

    Returns:
        ``(loss_sum, num_targets)``: the cross-entropy summed over the shifted labels that are
        not ``ignore_index``, and their count (a 0-dim int64 tensor; the first label of each
        row is never a target).

    Raises:
        ConfigError: ``logits`` is not 3-dimensional, or ``labels`` is not its shape without
            the last dimension.

    Example:
        >>> logits = torch.zeros(1, 4, 5)  # uniform over 5 tokens
        >>> labels = torch.tensor([[3, 1, 2, -100]])  # 1 and 2 are predicted; 3 starts the row
        >>> loss_sum, count = causal_lm_loss(logits, labels)
        >>> round(float(loss_sum / count), 4), int(count)  # ln(5)
        (1.6094, 2)
    """
    if logits.ndim != 3 or logits.shape[:-1] != labels.shape:
        raise ConfigError(
            f"causal_lm_loss received logits of shape {tuple(logits.shape)} and labels of "
            f"shape {tuple(labels.shape)}; it takes logits (batch, seq, vocab) and labels "
            "(batch, seq) aligned with the inputs (labels = input_ids, padding at -100): it "
            "shifts them itself. For targets that are already shifted, use "
            "token_cross_entropy(logits, targets)."
        )
    return token_cross_entropy(logits[:, :-1], labels[:, 1:], ignore_index=ignore_index)


__all__ = [
    "causal_lm_loss",
    "token_cross_entropy",
]

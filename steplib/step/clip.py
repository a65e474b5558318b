"""``clip``: gradient clipping by total norm and/or by value, on unscaled gradients."""

from __future__ import annotations

import math

import torch

from steplib.errors import ConfigError, describe
from steplib.step.core import Step, add_part
from steplib.step.parts import CLIP, Gradients, Part


def clip(
    step: Step,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    max_value: float | None = None,
) -> Step:
    """Clip gradients before the optimizer step; report the total norm as ``out.grad_norm``.

    Clipping always sees the normalised, unscaled gradients of the whole window, whatever
    order ``clip`` and ``amp_wrap`` were applied in. Value clipping (``max_value``) runs first,
    then norm clipping, which is ``torch.nn.utils.clip_grad_norm_`` itself (the reported norm
    is the one it returns, measured before clipping). With ``max_value`` alone the reported
    norm is the one before the clamp; a gradient that was inf or NaN before the clamp reports a
    non-finite norm in every case, so that ``skip_nonfinite`` skips that update.

    Args:
        step: the step to wrap.
        max_norm: clip the total gradient norm to this, a finite number > 0.
        norm_type: the norm's order, > 0 or ``math.inf``.
        max_value: clamp every gradient element into ``[-max_value, max_value]``, > 0.

    Returns:
        The wrapped step.

    Raises:
        ConfigError: neither limit given, a limit that is not a finite positive number, or a
            bad ``norm_type``; or ``step`` already clips.

    Example:
        >>> from steplib import make_train_step
        >>> step = clip(make_train_step(lambda m, b: m(b).sum()), max_norm=1.0)
        >>> step.describe()
        [{'wrapper': 'clip', 'max_norm': 1.0, 'norm_type': 2.0, 'max_value': None}]
    """
    if max_norm is None and max_value is None:
        raise ConfigError(
            "clip(step) received neither max_norm nor max_value, so it would clip nothing. "
            "Pass clip(step, max_norm=1.0) and/or clip(step, max_value=0.5)."
        )
    _check_positive("max_norm", max_norm)
    _check_positive("max_value", max_value)
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0:
        raise ConfigError(
            f"clip(norm_type=...) received {describe(norm_type)}; it must be a number > 0 or "
            "math.inf (2.0 is the usual L2 norm)."
        )
    limit = None if max_norm is None else float(max_norm)
    value = None if max_value is None else float(max_value)
    order = float(norm_type)

    def clip_grads(grads: Gradients) -> None:
        unclamped = None
        if value is not None:  # value limits apply first, to the normalised gradients
            # Measured before the clamp, which turns an inf gradient into +-max_value: the norm
            # must stay non-finite for skip_nonfinite (which reads it) to skip that update.
            grads.grad_norm = unclamped = grads.norm(order)
            torch.nn.utils.clip_grad_value_(grads.params, value)
        if limit is not None:
            # torch.nn.utils.clip_grad_norm_'s formula, over the norm of the whole model (every
            # rank and stage); the scaling folds in a pending division by the window's count.
            norm = grads.norm(order)
            grads.scale_(torch.clamp(limit / (norm + 1e-6), max=1.0))
            # The norm clip_grad_norm_ returns; a non-finite one from before the value clamp.
            kept = norm if unclamped is None else torch.where(unclamped.isfinite(), norm, unclamped)
            grads.grad_norm = kept

    settings = {"max_norm": limit, "norm_type": order, "max_value": value}
    return add_part(
        step, Part(name="clip", settings=settings, grad_transform=clip_grads, order=CLIP)
    )


def _check_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        # Scripts often read a limit of 0 as "no clipping" (DETR's `if max_norm > 0:
        # clip_grad_norm_(...)`, its --clip_max_norm 0): say how to write that here.
        off = (
            f" A {name} of 0 does not turn clipping off; to not clip, leave clip out: "
            f"step = clip(step, {name}=m) if m > 0 else step."
            if value == 0 and not isinstance(value, bool)
            else ""
        )
        raise ConfigError(
            f"clip({name}=...) received {describe(value)}; it must be a finite number > 0, "
            f"e.g. clip(step, {name}=1.0).{off}"
        )

"""``skip_nonfinite``: skip a whole update whose loss or gradients are not finite."""

from __future__ import annotations

import torch

from steplib.errors import ConfigError, describe
from steplib.step.core import Step, add_part
from steplib.step.parts import FINITE, Gradients, Part, plain


def skip_nonfinite(step: Step, *, max_consecutive: int | None = 10) -> Step:
    """Skip the optimizer update of a window whose loss or gradient norm is inf or NaN.

    The whole window is dropped: gradients are zeroed, the optimizer and the scheduler do not
    step, ``out.skipped`` is True and ``state.skipped_updates`` / ``consecutive_skips`` count
    it. The check is computed on the device. With a fused optimizer (``fused=True``) and no
    scheduler or a ``LambdaLR``, the decision stays there too (no host sync; see
    ``steplib.step.device_skips``); otherwise it is read on the host once per update (a host-side
    scheduler must know whether to advance), never on non-final micro-batches.

    Args:
        step: the step to wrap.
        max_consecutive: raise ``TooManySkipsError`` when more updates than this are skipped in
            a row (an int >= 1), or ``None`` never to raise. A checkpoint resumes under
            another limit (it changes no number). When the decision stays on the
            device this is checked on a host copy of the count once it has landed: on CUDA the
            error may come an update or two late (those updates were skipped too).

    Returns:
        The wrapped step.

    Raises:
        ConfigError: ``max_consecutive`` is not ``None`` or an int >= 1, or ``step`` already
            skips.

    Example:
        >>> from steplib import make_train_step
        >>> skip_nonfinite(make_train_step(lambda m, b: m(b).sum()), max_consecutive=3).describe()
        [{'wrapper': 'skip_nonfinite', 'max_consecutive': 3}]
    """
    if max_consecutive is not None and (
        isinstance(max_consecutive, bool)
        or not isinstance(max_consecutive, int)
        or max_consecutive < 1
    ):
        raise ConfigError(
            f"skip_nonfinite(max_consecutive=...) received {describe(max_consecutive)}; it must "
            "be an int >= 1 (how many skipped updates in a row are tolerated) or None."
        )

    def check_finite(grads: Gradients) -> None:
        if grads.grad_norm is None:  # clipping measured it already, before clipping
            grads.grad_norm = grads.norm()
        # The global loss and the synchronised gradients: every rank decides alike.
        bad = ~torch.isfinite(plain(grads.grad_norm)) | ~torch.isfinite(grads.loss_sum)
        grads.flag_nonfinite(bad)

    part = Part(
        name="skip_nonfinite",
        settings={"max_consecutive": max_consecutive},
        grad_transform=check_finite,
        order=FINITE,
        max_consecutive_skips=max_consecutive,
    )
    return add_part(step, part)

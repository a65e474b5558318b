"""``amp_wrap``: mixed precision by autocast; float16 adds loss scaling with the state's scaler."""

from __future__ import annotations

import collections
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from steplib.errors import ConfigError, TooManySkipsError, describe
from steplib.state import TrainState
from steplib.step.core import Step, add_part
from steplib.step.device_skips import HostCopy
from steplib.step.parts import Part
from steplib.step.plan import scaler_active

_DTYPES = (torch.bfloat16, torch.float16)


def amp_wrap(
    step: Step, *, dtype: torch.dtype = torch.bfloat16, min_loss_scale: float | None = None
) -> Step:
    """Run the forward pass under ``torch.autocast`` on the model's device type.

    With ``dtype=torch.float16`` the loss is scaled by the ``GradScaler`` in the state
    (``TrainState.create(..., scaler=torch.amp.GradScaler(device))``); gradients are unscaled
    before clipping, an update with inf/NaN gradients is skipped (``out.did_update`` False),
    the scale backs off, and the scheduler does not advance. bfloat16 needs no scaler. The loss
    *sum* is scaled: token-weighted, start it at ``2.0**16 / targets`` (docs/concepts.md).

    Args:
        step: the step to wrap.
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        min_loss_scale: float16 only: raise ``TooManySkipsError`` once the scaler's scale has
            fallen below this (a number > 0; fairseq's ``min_loss_scale``), else ``None``. Every
            overflowing update halves the scale: one that keeps falling means training has
            diverged. The scale is read from a host copy once it has landed, never waited for:
            the error names the update whose backoff took the scale below the minimum and
            comes in that update on the CPU, on CUDA as many updates later as the host runs
            ahead of the GPU (usually one or two).

    Returns:
        The wrapped step.

    Raises:
        ConfigError: an unsupported ``dtype``, ``min_loss_scale`` not a number > 0 or without
            ``dtype=torch.float16``, or ``step`` already uses autocast. A float16 step called
            with a state that has no scaler raises ``ConfigError`` naming the fix.
        TooManySkipsError: (when the step is called) the loss scale fell below
            ``min_loss_scale``.

    Example:
        >>> import torch
        >>> from steplib import make_train_step
        >>> step = amp_wrap(make_train_step(lambda m, b: m(b).sum()), dtype=torch.bfloat16)
        >>> step.describe()
        [{'wrapper': 'amp_wrap', 'dtype': 'torch.bfloat16'}]
    """
    if dtype not in _DTYPES:
        raise ConfigError(
            f"amp_wrap(dtype=...) received {describe(dtype)}; mixed precision supports "
            "torch.bfloat16 (no scaler needed) and torch.float16 (needs a GradScaler in the "
            "state). For full float32 precision, do not wrap the step."
        )
    if min_loss_scale is not None and (
        dtype != torch.float16
        or isinstance(min_loss_scale, bool)
        or not isinstance(min_loss_scale, int | float)
        or not 0 < min_loss_scale < float("inf")
    ):
        raise ConfigError(
            f"amp_wrap(dtype={dtype}, min_loss_scale=...) received {describe(min_loss_scale)}; "
            "min_loss_scale bounds the float16 loss scale, so it needs dtype=torch.float16 and "
            "a number > 0, e.g. amp_wrap(step, dtype=torch.float16, min_loss_scale=1e-4)."
        )

    def autocast(state: TrainState) -> ContextManager[Any]:
        if dtype == torch.float16 and not scaler_active(state):
            what = "no GradScaler" if state.scaler is None else "a disabled GradScaler"
            raise ConfigError(
                "amp_wrap(dtype=torch.float16) needs a GradScaler in the state that scales the "
                f"loss; it received {what}: float16 gradients underflow without loss scaling "
                "(a scaler is disabled by enabled=False, or by torch when made for a device "
                "that is not there: GradScaler('cuda') without CUDA). Create the state with "
                f"TrainState.create(..., scaler=torch.amp.GradScaler({state.device.type!r})), "
                "or use dtype=torch.bfloat16, which needs no scaler."
            )
        if min_loss_scale is not None and state.scaler is not None:
            _check_initial_scale(state.scaler, min_loss_scale)
        return torch.autocast(state.device.type, dtype=dtype)

    # min_loss_scale stays out of the settings: a guard that changes no number, so a checkpoint
    # resumes under another minimum (describe() is compared on resume).
    settings = {"dtype": str(dtype)}
    hooks = {} if min_loss_scale is None else {"after_zero_grad": _MinLossScale(min_loss_scale)}
    part = Part(name="amp_wrap", settings=settings, forward_context=autocast, hooks=hooks)
    return add_part(step, part)


def _check_initial_scale(scaler: torch.amp.GradScaler, minimum: float) -> None:
    """Refuse a minimum above the scale a scaler starts at. Only a scaler that has not scaled
    yet (its first micro-batch) is checked: it reports its initial scale without a device read.
    """
    if scaler._scale is None and scaler.is_enabled() and scaler.get_scale() < minimum:
        raise ConfigError(
            f"amp_wrap(min_loss_scale={minimum:g}) is above the GradScaler's initial scale "
            f"({scaler.get_scale():g}), so the first update would be reported as divergence. "
            "Pass a minimum below it, e.g. min_loss_scale=1e-4, or start the scaler higher: "
            f"torch.amp.GradScaler(init_scale={minimum * 2**16:g})."
        )


class _MinLossScale:
    """The ``after_zero_grad`` hook (after the scaler's update) that raises once the scale is
    below ``minimum``. The scale is a device tensor: each update posts a host copy of it
    (:class:`HostCopy`) and reads, in order, the copies that have landed, so no update waits
    for the device and the error names the first update below the minimum. The copies in
    flight are this step's, as a compiled step's caches are its runner's; they are dropped
    when the state's scaler is another one (a new run of the same step).
    """

    def __init__(self, minimum: float) -> None:
        self.minimum = float(minimum)
        self.scaler: Any = None
        self.in_flight: collections.deque[tuple[HostCopy, int]] = collections.deque()

    def __call__(self, state: TrainState) -> None:
        scaler = state.scaler
        if scaler is None or scaler._scale is None:  # no scaler, or a disabled one
            return
        if scaler is not self.scaler:
            self.scaler, self.in_flight = scaler, collections.deque()
        self.in_flight.append((HostCopy(scaler._scale), state.step + 1))
        # Copies land in the order they were posted; on the CPU at once.
        while self.in_flight and self.in_flight[0][0].ready():
            copy, step = self.in_flight.popleft()
            self.check(copy.read(), step)

    def check(self, scale: float, step: int) -> None:
        if scale < self.minimum:
            self.in_flight.clear()
            raise TooManySkipsError(
                f"amp_wrap: the float16 loss scale fell to {scale:g} at step {step}, below "
                f"min_loss_scale={self.minimum:g}. Every update whose gradients overflow halves "
                "the scale, so training has diverged. Lower the learning rate, add clip(step, "
                "max_norm=1.0), check the data for NaN/inf, or train in torch.bfloat16 (no loss "
                "scale); lower min_loss_scale only if tiny scales are expected."
            )

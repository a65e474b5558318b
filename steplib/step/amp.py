"""``amp_wrap``: mixed precision by autocast; float16 adds loss scaling with the state's scaler."""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from steplib.errors import ConfigError, describe
from steplib.state import TrainState
from steplib.step.core import Step, add_part
from steplib.step.parts import Part

_DTYPES = (torch.bfloat16, torch.float16)


def amp_wrap(step: Step, *, dtype: torch.dtype = torch.bfloat16) -> Step:
    """Run the forward pass under ``torch.autocast`` on the model's device type.

    With ``dtype=torch.float16`` the loss is scaled by the ``GradScaler`` in the state
    (``TrainState.create(..., scaler=torch.amp.GradScaler(device))``); gradients are unscaled
    before clipping, an update with inf/NaN gradients is skipped (``out.did_update`` False),
    the scale backs off, and the scheduler does not advance. bfloat16 needs no scaler.

    Args:
        step: the step to wrap.
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.

    Returns:
        The wrapped step.

    Raises:
        ConfigError: an unsupported ``dtype``, or ``step`` already uses autocast. A float16
            step called with a state that has no scaler raises ``ConfigError`` naming the fix.

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

    def autocast(state: TrainState) -> ContextManager[Any]:
        if dtype == torch.float16 and state.scaler is None:
            raise ConfigError(
                "amp_wrap(dtype=torch.float16) needs a GradScaler in the state: float16 "
                "gradients underflow without loss scaling. Create the state with "
                f"TrainState.create(..., scaler=torch.amp.GradScaler({state.device.type!r})), "
                "or use dtype=torch.bfloat16, which needs no scaler."
            )
        return torch.autocast(state.device.type, dtype=dtype)

    settings = {"dtype": str(dtype)}
    return add_part(step, Part(name="amp_wrap", settings=settings, forward_context=autocast))

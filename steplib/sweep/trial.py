"""The trial call of a sweep's ``loss_fn`` when the sweep step is built: what ``vmap`` cannot
run fails there, named, with its fix, instead of on the first batch of training.

The trial runs the forward pass only, under a forked RNG, and puts the buffers back: building
a sweep changes neither the copies nor any random stream.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.sweep.copies import Copies

# (what vmap says, what the loss did, the fix)
_KNOWN = (
    (
        ".item()",
        "reads a tensor's value on the host (.item(), float(t), int(t))",
        "keep the value a tensor (return it in the aux dict to log it); a host read is a sync "
        "per step as well",
    ),
    (
        "data-dependent control flow",
        "branches in Python on a tensor's value (`if loss > x:`, `while`, bool(t))",
        "compute both sides and choose with torch.where(condition, a, b)",
    ),
    (
        "dynamic shape",
        "makes a tensor whose shape depends on the data (indexing with a boolean mask, "
        "nonzero, unique)",
        "keep the shape fixed: multiply by the mask, e.g. (loss * mask).sum() / mask.sum()",
    ),
    (
        "data pointer",
        "reads a tensor on the host (.tolist(), .numpy(), .cpu())",
        "keep the value a tensor (return it in the aux dict to log it)",
    ),
    (
        "broadcast shape",
        "updates in place a tensor that is shared by every copy (a tensor attribute of the "
        "model that is not a registered buffer, or a tensor captured by loss_fn)",
        "register it, self.register_buffer('name', tensor), so that each copy has its own, "
        "or leave it out of the loss",
    ),
    (
        "inplace",
        "updates in place a tensor that is shared by every copy",
        "register it as a buffer (self.register_buffer('name', tensor)) so that each copy has "
        "its own, or compute a new tensor instead of updating one in place",
    ),
)


def trial(run: Callable[[Any], Any], copies: Copies, batch: Any) -> None:
    """Call ``run(batch)`` once (forward only) and translate what ``vmap`` refuses.

    Raises:
        ConfigError: the loss cannot run under ``vmap``: which operation, where in the user's
            code, and the fix.
    """
    params, buffers = copies.tensors()
    saved = {name: b.clone() for name, b in buffers.items()}
    device = next(iter(params.values())).device
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            run(batch)
    except RuntimeError as error:
        raise ConfigError(_explain(error, copies.n)) from error
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                buffers[name].copy_(value)


def _explain(error: RuntimeError, n: int) -> str:
    text = str(error)
    where = _user_line(error)
    for needle, what, fix in _KNOWN:
        if needle in text:
            return (
                f"sweep_step: loss_fn cannot run for {n} copies at once: {where}{what}, and "
                f"torch.func.vmap runs every copy as one batched tensor (vmap said: "
                f"{text.splitlines()[0][:160]}). Fix: {fix}."
            )
    return (
        f"sweep_step: torch.func.vmap could not run loss_fn for {n} copies at once: {where}"
        f"{text.splitlines()[0][:300]}. Fix: make loss_fn a function of tensors only (no host "
        "reads, no Python branches on tensor values, no in-place updates of shared tensors), "
        "or train the copies one by one."
    )


def _user_line(error: BaseException) -> str:
    """``"at file:line (`code`): "`` of the innermost frame outside torch and steplib."""
    torch_dir = Path(torch.__file__).parent
    steplib_dir = Path(__file__).parent.parent
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = Path(frame.filename)
        if torch_dir in path.parents or steplib_dir in path.parents:
            continue
        found = f"at {path.name}:{frame.lineno} (`{(frame.line or '').strip()}`): "
    return found

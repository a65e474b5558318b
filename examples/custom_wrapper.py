"""A custom wrapper: adaptive gradient clipping (AGC), as ``Step -> Step``.

AGC (Brock et al., 2021, "High-Performance Large-Scale Image Recognition Without
Normalization") clips each output unit's gradient relative to the norm of its weights: a unit
whose gradient is larger than ``clipping`` times its weight norm is scaled down to that size.

The wrapper contributes a gradient transform (``Part(grad_transform=..., order=...)``), the same
API the built-in ``clip`` uses. Ranked just after ``CLIP``, it sees the window's final gradients
whatever order the wrappers were applied in: summed over the micro-batches, divided by the
window's targets, unscaled (float16), clipped by ``clip``, synchronised across ranks (DDP). So
AGC composes with every built-in wrapper without knowing about any of them.
``docs/custom_wrappers_and_handlers.md`` walks through it; ``tests/test_custom_examples.py``
tests it against a plain PyTorch loop.

    python examples/custom_wrapper.py
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, Step, TrainState, accumulate, clip, make_train_step
from steplib.step import CLIP, FINITE, Gradients, Part, add_part


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """The norm of each output unit (dim 0) of a weight; the whole norm of a vector/scalar."""
    if x.ndim <= 1:
        return x.norm()
    return x.norm(dim=tuple(range(1, x.ndim)), keepdim=True)


@torch.no_grad()
def clip_unitwise_(params: Iterable[torch.Tensor], *, clipping: float, eps: float) -> None:
    """Scale, in place, each unit's gradient down to ``clipping * max(weight norm, eps)``.

    Device ops only: no ``.item()``, no branch on a tensor, so no host sync.
    """
    for p in params:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p).clamp(min=eps) * clipping
        grad_norm = unitwise_norm(p.grad)
        clipped = p.grad * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.copy_(torch.where(grad_norm > max_norm, clipped, p.grad))


def adaptive_clip(step: Step, *, clipping: float = 0.01, eps: float = 1e-3) -> Step:
    """Adaptive gradient clipping of every parameter the optimizer updates.

    Args:
        step: the step to wrap.
        clipping: the largest ratio of a unit's gradient norm to its weight norm, > 0.
        eps: weight norms below this count as ``eps`` (units that start at zero can move).

    Returns:
        The wrapped step; ``step.describe()`` lists ``adaptive_clip`` with its settings.

    Raises:
        ConfigError: ``step`` is not a Step, a setting is not a finite number > 0, the step
            is already wrapped by ``adaptive_clip``, or ``compile_step`` was applied before.

    Example:
        >>> step = adaptive_clip(make_train_step(lambda m, b: m(b).sum()), clipping=0.05)
        >>> step.describe()
        [{'wrapper': 'adaptive_clip', 'clipping': 0.05, 'eps': 0.001}]
    """
    # Check everything when the step is built, with the fix in the message: a mistake found
    # here costs a second, found at the first update it may cost a queue wait. (add_part
    # checks that `step` is a Step, not already wrapped by adaptive_clip, not compiled.)
    for name, value in (("clipping", clipping), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(
                f"adaptive_clip({name}=...) received {value!r}; it must be a number > 0, "
                f"e.g. adaptive_clip(step, {name}=0.01)."
            )
        if not math.isfinite(value):
            raise ConfigError(
                f"adaptive_clip({name}=...) received {value!r}; pass a finite number."
            )
    settings = {"clipping": float(clipping), "eps": float(eps)}

    def transform(grads: Gradients) -> None:
        clip_unitwise_(grads.params, **settings)

    # Between CLIP and FINITE: after norm clipping, before the finiteness check. The name and
    # settings go into step.describe(), which a checkpoint saves and compares on resume (a run
    # resumed without AGC is refused, not silently different).
    part = Part(
        name="adaptive_clip",
        settings=settings,
        grad_transform=transform,
        order=(CLIP + FINITE) / 2,
    )
    return add_part(step, part)


def main() -> dict[str, Any]:
    """Train a small MLP with AGC inside accumulation and norm clipping."""
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, :2].sum(1) > 0).long()

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    state = TrainState.create(model=model, optimizer=optimizer)
    step = clip(accumulate(adaptive_clip(make_train_step(loss_fn), clipping=0.05), 2), max_norm=1)
    losses = []
    for _ in range(5):  # epochs
        for i in range(0, 512, 32):
            state, out = step(state, (x[i : i + 32], y[i : i + 32]))
            if state.window.size == 0:  # the window closed: a host int, no device read
                losses.append(out.loss)
    values = torch.stack(losses).tolist()
    print(step.describe())
    print(f"{state.step} updates, loss {values[0]:.3f} -> {values[-1]:.3f}")
    return {"first_loss": values[0], "last_loss": values[-1], "describe": step.describe()}


if __name__ == "__main__":
    main()

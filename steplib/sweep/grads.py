"""``CopyGradients``: the window's gradients of a sweep as the step's gradient transforms see
them: the interface of :class:`steplib.step.Gradients`, per copy.

Every gradient is a stacked ``[N, ...]`` tensor. ``norm()`` returns one norm per copy (``[N]``)
and ``scale_`` takes one factor per copy, so the transforms of ``clip`` and ``skip_nonfinite``
(and a user's transform written with ``norm``/``scale_``/``flag_nonfinite``) act on each copy
as they would on that copy's own run. ``loss_sum`` is ``[N]`` and ``nonfinite`` a ``[N]`` bool.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from steplib.state import TrainState
from steplib.step.parts import LOCAL


class CopyGradients:
    """The gradients of N copies, made once per update and passed to every transform.

    Attributes:
        state: the state being updated.
        params: the stacked parameters that have a gradient.
        grads: their gradients, summed over the window and normalised.
        loss_sum: ``[N]``: each copy's loss sum over the window.
        num_targets: the window's target count (one batch for all copies: one count).
        divisor: what ``NORMALISE`` divides the gradients by.
        grad_norm: ``[N]``, once a transform measured it.
        nonfinite: a ``[N]`` bool tensor, True for a copy whose update must be skipped.
        n: the number of copies.
    """

    def __init__(
        self,
        state: TrainState,
        *,
        loss_sum: torch.Tensor,
        num_targets: torch.Tensor | int,
        n: int,
    ) -> None:
        self.state = state
        self._params = [
            p for g in state.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        self._grads: list[torch.Tensor] = [p.grad for p in self._params]
        self._pending: torch.Tensor | float | None = None
        self.loss_sum = loss_sum
        self.num_targets = num_targets
        self.divisor: torch.Tensor | int = num_targets
        self.grad_norm: torch.Tensor | None = None
        self.nonfinite: torch.Tensor | None = None
        self.sync = LOCAL
        self.n = n

    @property
    def params(self) -> list[torch.Tensor]:
        self.settle()
        return self._params

    @property
    def grads(self) -> list[torch.Tensor]:
        self.settle()
        return self._grads

    def divide_by(self, divisor: torch.Tensor | float) -> None:
        """Divide every copy's gradients by ``divisor`` (a count <= 0 zeroes them)."""
        if isinstance(divisor, torch.Tensor):
            divisor = torch.where(divisor > 0, divisor, math.inf)
        elif divisor == 1:
            return
        elif divisor <= 0:
            divisor = math.inf
        self._pending = divisor if self._pending is None else self._pending * divisor

    def norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """``[N]``: each copy's total gradient norm, computed as ``clip_grad_norm_`` does (the
        norm of the per-tensor norms)."""
        if not self._grads:
            return torch.zeros(self.n, device=self.state.device)
        per_tensor = [torch.linalg.vector_norm(g.flatten(1), norm_type, dim=1) for g in self._grads]
        norm = torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), norm_type, dim=1)
        return norm if self._pending is None else norm / self._pending

    def scale_(self, factor: torch.Tensor | float) -> None:
        """Multiply each copy's gradients by its factor (a ``[N]`` tensor) or all by one."""
        if self._pending is not None:
            factor, self._pending = factor / self._pending, None
        for g in self._grads:
            g.mul_(_per_copy(factor, g))

    def settle(self) -> None:
        """Apply a pending division now (the sweep step calls it after the last transform)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            for g in self._grads:
                g.div_(_per_copy(pending, g))

    def flag_nonfinite(self, bad: torch.Tensor) -> None:
        """Skip the update of the copies where ``bad`` is True (``[N]``, or one bool for all)."""
        bad = bad.expand(self.n) if bad.ndim == 0 else bad
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad


def _per_copy(factor: Any, like: torch.Tensor) -> Any:
    """``factor`` shaped to multiply ``like`` copy by copy: ``[N]`` becomes ``[N, 1, ...]``."""
    if isinstance(factor, torch.Tensor) and factor.ndim == 1:
        return factor.to(like.device).view((-1,) + (1,) * (like.ndim - 1))
    return factor

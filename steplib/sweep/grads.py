"""``CopyGradients``: the window's gradients of a sweep as the step's gradient transforms see
them: the interface of :class:`steplib.step.Gradients`, per copy.

Every gradient is a stacked ``[N, ...]`` tensor. ``norm()`` returns one norm per copy (``[N]``)
and ``scale_`` takes one factor per copy, so the transforms of ``clip`` and ``skip_nonfinite``
(and a user's transform written with ``norm``/``scale_``/``flag_nonfinite``) act on each copy
as they would on that copy's own run. ``loss_sum`` is ``[N]`` and ``nonfinite`` a ``[N]`` bool.
"""

from __future__ import annotations

from typing import Any

import torch

from steplib.state import TrainState
from steplib.step.parts import LOCAL, Gradients


class CopyGradients(Gradients):
    """The gradients of N copies, made once per update and passed to every transform: a
    :class:`~steplib.step.Gradients` whose norm, scaling and skip flag are per copy (its
    ``params``, ``grads`` and pending division by the window's count are the base class's).

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
        super().__init__(
            state, loss_sum=loss_sum, num_targets=num_targets, divisor=num_targets, sync=LOCAL
        )
        self.n = n

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

    def flag_nonfinite(self, bad: torch.Tensor) -> None:
        """Skip the update of the copies where ``bad`` is True (``[N]``, or one bool for all)."""
        bad = bad.expand(self.n) if bad.ndim == 0 else bad
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad


def _per_copy(factor: Any, like: torch.Tensor) -> Any:
    """``factor`` shaped to multiply ``like`` copy by copy: ``[N]`` becomes ``[N, 1, ...]``."""
    if isinstance(factor, torch.Tensor) and factor.ndim == 1:
        return factor.to(like.device).view((-1,) + (1,) * (like.ndim - 1))
    return factor

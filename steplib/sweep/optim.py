"""``SweepAdamW`` and ``SweepSGD``: torch.optim's AdamW/Adam and SGD over a sweep's stacked
parameters, each hyper-parameter a float or one value per copy, in one parameter group or
several (``steplib.sweep.per_copy_optimizer`` holds what they share and says how the values are
kept)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.sweep.arguments import flag
from steplib.sweep.per_copy_optimizer import PerCopyOptimizer

# torch.optim.AdamW's and SGD's settings that the sweep optimizers do not have (SGD: not
# amsgrad); AdamW's betas is beta1 and beta2 here.
TORCH_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


class SweepAdamW(PerCopyOptimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) or, with ``decoupled=False``,
    Adam with L2 weight decay (as ``torch.optim.Adam``), with per-copy hyper-parameters.

    Args:
        params: ``copies.parameters()``, or parameter groups of them (torch.optim's: a value a
            group gives, a float or one per copy, overrides the one given here), e.g.
            ``steplib.param_groups.weight_decay_groups(copies, 0.1)``.
        lr, beta1, beta2, eps, weight_decay: a float, or a sequence of one value per copy.
            ``weight_decay`` left out is torch's default for the variant: AdamW's 1e-2, Adam's 0.
        decoupled: AdamW's decay (``p *= 1 - lr * wd``) when True, Adam's L2 term otherwise.
        n: the number of copies (read from the parameters when left out).

    Raises:
        ConfigError: a value that is not a number, a sequence of the wrong length, a value
            ``torch.optim.AdamW`` refuses (``lr``, ``eps`` or ``weight_decay`` below 0, a beta
            outside [0, 1), NaN), ``decoupled`` not a bool, parameters without the copies'
            leading dimension, or a group with a torch.optim setting it does not read
            (``betas``: give ``beta1``, ``beta2``).

    Example:
        >>> import torch
        >>> from steplib.sweep import Copies
        >>> copies = Copies.stack([torch.nn.Linear(2, 1) for _ in range(3)])
        >>> opt = SweepAdamW(copies.parameters(), lr=[1e-3, 3e-3, 1e-2], weight_decay=0.01)
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["copies"]["lr"].tolist()
        (1.0, [0.001, 0.003, 0.01])
    """

    per_copy = ("beta1", "beta2", "eps", "weight_decay")
    flags = ("decoupled",)
    state_keys = ("exp_avg", "exp_avg_sq")
    unread = (
        ("betas", "Give beta1=... and beta2=... (each a float, or one per copy)."),
        *((name, f"Leave {name} out: SweepAdamW has none.") for name in TORCH_ONLY),
    )
    ranges: tuple[tuple[str, float, float], ...] = (("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0))
    ranges += (("lr", 0.0, math.inf), ("eps", 0.0, math.inf), ("weight_decay", 0.0, math.inf))

    def derived(self, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """AdamW's decay factor ``1 - lr * wd`` and ``1 - beta1``, ``1 - beta2``."""
        return {
            "decay": torch.rsub(h["lr"] * h["weight_decay"], 1),
            "one_minus_beta1": torch.rsub(h["beta1"], 1),
            "one_minus_beta2": torch.rsub(h["beta2"], 1),
        }

    def per_param(self, step: torch.Tensor, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The bias corrections: the step size ``lr / (1 - beta1^t)`` (negated) and
        ``sqrt(1 - beta2^t)``, at this update's count ``t``."""
        step = step + 1
        return {
            "neg_step_size": -h["lr"] / torch.rsub(h["beta1"] ** step, 1),
            "bias2_sqrt": torch.rsub(h["beta2"] ** step, 1).sqrt(),
        }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float | Sequence[float] = 1e-3,
        beta1: float | Sequence[float] = 0.9,
        beta2: float | Sequence[float] = 0.999,
        eps: float | Sequence[float] = 1e-8,
        weight_decay: float | Sequence[float] | None = None,
        decoupled: bool = True,
        n: int | None = None,
    ) -> None:
        if weight_decay is None:  # torch.optim's: AdamW decays by default, Adam does not
            weight_decay = 1e-2 if decoupled is True else 0.0
        super().__init__(
            params,
            n=n,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=flag(type(self).__name__, "decoupled", decoupled),
        )

    def update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        h: dict[str, torch.Tensor],
        group: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # torch.optim.Adam(W)'s single-tensor formulas, per copy, in its order of operations:
        # addcmul and addcdiv compute (value * t1) * t2 and (value * t1) / t2 as its do.
        if group["decoupled"]:
            p = p * h["decay"]
        else:
            grad = grad + h["weight_decay"] * p
        exp_avg = state["exp_avg"].lerp(grad, h["one_minus_beta1"])
        exp_avg_sq = torch.addcmul(
            state["exp_avg_sq"] * h["beta2"], grad * h["one_minus_beta2"], grad
        )
        denom = exp_avg_sq.sqrt() / h["bias2_sqrt"] + h["eps"]
        new = torch.addcdiv(p, exp_avg * h["neg_step_size"], denom)
        return new, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


class SweepSGD(PerCopyOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (as ``torch.optim.SGD``), with
    per-copy hyper-parameters.

    Args:
        params: ``copies.parameters()``, or parameter groups of them (torch.optim's: a value a
            group gives, a float or one per copy, overrides the one given here), e.g.
            ``steplib.param_groups.weight_decay_groups(copies, 0.1)``.
        lr, momentum, dampening, weight_decay: a float, or a sequence of one value per copy.
        nesterov: Nesterov momentum (for every copy).
        n: the number of copies (read from the parameters when left out).

    Raises:
        ConfigError: as :class:`SweepAdamW` (``lr``, ``momentum`` or ``weight_decay``
            below 0; ``nesterov`` not a bool, or True with a copy whose momentum is 0 or
            dampening is not, as ``torch.optim.SGD`` refuses).

    Example:
        >>> import torch
        >>> from steplib.sweep import Copies
        >>> copies = Copies.stack([torch.nn.Linear(2, 1) for _ in range(2)])
        >>> opt = SweepSGD(copies.parameters(), lr=0.1, momentum=[0.0, 0.9])
        >>> opt.param_groups[0]["copies"]["momentum"].tolist()
        [0.0, 0.9]
    """

    per_copy = ("momentum", "dampening", "weight_decay")
    flags = ("nesterov",)
    state_keys = ("momentum_buffer",)
    unread = tuple((name, f"Leave {name} out: SweepSGD has none.") for name in TORCH_ONLY[1:])
    ranges = (("lr", 0.0, math.inf), ("momentum", 0.0, math.inf), ("weight_decay", 0.0, math.inf))

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float | Sequence[float],
        momentum: float | Sequence[float] = 0.0,
        dampening: float | Sequence[float] = 0.0,
        weight_decay: float | Sequence[float] = 0.0,
        nesterov: bool = False,
        n: int | None = None,
    ) -> None:
        super().__init__(
            params,
            n=n,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=flag(type(self).__name__, "nesterov", nesterov),
        )

    def check_group(self, group: dict[str, Any], given: dict[str, list[float]], index: int) -> None:
        """torch.optim.SGD refuses Nesterov without momentum or with dampening: that copy's own
        run would not start (here it would train on, as plain or dampened SGD)."""
        pairs = zip(given["momentum"], given["dampening"], strict=True)
        for i, (moment, damp) in enumerate(pairs):
            if group["nesterov"] and (moment <= 0 or damp != 0):
                raise ConfigError(
                    f"SweepSGD(nesterov=True), param group {index}, received "
                    f"momentum={moment}, dampening={damp} for copy {i}; torch.optim.SGD refuses "
                    "Nesterov without momentum or with dampening, so that copy's own run would "
                    "not start. Give every copy a momentum > 0 and dampening=0, or sweep those "
                    "copies with nesterov=False."
                )

    def derived(self, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``1 - dampening``."""
        return {"one_minus_dampening": torch.rsub(h["dampening"], 1)}

    def per_param(self, step: torch.Tensor, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whether this is the parameter's first update (its momentum buffer starts there)."""
        return {"first": step == 0}

    def update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        h: dict[str, torch.Tensor],
        group: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # torch.optim.SGD's formulas, per copy: the first update starts the buffer at the
        # gradient itself, and a copy without momentum uses the gradient as it is.
        momentum = h["momentum"]
        grad = grad + h["weight_decay"] * p
        old = state["momentum_buffer"]
        buf = torch.where(h["first"], grad, old * momentum + h["one_minus_dampening"] * grad)
        moved = grad + momentum * buf if group["nesterov"] else buf
        direction = torch.where(momentum != 0, moved, grad)
        return p - h["lr"] * direction, {"momentum_buffer": buf}

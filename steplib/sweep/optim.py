"""Optimizers over a sweep's stacked parameters whose hyper-parameters differ per copy.

Why not ``torch.optim``: it refuses a learning rate tensor of more than one element, in every
variant. With the same hyper-parameters for every copy, a plain ``torch.optim.AdamW`` over
``copies.parameters()`` is exact already (Adam is element-wise); use these when any value
differs per copy, when copies are stopped one by one, or for per-copy skips.

Each hyper-parameter is a float (every copy) or a sequence of N floats (one per copy), held as
a ``[N]`` tensor in ``param_groups[0]["copies"]``. ``param_groups[0]["lr"]`` is a plain float
that a ``torch.optim.lr_scheduler`` scales as usual: the rate of copy ``i`` is
``group["lr"] * copies["lr"][i]``. Given per copy, ``lr`` starts as ``group["lr"] = 1.0`` and
``copies["lr"] = lr``, so a multiplicative schedule (``LambdaLR``, ``warmup_cosine``,
``StepLR``) gives copy ``i`` exactly the rate its own run would have had.

``group["active"]`` (a ``[N]`` bool tensor, saved with the optimizer) says which copies still
train: a stopped copy's parameters and optimizer state are never changed again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from steplib.errors import ConfigError, describe
from steplib.sweep.arguments import flag, is_sequence, number, per_copy_values
from steplib.sweep.flat_state import FlatState


class PerCopyOptimizer(torch.optim.Optimizer):
    """What the sweep optimizers share: the per-copy values, the active copies, and an update
    that leaves a copy alone where ``mask`` is False. Subclasses name their per-copy values in
    ``per_copy``, their buffers in ``state_keys``, and write ``update`` (element-wise, out of
    place), with ``derived`` and ``per_param`` for what is computed once per update.

    Args:
        params: ``copies.parameters()``: every tensor with the copies' leading dimension.
        n: the number of copies (``None``: the parameters' leading dimension).
        **hparams: ``lr`` and the names in ``per_copy`` (a float, or one per copy), and any
            setting shared by every copy.

    Attributes:
        n: the number of copies.
        lr_per_copy: whether the copies' rates differ from ``group["lr"]`` (a per-copy
            ``lr``), so that ``group["lr"]`` is a factor of each, no copy's rate.
    """

    per_copy: tuple[str, ...] = ()  # the hyper-parameters that may differ per copy
    state_keys: tuple[str, ...] = ()  # the per-parameter buffers, zeros at the first update
    # What torch.optim accepts, (name, lowest, above the highest): a value outside would make
    # that copy's own run refused, so the sweep refuses it too (NaN is outside every range).
    ranges: tuple[tuple[str, float, float], ...] = (("lr", 0.0, math.inf),)

    def __init__(self, params: Iterable[torch.Tensor], *, n: int | None, **hparams: Any) -> None:
        params = list(params)
        if not params or not all(isinstance(p, torch.Tensor) for p in params):
            raise ConfigError(
                f"{type(self).__name__} received params={describe(params)}; pass the sweep's "
                "parameters: copies.parameters()."
            )
        n = params[0].shape[0] if n is None and params[0].ndim else n
        if not isinstance(n, int) or n < 1 or any(p.ndim == 0 or p.shape[0] != n for p in params):
            raise ConfigError(
                f"{type(self).__name__}: every parameter must have the copies' leading "
                f"dimension ({n}); got shapes {[tuple(p.shape) for p in params][:4]}. Pass "
                "copies.parameters() of a steplib.sweep.Copies."
            )
        device = params[0].device
        values: dict[str, list[float]] = {}
        lr = hparams.pop("lr")
        group_lr = 1.0 if is_sequence(lr) else number(type(self).__name__, "lr", lr)
        values["lr"] = per_copy_values(type(self).__name__, "lr", lr if is_sequence(lr) else 1.0, n)
        for name in self.per_copy:
            values[name] = per_copy_values(type(self).__name__, name, hparams.pop(name), n)
        given = {**values, "lr": [group_lr * v for v in values["lr"]]}  # each copy's rate
        for name, low, high in self.ranges:
            for i, value in enumerate(given[name]):
                if not low <= value < high:
                    raise ConfigError(
                        f"{type(self).__name__}({name}=...) received {value} for copy {i}; "
                        f"torch.optim refuses it, so that copy's own run would not start. Pass "
                        f"{name} in [{low}, {high}) for every copy."
                    )
        # Held in float64, as torch.optim holds them (Python floats); cast per parameter.
        copies = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in values.items()}
        defaults = {
            "lr": group_lr,
            "copies": copies,
            "active": torch.ones(n, dtype=torch.bool, device=device),
            **hparams,
        }
        super().__init__(params, defaults)
        self.n = n
        self._flat: dict[tuple[Any, ...], FlatState] = {}
        # Whether group["lr"] is a factor of per-copy rates (no host read to tell, later).
        self.lr_per_copy = any(v != 1.0 for v in values["lr"])

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) keeps what torch.optim keeps; the rest is derived again.
        super().__setstate__(state)
        self.n = len(self.param_groups[0]["active"])
        self._flat = {}
        self.lr_per_copy = bool((self.param_groups[0]["copies"]["lr"] != 1.0).any())

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        mask: torch.Tensor | None = None,
    ) -> Any:
        """One update of every active copy; where ``mask`` (a ``[N]`` bool tensor) is False
        the copy is left exactly as it was (parameters, moments, step count)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            keep = group["active"] if mask is None else group["active"] & mask
            here = keep.view(-1, 1)
            # The hyper-parameters' arithmetic in float64, as torch.optim's on Python floats,
            # cast to the parameters' dtype once it is done (as a kernel casts a Python float).
            exact = {k: v.view(-1, 1) for k, v in group["copies"].items()}
            exact["lr"] = group["lr"] * exact["lr"]
            exact.update(self.derived(exact))
            kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
            for (dtype, device), params in kinds.items():
                cast = torch.stack(list(exact.values())).to(dtype).unbind(0)
                for i, packed in enumerate(_packs(params)):
                    flat = self._flat_state((index, dtype, device, i), packed)
                    h = dict(zip(exact, cast, strict=True))
                    steps = flat.steps.T.to(torch.float64)
                    for name, value in self.per_param(steps, exact).items():
                        value = value.to(dtype) if value.is_floating_point() else value
                        h[name] = flat.spread(value)
                    grads = [p.grad for p in packed if p.grad is not None]
                    old, grad = flat.gather(packed), flat.gather(grads)
                    new, buffers = self.update(old, grad, flat.buffers, h, group)
                    flat.write(here, new, old)
                    for key, value in buffers.items():
                        torch.where(here, value, flat.buffers[key], out=flat.buffers[key])
                    flat.steps.add_(keep.to(flat.steps.dtype))
        return loss

    def _flat_state(self, key: tuple[Any, ...], params: list[torch.Tensor]) -> FlatState:
        """The layout of these parameters' state, made again when it no longer fits (other
        parameters had a gradient, or a load replaced the state's tensors)."""
        flat = self._flat.get(key)
        if flat is None or not flat.fits(self.state, params):
            flat = self._flat[key] = FlatState(self.state, params, self.state_keys, self.n)
        return flat

    def derived(self, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values computed from the hyper-parameters alone (``1 - beta1``, ...): once per
        update, in float64 (each ``[N, 1]``), cast to the parameters' dtype afterwards."""
        return {}

    def per_param(self, step: torch.Tensor, h: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values computed from the step counts (bias corrections, ...), in float64: ``step``
        is ``[N, P]`` (each copy's count for each parameter, before this update) and so is each
        value; :meth:`update` receives them cast and spread over each parameter's elements
        (``[N, D]``)."""
        return {}

    def update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        h: dict[str, torch.Tensor],
        group: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(new parameters, {buffer: new value})`` out of place, for every copy. ``p``,
        ``grad`` and the buffers are ``[N, D]``: every parameter of one dtype, flattened and
        laid end to end (the update is element-wise); ``h`` holds the hyper-parameters and
        :meth:`derived` values (``[N, 1]``) and the :meth:`per_param` values (``[N, D]``)."""
        raise NotImplementedError


class SweepAdamW(PerCopyOptimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) or, with ``decoupled=False``,
    Adam with L2 weight decay (as ``torch.optim.Adam``), with per-copy hyper-parameters.

    Args:
        params: ``copies.parameters()``.
        lr, beta1, beta2, eps, weight_decay: a float, or a sequence of one value per copy.
            ``weight_decay`` left out is torch's default for the variant: AdamW's 1e-2, Adam's 0.
        decoupled: AdamW's decay (``p *= 1 - lr * wd``) when True, Adam's L2 term otherwise.
        n: the number of copies (read from the parameters when left out).

    Raises:
        ConfigError: a value that is not a number, a sequence of the wrong length, a value
            ``torch.optim.AdamW`` refuses (``lr``, ``eps`` or ``weight_decay`` below 0, a beta
            outside [0, 1), NaN), ``decoupled`` not a bool, or parameters without the copies'
            leading dimension.

    Example:
        >>> import torch
        >>> from steplib.sweep import Copies
        >>> copies = Copies.stack([torch.nn.Linear(2, 1) for _ in range(3)])
        >>> opt = SweepAdamW(copies.parameters(), lr=[1e-3, 3e-3, 1e-2], weight_decay=0.01)
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["copies"]["lr"].tolist()
        (1.0, [0.001, 0.003, 0.01])
    """

    per_copy = ("beta1", "beta2", "eps", "weight_decay")
    state_keys = ("exp_avg", "exp_avg_sq")
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
        params: Iterable[torch.Tensor],
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
        params: ``copies.parameters()``.
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
    state_keys = ("momentum_buffer",)
    ranges = (("lr", 0.0, math.inf), ("momentum", 0.0, math.inf), ("weight_decay", 0.0, math.inf))

    def __init__(
        self,
        params: Iterable[torch.Tensor],
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
        # torch.optim.SGD refuses Nesterov without momentum or with dampening: that copy's own
        # run would not start (here it would train on, as plain or dampened SGD).
        copies = self.param_groups[0]["copies"]
        pairs = zip(copies["momentum"].tolist(), copies["dampening"].tolist(), strict=True)
        for i, (moment, damp) in enumerate(pairs):
            if nesterov and (moment <= 0 or damp != 0):
                raise ConfigError(
                    f"SweepSGD(nesterov=True) received momentum={moment}, dampening={damp} for "
                    f"copy {i}; torch.optim.SGD refuses Nesterov without momentum or with "
                    "dampening, so that copy's own run would not start. Give every copy a "
                    "momentum > 0 and dampening=0, or sweep those copies with nesterov=False."
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


# Packing a parameter with others saves about 20 operations per update but copies its elements
# a few times (gathered, spread, written back): above about 32K elements (all copies) the
# copies cost more than the operations saved (a 16-128-128-10 MLP, 8 copies: 3.4 ms packed
# against 2.5 ms one by one; 16-32-32-10: 0.33 ms packed against 0.53 ms).
PACK_LIMIT = 2**15


def _packs(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The small parameters together, each large one alone."""
    small = [p for p in params if p.numel() <= PACK_LIMIT]
    return ([small] if small else []) + [[p] for p in params if p.numel() > PACK_LIMIT]

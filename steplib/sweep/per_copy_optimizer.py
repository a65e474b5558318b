"""``PerCopyOptimizer``: the base of the optimizers over a sweep's stacked parameters whose
hyper-parameters differ per copy (``SweepAdamW``, ``SweepSGD`` in ``steplib.sweep.optim``).

Why not ``torch.optim``: it refuses a learning rate tensor of more than one element, in every
variant. With the same hyper-parameters for every copy, a plain ``torch.optim.AdamW`` over
``copies.parameters()`` is exact already (Adam is element-wise); use these when any value
differs per copy, when copies are stopped one by one, or for per-copy skips.

Each hyper-parameter is a float (every copy) or a sequence of N floats (one per copy), held in
each parameter group as a ``[N]`` tensor in ``group["copies"]``. ``group["lr"]`` is a plain
float that a ``torch.optim.lr_scheduler`` scales as usual: the rate of copy ``i`` is
``group["lr"] * group["copies"]["lr"][i]``. Given per copy, ``lr`` starts as
``group["lr"] = 1.0`` and ``copies["lr"] = lr``, so a multiplicative schedule (``LambdaLR``,
``warmup_cosine``, ``StepLR``) gives copy ``i`` exactly the rate its own run would have had.

Parameter groups are torch.optim's: ``params`` may be a list of dicts (``{"params": [...],
"weight_decay": 0.0}``, what ``steplib.param_groups.weight_decay_groups`` returns), and a value
a group gives (a float or one per copy) overrides the optimizer's for that group. One group or
several, every group is read by :meth:`PerCopyOptimizer.add_param_group`.

``param_groups[0]["active"]`` (a ``[N]`` bool tensor, saved with the optimizer) says which
copies still train, in every group: a stopped copy's parameters and optimizer state are never
changed again. The sweep step keeps each copy's skipped updates in a row beside it, in
``param_groups[0]["consecutive_skips"]`` (``steplib.sweep.stopped``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.sweep.arguments import (
    flag,
    given_groups,
    is_sequence,
    number,
    per_copy_values,
    tensor_list,
)
from steplib.sweep.flat_state import FlatState


class PerCopyOptimizer(torch.optim.Optimizer):
    """What the sweep optimizers share: the per-copy values, the active copies, and an update
    that leaves a copy alone where ``mask`` is False. Subclasses name their per-copy values in
    ``per_copy``, their buffers in ``state_keys``, and write ``update`` (element-wise, out of
    place), with ``derived`` and ``per_param`` for what is computed once per update.

    Args:
        params: ``copies.parameters()``: every tensor with the copies' leading dimension; or
            parameter groups, ``[{"params": [...], "weight_decay": 0.0}, ...]``, each value a
            group gives overriding the optimizer's for that group.
        n: the number of copies (``None``: the parameters' leading dimension).
        **hparams: ``lr`` and the names in ``per_copy`` (a float, or one per copy), and the
            settings in ``flags`` (one bool for every copy).

    Attributes:
        n: the number of copies.
        lr_per_copy: the indices of the groups whose copies' rates differ (a per-copy ``lr``),
            so that their ``group["lr"]`` is a factor of each copy's rate, no copy's rate
            (empty: no such group).
    """

    per_copy: tuple[str, ...] = ()  # the hyper-parameters that may differ per copy
    # Settings that are one bool for every copy (a group may set its own).
    flags: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()  # the per-parameter buffers, zeros at the first update
    # What torch.optim accepts, (name, lowest, above the highest): a value outside would make
    # that copy's own run refused, so the sweep refuses it too (NaN is outside every range).
    ranges: tuple[tuple[str, float, float], ...] = (("lr", 0.0, math.inf),)
    # torch.optim's settings that this optimizer does not read, and the fix: in a group (copied
    # from a torch.optim recipe) they would be ignored in silence.
    unread: tuple[tuple[str, str], ...] = ()

    def __init__(self, params: Iterable[Any], *, n: int | None, **hparams: Any) -> None:
        groups = given_groups(type(self).__name__, params)
        first = next(p for group in groups for p in group["params"])  # given_groups: one is
        if first.ndim and n is None:
            n = first.shape[0]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(
                f"{type(self).__name__} could not tell the number of copies (n={n!r}); pass "
                "copies.parameters() of a steplib.sweep.Copies, whose tensors all have the "
                "copies' leading dimension."
            )
        self.n = n
        self.lr_per_copy: tuple[int, ...] = ()
        self._flat: dict[tuple[Any, ...], FlatState] = {}
        super().__init__(groups, hparams)  # every group, the first too, through add_param_group
        # One mask for every group, kept (and saved) in the first.
        self.param_groups[0]["active"] = torch.ones(n, dtype=torch.bool, device=first.device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as ``torch.optim`` does: a value it leaves out is the optimizer's, and
        each per-copy value (a float or one per copy) becomes ``group["copies"][name]`` (a
        ``[N]`` float64 tensor), ``lr`` a factor in ``group["lr"]`` times ``copies["lr"]``.

        Raises:
            ConfigError: a value torch.optim refuses for some copy, a sequence of another
                length than N, a flag that is not one bool, a torch.optim setting this
                optimizer does not read (``betas``: pass ``beta1``, ``beta2``), or parameters
                without the copies' leading dimension.
        """
        owner, index = type(self).__name__, len(self.param_groups)
        group = {**self.defaults, **param_group}
        params = group["params"] = tensor_list(group.get("params"))  # a tensor: one, as torch's
        shapes = [tuple(p.shape) for p in params or []]
        if params is None or any(not shape or shape[0] != self.n for shape in shapes):
            held = "no list of tensors" if params is None else f"shapes {shapes[:4]}"
            raise ConfigError(
                f"{owner}: every parameter must have the copies' leading dimension ({self.n}); "
                f"param group {index} has {held}. Pass copies.parameters() of a "
                "steplib.sweep.Copies (or groups of them)."
            )
        for name, fix in self.unread:
            if name in param_group:
                raise ConfigError(
                    f"{owner}: param group {index} sets {name}={param_group[name]!r}, a "
                    f"torch.optim setting that {owner} does not read: it would be ignored in "
                    f"silence. {fix}"
                )
        lr = group["lr"]
        factor = 1.0 if is_sequence(lr) else number(owner, "lr", lr)
        values = {"lr": per_copy_values(owner, "lr", lr if is_sequence(lr) else 1.0, self.n)}
        for name in self.per_copy:
            values[name] = per_copy_values(owner, name, group[name], self.n)
        given = {**values, "lr": [factor * v for v in values["lr"]]}  # each copy's rate
        for name, low, high in self.ranges:
            for i, value in enumerate(given[name]):
                if not low <= value < high:
                    raise ConfigError(
                        f"{owner}({name}=...) received {value} for copy {i} (param group "
                        f"{index}); torch.optim refuses it, so that copy's own run would not "
                        f"start. Pass {name} in [{low}, {high}) for every copy."
                    )
        for name in self.flags:
            group[name] = flag(owner, name, group[name])
        self.check_group(group, given, index)
        device = params[0].device if params else torch.device("cpu")
        # Held in float64, as torch.optim holds them (Python floats); cast per parameter.
        group["lr"] = factor
        group["copies"] = {
            k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in values.items()
        }
        super().add_param_group(group)
        # Whether group["lr"] is a factor of per-copy rates (known here: no host read later).
        if any(v != 1.0 for v in values["lr"]):
            self.lr_per_copy += (index,)

    def check_group(self, group: dict[str, Any], given: dict[str, list[float]], index: int) -> None:
        """Refuse what torch.optim refuses for a group beyond each value's range (``given``:
        each copy's values, its rate included)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) keeps what torch.optim keeps; the rest is derived again.
        super().__setstate__(state)
        self.n = len(self.param_groups[0]["active"])
        self._flat = {}
        self.lr_per_copy = tuple(
            i for i, g in enumerate(self.param_groups) if bool((g["copies"]["lr"] != 1.0).any())
        )

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
        active = self.param_groups[0]["active"]  # one mask for every group
        keep = active if mask is None else active & mask
        here = keep.view(-1, 1)
        for index, group in enumerate(self.param_groups):
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


# Packing a parameter with others saves about 20 operations per update but copies its elements
# a few times (gathered, spread, written back): above about 32K elements (all copies) the
# copies cost more than the operations saved (a 16-128-128-10 MLP, 8 copies: 3.4 ms packed
# against 2.5 ms one by one; 16-32-32-10: 0.33 ms packed against 0.53 ms).
PACK_LIMIT = 2**15


def _packs(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The small parameters together, each large one alone."""
    small = [p for p in params if p.numel() <= PACK_LIMIT]
    return ([small] if small else []) + [[p] for p in params if p.numel() > PACK_LIMIT]

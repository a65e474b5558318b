"""What a wrapper contributes to a step: the public API that the built-in wrappers and yours use.

A wrapper is ``Step -> Step``: it builds a :class:`Part` and returns ``add_part(step, part)``.
A part contributes at named points; the core runs every part's contributions in one fixed order,
whatever order the wrappers were applied in:

1. per micro-batch: ``micro_context`` (around forward *and* backward: ``no_sync``, anomaly mode)
   -> ``forward_context`` (around ``loss_fn`` only: autocast) -> backward (``before_backward`` /
   ``after_backward`` hooks);
2. when the window closes, the gradient transforms by ``order``: ``UNSCALE`` (the state's
   ``GradScaler``) -> ``NORMALISE`` (divide by the window's target count) -> ``TRANSFORM``
   (the default for yours) -> ``CLIP`` -> ``FINITE`` (decide whether to skip);
3. the update: ``before_update`` -> each part's ``update`` around the optimizer step ->
   ``after_update`` -> the scaler's update -> ``zero_grad`` -> ``after_zero_grad`` -> scheduler.

That fixed order is why ``clip(amp_wrap(s))`` equals ``amp_wrap(clip(s))``: clipping sees the
unscaled, normalised gradients in every order (law 5).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any, NamedTuple

import torch

from steplib.errors import ConfigError, describe
from steplib.state import TrainState

# The ranks of the gradient transforms; anything between is allowed (ties keep the order in
# which the wrappers were applied).
UNSCALE = 100
NORMALISE = 200
TRANSFORM = 300
CLIP = 400
FINITE = 500

Hook = Callable[[TrainState], Any]
HOOK_POINTS = (
    "before_backward",
    "after_backward",
    "before_update",
    "after_update",
    "after_zero_grad",
)


_get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an FSDP2 norm is one), any other tensor as it is."""
    if type(tensor) is torch.Tensor:  # the usual case, without a failed attribute lookup
        return tensor
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


class GradSync:
    """How gradients and window counts are shared across processes: what ``ddp_wrap``,
    ``fsdp_wrap`` and the pipeline step contribute (``Part(sync=...)``, at most one per step).
    This base class is the single-process strategy and does nothing."""

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor | int, int]:
        """The window's loss sum and target count over all processes, and by how many
        processes the gradients were averaged (the gradient divisor is ``targets / that``)."""
        return loss_sum, targets, 1

    def sync_unsynced(self, state: TrainState) -> None:
        """Synchronise gradients whose last backward ran without sync (a window closed by
        ``flush`` after the data ended)."""

    def total_norm(
        self, grads: list[torch.Tensor], norm_type: float, *, device: torch.device
    ) -> torch.Tensor:
        """The norm of the gradients of the whole model (a pipeline stage holds part of it);
        ``device`` is the state's, for a process that holds no gradient."""
        if not grads:
            return torch.zeros((), device=device)
        if _get_total_norm is not None:  # also reduces sharded (DTensor) gradients
            return _get_total_norm(grads, norm_type)
        norms = torch._foreach_norm(grads, norm_type)
        return torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)

    def describe(self) -> dict[str, Any]:
        return {}


LOCAL = GradSync()


class Gradients:
    """The window's gradients as the transforms see them, made once per update and passed to
    every ``grad_transform`` in order. Change ``grads`` in place (or :meth:`scale_` them);
    set ``grad_norm`` when you measure it (it is reported as ``out.grad_norm``); call
    :meth:`flag_nonfinite` to skip the update. Nothing here is read on the host.

    The division by the window's target count (``NORMALISE``) is kept pending until a transform
    reads ``params`` or ``grads``, so that a norm and a scaling (clipping) fold it in: one pass
    over the gradients instead of two. Every transform sees normalised values either way.

    Attributes:
        state: the state being updated.
        params: the optimizer's parameters that have a gradient.
        grads: their gradients (``p.grad``), summed over the window and normalised.
        loss_sum: the window's loss sum over every process.
        num_targets: the window's target count over every process.
        divisor: what ``NORMALISE`` divides the gradients by (the count, over the processes
            that did not already average them).
        grad_norm: the total norm before clipping, once a transform measured it.
        nonfinite: a bool tensor, True when the update must be skipped, else ``None``.
    """

    def __init__(
        self,
        state: TrainState,
        *,
        loss_sum: torch.Tensor,
        num_targets: torch.Tensor | int,
        divisor: torch.Tensor | float,
        sync: GradSync,
    ) -> None:
        self.state = state
        # The optimizer's parameters: what it will update (and cheaper to list than a module).
        self._params = [
            p for g in state.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        self._grads: list[torch.Tensor] = [p.grad for p in self._params]
        self._pending: torch.Tensor | float | None = None
        self.loss_sum = loss_sum
        self.num_targets = num_targets
        self.divisor = divisor
        self.grad_norm: torch.Tensor | None = None
        self.nonfinite: torch.Tensor | None = None
        self.sync = sync

    @property
    def params(self) -> list[torch.Tensor]:
        self.settle()
        return self._params

    @property
    def grads(self) -> list[torch.Tensor]:
        self.settle()
        return self._grads

    def divide_by(self, divisor: torch.Tensor | float) -> None:
        """Divide the gradients by ``divisor`` (what ``NORMALISE`` does with the window's
        count). A window of no valid targets (a count <= 0) contributes no gradient: its
        gradients are divided by infinity, i.e. zeroed, without a host read of the count."""
        if isinstance(divisor, torch.Tensor):
            divisor = torch.where(divisor > 0, divisor, math.inf)
        elif divisor == 1:
            return
        elif divisor <= 0:
            divisor = math.inf
        self._pending = divisor if self._pending is None else self._pending * divisor

    def norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The total gradient norm over the whole model (every stage, every shard), summed in
        the model's parameter order, as ``clip_grad_norm_(model.parameters())`` sums it."""
        # A total norm sums the per-tensor norms in the order it is given them. In the
        # optimizer's (weight_decay_groups': the weights, then the biases) it differed from
        # clip_grad_norm_(model.parameters())'s in the last bit, and with it the clipped update.
        # The walk over the modules is the one that call makes.
        given = {id(p): p for p in self._params}
        ordered = [p for p in self.state.model.parameters() if given.pop(id(p), None) is not None]
        grads = [p.grad for p in (*ordered, *given.values())]  # none left: TrainState.create
        norm = self.sync.total_norm(grads, norm_type, device=self.state.device)
        return norm if self._pending is None else norm / self._pending

    def scale_(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by ``factor`` (a pending division rides on it)."""
        if self._pending is not None:
            factor, self._pending = factor / self._pending, None
        if self._grads:
            if isinstance(factor, torch.Tensor):
                factor = factor.to(self._grads[0].device)
            torch._foreach_mul_(self._grads, factor)

    def settle(self) -> None:
        """Apply a pending division now (the core calls it after the last transform)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if self._grads:
                torch._foreach_div_(self._grads, pending)

    def flag_nonfinite(self, bad: torch.Tensor) -> None:
        """Skip this update where ``bad`` (a bool tensor) is True; flags are OR-ed."""
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad


class GradReport(NamedTuple):
    """What ``process_grads`` measured, all on the device.

    Attributes:
        loss_sum: the window's loss sum over every process.
        num_targets: the window's target count over every process.
        grad_norm: the total gradient norm before clipping, if a transform measured it.
        nonfinite: a bool tensor, True when the update must be skipped (a non-finite value, or
            a window with no targets), else ``None``.
        updated: the runner made the optimizer update with phase 2 (``compile_step``, when
            nothing may act between them); phase 3 then does not make it again.
    """

    loss_sum: torch.Tensor
    num_targets: torch.Tensor | int
    grad_norm: torch.Tensor | None
    nonfinite: torch.Tensor | None
    updated: bool = False


GradTransform = Callable[[Gradients], None]
Update = Callable[[TrainState, Callable[[], None]], None]


@dataclasses.dataclass(frozen=True)
class Part:
    """One wrapper's contribution to a step. Every field but ``name`` is optional; a field left
    at its default contributes nothing (one code path: a disabled feature is a no-op).

    Attributes:
        name: the wrapper's name, shown by ``step.describe()`` (which checkpoints compare on
            resume); a step takes each name once.
        settings: the wrapper's settings as plain data, shown by ``describe()``.
        window: micro-batches per optimizer update (``accumulate``).
        micro_context: ``fn(state, sync) -> context manager`` entered around forward *and*
            backward of each micro-batch; ``sync`` is False on micro-batches whose gradients
            must stay local. Contexts nest in the order the wrappers were applied (the first
            outermost).
        forward_context: ``fn(state) -> context manager`` entered around ``loss_fn`` only.
        grad_transform: ``fn(gradients)`` run when the window closes, at ``order``; see
            :class:`Gradients`.
        order: where ``grad_transform`` runs in the gradient order: ``UNSCALE`` <
            ``NORMALISE`` < ``TRANSFORM`` (the default) < ``CLIP`` < ``FINITE``, or any number
            between.
        update: ``fn(state, apply)`` around the optimizer update: call ``apply()`` once to
            run it (and the parts inside). Not called for an update skipped on the host.
        hooks: ``{point: fn(state)}`` for points in ``HOOK_POINTS``.
        sync: the :class:`GradSync` that shares gradients across processes (one per step).
        max_consecutive_skips: raise ``TooManySkipsError`` after more skipped updates in a row.
        runner: replaces how the phases run (``compile_step``, the pipeline step).
        last: nothing may be applied after this part (its runner captured the step).
    """

    name: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    window: int | None = None
    micro_context: Callable[[TrainState, bool], ContextManager[Any]] | None = None
    forward_context: Callable[[TrainState], ContextManager[Any]] | None = None
    grad_transform: GradTransform | None = None
    order: float = TRANSFORM
    update: Update | None = None
    hooks: Mapping[str, Hook] = dataclasses.field(default_factory=dict)
    sync: GradSync | None = None
    max_consecutive_skips: int | None = None
    runner: Any = None  # a steplib.step.Runner (core.py, which imports this module)
    last: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"Part(name=...) received {describe(self.name)}; name the wrapper, e.g. "
                "Part(name='adaptive_clip', ...)."
            )
        for field in ("micro_context", "forward_context", "grad_transform", "update"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise ConfigError(
                    f"Part({field}=...) of {self.name!r} received {describe(value)}, which is "
                    f"not callable. Pass a function, e.g. Part(name=..., {field}=my_function)."
                )
        unknown = sorted(set(self.hooks) - set(HOOK_POINTS))
        if unknown:
            raise ConfigError(
                f"Part(hooks=...) of {self.name!r} names the unknown point(s) {unknown}. The "
                f"points are: {', '.join(HOOK_POINTS)}."
            )
        for point, hook in self.hooks.items():
            if not callable(hook):
                raise ConfigError(
                    f"Part(hooks={{{point!r}: ...}}) of {self.name!r} received {describe(hook)}, "
                    f"which is not callable. Pass a function of the state: lambda state: ..."
                )
        if self.sync is not None and not isinstance(self.sync, GradSync):
            raise ConfigError(
                f"Part(sync=...) of {self.name!r} received {describe(self.sync)}; pass a "
                "steplib.step.GradSync (subclass it to share gradients across processes)."
            )
        object.__setattr__(self, "settings", dict(self.settings))

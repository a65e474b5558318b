"""The ``Step`` record and ``make_train_step``.

A step is a frozen record: the user's ``loss_fn`` plus the settings the wrappers captured when
it was built. Its three phases are written once, in the order DESIGN.md §5.4 fixes:

1. ``forward_backward``: autocast -> forward -> (scaled) backward of the loss *sum*, under the
   gradient-sync context (DDP's ``no_sync`` on non-final micro-batches).
2. ``process_grads``: unscale -> divide by the window's target count -> clip -> finiteness.
3. ``apply``: optimizer step (unless skipped) -> scaler update -> zero_grad -> scheduler.

Wrappers never re-implement a phase; they set the settings the phases read. That is why any
order of the built-in wrappers gives the same step (``clip(amp_wrap(s)) == amp_wrap(clip(s))``):
clipping always sees unscaled, normalised gradients.

Why the gradient of the *sum* is accumulated and divided once per window: the target count of
a window is only known when it closes (and across ranks only after a reduction), so dividing
per micro-batch by ``k`` is wrong when micro-batches hold different numbers of targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any, NamedTuple, cast

import torch

from steplib.errors import ConfigError, TooManySkipsError, describe, model_batch_fn
from steplib.state import StepOutput, TrainState, _evolve
from steplib.step import device_skips
from steplib.step.device_skips import decides_on_device
from steplib.step.loss_output import LossOutput, parse_loss_output

LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class AmpConfig:
    """Settings captured by ``amp_wrap``."""

    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, slots=True)
class ClipConfig:
    """Settings captured by ``clip``; ``None`` disables that kind of clipping."""

    max_norm: float | None
    norm_type: float
    max_value: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class SkipConfig:
    """Settings captured by ``skip_nonfinite``."""

    max_consecutive: int | None


Hook = Callable[[TrainState], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class PhaseHooks:
    """User functions ``fn(state)`` called at the step's phase boundaries (set by ``tap``)."""

    before_backward: Hook | None = None
    after_backward: Hook | None = None
    before_update: Hook | None = None
    after_update: Hook | None = None
    after_zero_grad: Hook | None = None


class GradReport(NamedTuple):
    """What ``process_grads`` measured, all on the device: the window's loss sum and target
    count over every process, the pre-clip gradient norm, and the non-finite flag."""

    loss_sum: torch.Tensor
    num_targets: torch.Tensor | int
    grad_norm: torch.Tensor | None
    nonfinite: torch.Tensor | None


def _step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


# A nullcontext holds no state, so one instance serves every `with` (no allocation per call).
_NO_CONTEXT: ContextManager[Any] = contextlib.nullcontext()


class GradSync:
    """How gradients and window counts are shared across processes: the hook ``ddp_wrap`` and
    ``fsdp_wrap`` fill in. This base class is the single-process strategy and does nothing.
    """

    def micro_context(self, state: TrainState, sync: bool) -> ContextManager[Any]:
        """Entered around forward *and* backward of a micro-batch; ``sync`` is False on
        micro-batches whose gradients must stay local (DDP ``no_sync``)."""
        return _NO_CONTEXT

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor | int, int]:
        """The window's loss sum and target count over all processes, and by how many
        processes the gradients were averaged (the gradient divisor is ``targets / that``)."""
        return loss_sum, targets, 1

    def sync_unsynced(self, state: TrainState) -> None:
        """Synchronise gradients whose last backward ran with ``sync=False`` (a window closed by
        ``flush`` after the data ended)."""

    def describe(self) -> dict[str, Any]:
        return {}


LOCAL = GradSync()


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """A training step: ``step(state, batch) -> (state, StepOutput)``. Build with
    :func:`make_train_step`, then wrap (``accumulate``, ``clip``, ``amp_wrap``, ...).

    Attributes:
        loss_fn: the user's ``loss_fn(model, batch)``.
        accumulation: micro-batches per optimizer update.
        amp: autocast settings, or ``None`` for full precision.
        clip: clipping settings, or ``None``.
        skip: non-finite skipping settings, or ``None``.
        grad_sync: how gradients and window counts are shared across processes
            (:class:`GradSync`; ``ddp_wrap`` / ``fsdp_wrap`` set it).
        applied: the wrappers applied, in order, with their settings (the step's fingerprint).
        optimizer_step: how the optimizer is stepped (``compile_step`` compiles it).
        hooks: user functions called at the phase boundaries (``tap``), else ``None``.
        compile_stats: graph and recompile counts of a compiled step (``compile_step``), else
            ``None``.
    """

    loss_fn: LossFn
    accumulation: int = 1
    amp: AmpConfig | None = None
    clip: ClipConfig | None = None
    skip: SkipConfig | None = None
    grad_sync: GradSync = LOCAL
    applied: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    optimizer_step: Callable[[torch.optim.Optimizer], Any] = _step_optimizer
    compile_stats: Any = None
    hooks: PhaseHooks | None = None

    def __call__(
        self, state: TrainState, batch: Any, *, close_window: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Run one micro-batch; update the parameters when it closes the accumulation window.

        Args:
            state: the current state (never mutated; see ``TrainState`` for what changes in
                place).
            batch: whatever ``loss_fn`` consumes.
            close_window: close the window after this micro-batch even if it holds fewer than
                ``accumulation`` micro-batches (the last batch of an epoch); the update is then
                normalised by what the window held.

        Returns:
            ``(next_state, output)``.
        """
        size = state.window_size + 1
        closes = close_window or size >= self.accumulation
        out = self.forward_backward(state, batch, sync=closes)
        loss_sum = out.loss_sum.detach()
        state = _evolve(
            state,
            {
                "micro_step": state.micro_step + 1,
                "window_size": size,
                # The first micro-batch of a window starts the sum: no add, no zero tensor.
                "window_loss": loss_sum.float() if size == 1 else state.window_loss + loss_sum,
                # int + int stays on the host; a tensor count makes it a device tensor.
                "window_targets": state.window_targets + out.num_targets,
            },
        )
        if closes:
            return self._close(state, out.aux)
        return state, StepOutput(
            loss_sum=loss_sum,
            num_targets=out.num_targets,
            did_update=False,
            skipped=False,
            grad_norm=None,
            lr=_lr_now(state),
            aux=out.aux,
        )

    def flush(self, state: TrainState) -> tuple[TrainState, StepOutput | None]:
        """Close an open, shorter window (the data ended before ``accumulation`` micro-batches).

        Prefer ``step(state, batch, close_window=True)`` on the last batch when you know it is
        the last: with DDP that batch's backward then all-reduces directly.

        Returns:
            ``(state, None)`` when no window is open, else the state and output of the update,
            normalised by the targets the window actually held.
        """
        if state.window_size == 0:
            return state, None
        self.grad_sync.sync_unsynced(state)  # its last backward ran without gradient sync
        return self._close(state, {})

    def forward_backward(self, state: TrainState, batch: Any, *, sync: bool) -> LossOutput:
        """Phase 1: forward under autocast, backward of the (scaled) loss sum.

        ``sync`` is False on micro-batches whose gradients must stay local (DDP ``no_sync``):
        the forward pass is inside the same context, as DDP requires.
        """
        autocast = (
            torch.autocast(state.device.type, dtype=self.amp.dtype)
            if self.amp is not None
            else _NO_CONTEXT
        )
        with self.grad_sync.micro_context(state, sync):
            with autocast:
                out = parse_loss_output(self.loss_fn(state.model, batch))
            loss = out.loss_sum
            if state.scaler is not None or self.amp is not None:  # skip the call when plain
                loss = _scaled(self, state, loss)
            hooks = self.hooks
            if hooks is not None and hooks.before_backward is not None:
                hooks.before_backward(state)
            loss.backward()
            if hooks is not None and hooks.after_backward is not None:
                hooks.after_backward(state)
        return out

    def process_grads(self, state: TrainState) -> GradReport:
        """Phase 2: unscale, divide by the window's targets, clip, check finiteness.

        Every operation stays on the device; the non-finite flag is a tensor.
        """
        window_loss: torch.Tensor = state.window_loss  # type: ignore[assignment]  # non-empty
        loss_sum, targets, averaged = self.grad_sync.reduce_window(
            state, window_loss, state.window_targets
        )
        # The optimizer's parameters: what it will update (and cheaper to list than a module).
        params = [
            p for g in state.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        grads: list[torch.Tensor] = [p.grad for p in params]
        nonfinite: torch.Tensor | None = None
        if _scaler_active(self, state):
            scaler, optimizer = state.scaler, state.optimizer
            scaler.unscale_(optimizer)  # type: ignore[union-attr]
            found = scaler._found_inf_per_device(optimizer).values()  # type: ignore[union-attr]
            nonfinite = torch.stack([f.to(state.device) for f in found]).sum() > 0
        # DDP already averaged the gradients over `averaged` processes: divide by the rest.
        divisor = targets if averaged == 1 else targets / averaged
        grad_norm: torch.Tensor | None = None
        clip = self.clip
        if clip is not None and clip.max_value is not None:
            _normalise(grads, divisor)  # value limits apply to the normalised gradients
            divisor = 1
            torch.nn.utils.clip_grad_value_(params, clip.max_value)
        if clip is not None and clip.max_norm is not None:
            grad_norm = _clip_norm(params, grads, clip.max_norm, clip.norm_type, divisor)
        else:
            _normalise(grads, divisor)
        if self.skip is not None and grad_norm is None:
            grad_norm = _total_norm(grads, state.device)
        if grad_norm is not None:
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()  # FSDP2's norm is a DTensor; output a plain one
            if self.skip is not None:
                # The global loss and the synchronised gradients: every rank decides alike.
                bad = ~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)
                nonfinite = bad if nonfinite is None else nonfinite | bad
        return GradReport(loss_sum, targets, grad_norm, nonfinite)

    def apply(
        self, state: TrainState, report: GradReport
    ) -> tuple[TrainState, bool | torch.Tensor]:
        """Phase 3: optimizer step unless skipped, scaler update, zero_grad, scheduler.

        A skip decision stays on the device when the optimizer can skip inside its kernel (a
        fused optimizer) and the scheduler is ``None`` or a ``LambdaLR`` (see
        ``steplib.device_skips``); otherwise it is read on the host, once per update.

        Returns:
            The state with the window reset and the counters advanced, and whether the update
            was applied: a bool, or a bool device tensor when the decision stayed there.

        Raises:
            TooManySkipsError: ``skip_nonfinite(max_consecutive=n)`` saw more than n skips in a
                row.
        """
        nonfinite = report.nonfinite
        on_device = nonfinite is not None and decides_on_device(state.optimizer, state.scheduler)
        applied: bool | torch.Tensor = True
        if nonfinite is not None:
            # The host read, when the decision cannot stay on the device: a host-side
            # scheduler must know whether to advance. Once per update, never mid-window.
            applied = ~nonfinite if on_device else not bool(nonfinite)
        hooks = self.hooks
        if applied is not False:
            if hooks is not None and hooks.before_update is not None:
                hooks.before_update(state)  # the final, unscaled, normalised, clipped gradients
            optimizer = state.optimizer
            if on_device:
                # What GradScaler.step does for fused optimizers: the kernel skips the update
                # (step counters included) when found_inf is 1.
                optimizer.found_inf = nonfinite.float()  # type: ignore[attr-defined,union-attr]
                optimizer.grad_scale = None  # type: ignore[attr-defined]
                try:
                    self.optimizer_step(optimizer)
                finally:
                    del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
            else:
                self.optimizer_step(optimizer)
            if hooks is not None and hooks.after_update is not None:
                hooks.after_update(state)
        if _scaler_active(self, state):
            state.scaler.update()  # type: ignore[union-attr]
        state.optimizer.zero_grad(set_to_none=True)
        if hooks is not None and hooks.after_zero_grad is not None:
            hooks.after_zero_grad(state)
        limit = self.skip.max_consecutive if self.skip is not None else None
        changes: dict[str, Any] = {
            "step": state.step + 1,
            "window_size": 0,
            "window_loss": 0.0,
            "window_targets": 0,
        }
        if isinstance(applied, torch.Tensor):
            changes.update(self._count_on_device(state, applied, limit))
            return _evolve(state, changes), applied
        if applied and state.scheduler is not None:
            state.scheduler.step()
        consecutive = 0 if applied else state.consecutive_skips + 1
        if limit is not None and consecutive > limit:  # host-decided: an int
            _too_many_skips(int(consecutive), limit, state.step)
        changes["skipped_updates"] = state.skipped_updates + (0 if applied else 1)
        changes["consecutive_skips"] = consecutive
        return _evolve(state, changes), applied

    def _count_on_device(
        self, state: TrainState, applied: torch.Tensor, limit: int | None
    ) -> dict[str, Any]:
        """The counters and the scheduler's position after an update decided on the device."""
        record = state.device_skips or device_skips.start(
            state.optimizer, state.scheduler, state.device
        )
        record = device_skips.advance(
            record, optimizer=state.optimizer, scheduler=state.scheduler, applied=applied
        )
        skipped = (~applied).to(torch.int64)
        consecutive = (state.consecutive_skips + skipped) * skipped
        if limit is not None:
            record, seen = device_skips.check_consecutive(record, consecutive, limit)
            if seen is not None:
                _too_many_skips(seen, limit, state.step)
        return {
            "skipped_updates": state.skipped_updates + skipped,
            "consecutive_skips": consecutive,
            "device_skips": record,
        }

    def describe(self) -> list[dict[str, Any]]:
        """The composition as plain data: ``[{"wrapper": name, **settings}, ...]`` in order."""
        return [{"wrapper": name, **settings} for name, settings in self.applied]

    def _close(
        self, state: TrainState, aux: Mapping[str, torch.Tensor]
    ) -> tuple[TrainState, StepOutput]:
        lr = _lr_now(state)  # before the scheduler moves it
        # An async checkpoint may still be copying the parameters and optimizer state in the
        # background; this update changes them. (Phase 2 may run the update: compile_step.)
        state.fence.wait()
        report = self.process_grads(state)
        state, applied = self.apply(state, report)
        return state, StepOutput(
            loss_sum=report.loss_sum,
            num_targets=report.num_targets,
            did_update=applied,
            skipped=~applied if isinstance(applied, torch.Tensor) else not applied,
            grad_norm=report.grad_norm,
            lr=lr,
            aux=aux,
        )


def make_train_step(loss_fn: LossFn) -> Step:
    """Build the basic step: forward, backward, optimizer step, zero_grad, scheduler step.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss_sum,
            num_targets)`` for a token-weighted loss, optionally followed by a dict of aux
            tensors: ``(loss, aux)`` / ``(loss_sum, num_targets, aux)``.

    Returns:
        A :class:`Step`; call it as ``state, out = step(state, batch)``.

    Raises:
        ConfigError: ``loss_fn`` is not callable or cannot be called as ``loss_fn(model, batch)``.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> def loss_fn(model, batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> step = make_train_step(loss_fn)
        >>> state, out = step(state, (torch.ones(4, 2), torch.zeros(4, 1)))
        >>> state.step, bool(out.did_update)
        (1, True)
    """
    model_batch_fn("make_train_step", "loss_fn", loss_fn, "return F.cross_entropy(model(x), y)")
    return Step(loss_fn=loss_fn)


def add_wrapper(step: Any, name: str, settings: Mapping[str, Any], **changes: Any) -> Step:
    """The one way a built-in wrapper derives a new step: check the input is a ``Step`` not
    already wrapped by ``name``, record ``name`` and its settings, apply ``changes``."""
    if not isinstance(step, Step):
        raise ConfigError(
            f"{name}() expects a Step, got {describe(step)}. Build one first: "
            f"step = make_train_step(loss_fn); step = {name}(step, ...)."
        )
    for done, done_settings in step.applied:
        if done == "compile_step":
            raise ConfigError(
                f"{name} was applied after compile_step, whose graphs already captured the "
                f"step's settings, so {name} would be silently ignored. Apply compile_step "
                f"last: compile_step({name}(step, ...))."
            )
        if done == name:
            raise ConfigError(
                f"{name} was applied twice (first with {dict(done_settings)}, now with "
                f"{dict(settings)}); a second {name} cannot be combined with the first. Apply "
                f"it once with the settings you want."
            )
    return dataclasses.replace(step, applied=(*step.applied, (name, dict(settings))), **changes)


def _too_many_skips(consecutive: int, limit: int, step: int) -> None:
    raise TooManySkipsError(
        f"skip_nonfinite: {consecutive} consecutive updates had a non-finite loss or "
        f"gradient (max_consecutive={limit}), at step {step}. Training has diverged: lower the "
        "learning rate, add clip(step, max_norm=1.0), check the data for NaN/inf, or raise "
        "max_consecutive."
    )


def _scaler_active(step: Step, state: TrainState) -> bool:
    scaler = state.scaler
    if scaler is None:
        if step.amp is not None and step.amp.dtype == torch.float16:
            raise ConfigError(
                "amp_wrap(dtype=torch.float16) needs a GradScaler in the state: float16 "
                "gradients underflow without loss scaling. Create the state with "
                f"TrainState.create(..., scaler=torch.amp.GradScaler({state.device.type!r})), "
                "or use dtype=torch.bfloat16, which needs no scaler."
            )
        return False
    return scaler.is_enabled()


def _scaled(step: Step, state: TrainState, loss: torch.Tensor) -> torch.Tensor:
    return state.scaler.scale(loss) if _scaler_active(step, state) else loss  # type: ignore[union-attr]


def _lr_now(state: TrainState) -> torch.Tensor | float:
    lr = state.optimizer.param_groups[0]["lr"]
    # A tensor LR is updated in place by its scheduler: an output keeps this call's value.
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _clip_norm(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    divisor: Any,
) -> torch.Tensor:
    """``clip_grad_norm_`` of ``grads / divisor``, returning its norm.

    With a host-number divisor (the usual case: counts from a plain loss) the division rides on
    the clip's multiply: one pass over the gradients instead of two. It is torch's formula
    (coef = max_norm / (norm + 1e-6), clamped to 1); for a power-of-two divisor the result is
    bit-identical to dividing first, otherwise within a rounding.
    """
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is None or isinstance(divisor, torch.Tensor) or divisor in (0, 1):
        _normalise(grads, divisor)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    norm: torch.Tensor = get_total_norm(grads, norm_type) / divisor
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, (coef / divisor).to(grads[0].device))
    return norm


def _normalise(grads: list[torch.Tensor], targets: torch.Tensor | float) -> None:
    """Divide the window's summed gradients by its target count, on the device."""
    # A window with zero targets has zero gradients: divide by 1 rather than by 0. Dividing by
    # 1 (one scalar-loss micro-batch) changes nothing, so it is skipped.
    if isinstance(targets, int | float):
        if targets not in (0, 1):
            torch._foreach_div_(grads, targets)
        return
    divisor = torch.where(targets > 0, targets, torch.ones_like(targets))
    if grads:
        torch._foreach_div_(grads, divisor)


def _total_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:  # torch >= 2.6; also reduces sharded (DTensor) gradients
        return cast(torch.Tensor, get_total_norm(grads, 2.0))
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)

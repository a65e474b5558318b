"""The ``Step`` record, ``make_train_step``, ``add_part`` and the phase order, written once.

A step is a frozen record: the user's ``loss_fn`` and the parts the wrappers added
(:class:`~steplib.step.parts.Part`). Its three phases run every part's contributions in the order
DESIGN.md §5.4 fixes, whatever order the wrappers were applied in:

1. ``forward_backward``: micro-batch contexts -> forward contexts -> ``loss_fn`` -> backward of the
   (scaled) loss *sum*.
2. ``process_grads``: the window's sums over the processes, then the gradient transforms by rank
   (unscale -> normalise by the window's count -> yours -> clip -> finiteness).
3. ``apply``: the optimizer update (unless skipped) inside the parts' update functions -> scaler
   update -> zero_grad -> scheduler.

This module names no wrapper: a wrapper is a part, and a new wrapper changes no file here.

Why the gradient of the *sum* is accumulated and divided once per window: the target count of
a window is only known when it closes (and across ranks only after a reduction), so dividing
per micro-batch by ``k`` is wrong when micro-batches hold different numbers of targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib.data import on_model_device
from steplib.errors import ConfigError, TooManySkipsError, describe, model_batch_fn
from steplib.state import StepOutput, TrainState
from steplib.step import device_skips
from steplib.step.loss_output import LossOutput, parse_loss_output
from steplib.step.parts import Gradients, GradReport, Part, Update, plain
from steplib.step.plan import Plan, check_composition, scaler_active

LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """A training step: ``step(state, batch) -> (state, StepOutput)``. Build with
    :func:`make_train_step`, then wrap (``accumulate``, ``clip``, ``amp_wrap``, ...).

    Attributes:
        loss_fn: the user's ``loss_fn(model, batch)``.
        parts: what the wrappers added, in the order they were applied.
        plan: what the parts add up to (:class:`Plan`), computed when the step is built.
    """

    loss_fn: LossFn
    parts: tuple[Part, ...] = ()
    plan: Plan = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", Plan.of(self.parts, default_runner=EAGER))

    def __call__(
        self, state: TrainState, batch: Any, *, close_window: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Run one micro-batch; update the parameters when it closes the accumulation window.

        Args:
            state: the current state (never mutated; see ``TrainState`` for what changes in
                place).
            batch: whatever ``loss_fn`` consumes.
            close_window: close the window after this micro-batch even if it holds fewer than
                the window's micro-batches (the last batch of an epoch); the update is then
                normalised by what the window held.

        Returns:
            ``(next_state, output)``.
        """
        size = state.window_size + 1
        closes = close_window or size >= self.plan.window
        out = self.plan.runner.forward_backward(self, state, batch, sync=closes)
        loss_sum = out.loss_sum.detach()
        state = state.replace(
            micro_step=state.micro_step + 1,
            window_size=size,
            # The first micro-batch of a window starts the sum: no add, no zero tensor.
            window_loss=loss_sum.float() if size == 1 else state.window_loss + loss_sum,
            # int + int stays on the host; a tensor count makes it a device tensor.
            window_targets=state.window_targets + out.num_targets,
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
        """Close an open, shorter window (the data ended before the window was full).

        Prefer ``step(state, batch, close_window=True)`` on the last batch when you know it is
        the last: with DDP that batch's backward then all-reduces directly.

        Returns:
            ``(state, None)`` when no window is open, else the state and output of the update,
            normalised by the targets the window actually held.
        """
        if state.window_size == 0:
            return state, None
        self.plan.sync.sync_unsynced(state)  # its last backward ran without gradient sync
        return self._close(state, {})

    @property
    def applied(self) -> tuple[tuple[str, Mapping[str, Any]], ...]:
        """``((name, settings), ...)`` of the parts, in the order they were applied."""
        return tuple((p.name, p.settings) for p in self.parts)

    def describe(self) -> list[dict[str, Any]]:
        """The composition as plain data: ``[{"wrapper": name, **settings}, ...]`` in order."""
        return [{"wrapper": name, **settings} for name, settings in self.applied]

    def _close(
        self, state: TrainState, aux: Mapping[str, torch.Tensor]
    ) -> tuple[TrainState, StepOutput]:
        runner = self.plan.runner
        # An async checkpoint may still be copying the parameters and optimizer state in the
        # background; this update changes them. (A runner may run the update in phase 2.)
        state.fence.wait()
        report = runner.process_grads(self, state)
        state, applied, lr = apply(self, state, report)
        grad_norm = report.grad_norm
        return state, StepOutput(
            loss_sum=report.loss_sum,
            num_targets=report.num_targets,
            did_update=applied,
            skipped=~applied if isinstance(applied, torch.Tensor) else not applied,
            grad_norm=None if grad_norm is None else plain(grad_norm),
            lr=lr,
            aux=aux,
        )


def forward_backward(step: Step, state: TrainState, batch: Any, *, sync: bool) -> LossOutput:
    """Phase 1: forward under the forward contexts, backward of the (scaled) loss sum, both
    inside the micro-batch contexts (``sync`` False: DDP's ``no_sync``, which must hold for the
    forward pass too)."""
    if not step.plan.micro_contexts:  # the common case: no `with` to enter per micro-batch
        return _forward_backward(step, state, batch)
    with contextlib.ExitStack() as stack:
        for enter in step.plan.micro_contexts:
            stack.enter_context(enter(state, sync))
        return _forward_backward(step, state, batch)


def _forward_backward(step: Step, state: TrainState, batch: Any) -> LossOutput:
    plan = step.plan
    if plan.forward_contexts:
        with contextlib.ExitStack() as inner:
            for enter_forward in plan.forward_contexts:
                inner.enter_context(enter_forward(state))
            out = parse_loss_output(step.loss_fn(state.model, batch))
    else:
        out = parse_loss_output(step.loss_fn(state.model, batch))
    loss = out.loss_sum
    scaler = state.scaler  # inline, not scaler_active(): this runs every micro-batch
    if scaler is not None and scaler.is_enabled():
        loss = scaler.scale(loss)
    if plan.hooks:
        _call(plan, "before_backward", state)
    loss.backward()
    if plan.hooks:
        _call(plan, "after_backward", state)
    return out


def process_grads(
    step: Step, state: TrainState, *, window: tuple[torch.Tensor, Any] | None = None
) -> GradReport:
    """Phase 2: the window's sums over the processes, then every gradient transform in rank
    order, all on the device. ``window``: the window's ``(loss_sum, targets)`` where ``state``
    does not hold them yet (a compiled step's closing micro-batch runs phase 2 in its graph)."""
    plan = step.plan
    loss, count = (state.window_loss, state.window_targets) if window is None else window
    loss_sum, targets, averaged = plan.sync.reduce_window(state, loss, count)  # type: ignore[arg-type]
    # DDP already averaged the gradients over `averaged` processes: divide by the rest.
    divisor = targets if averaged == 1 else targets / averaged
    grads = Gradients(
        state, loss_sum=loss_sum, num_targets=targets, divisor=divisor, sync=plan.sync
    )
    for transform in plan.transforms:
        transform(grads)
    grads.settle()  # a division no transform folded in
    return GradReport(loss_sum, targets, grads.grad_norm, grads.nonfinite)


def apply(step: Step, state: TrainState, report: GradReport) -> tuple[TrainState, Any, Any]:
    """Phase 3: the optimizer update unless skipped, scaler update, zero_grad, scheduler.

    A skip decision stays on the device when the optimizer can skip inside its kernel (a
    fused optimizer) and the scheduler is ``None`` or a ``LambdaLR`` (see
    ``steplib.step.device_skips``); otherwise it is read on the host, once per update.

    Returns:
        The state with the window reset and the counters advanced; whether the update was
        applied: a bool, or a bool device tensor when the decision stayed there; and the
        learning rate it used (read after the ``before_update`` hooks, which may set it).

    Raises:
        TooManySkipsError: more skipped updates in a row than a part's
            ``max_consecutive_skips``.
    """
    plan, nonfinite = step.plan, report.nonfinite
    optimizer = state.optimizer
    on_device = nonfinite is not None and device_skips.decides_on_device(optimizer, state.scheduler)
    applied: bool | torch.Tensor = True
    if nonfinite is not None:
        # The host read, when the decision cannot stay on the device: a host-side
        # scheduler must know whether to advance. Once per update, never mid-window.
        applied = ~nonfinite if on_device else not bool(nonfinite)
    if applied is not False and plan.hooks:
        _call(plan, "before_update", state)  # the final, unscaled, normalised, clipped grads
    lr = _lr_now(state)
    if applied is not False:
        if plan.updates or on_device:
            update = _update_call(step, state, nonfinite if on_device else None)
            for outer in reversed(plan.updates):
                update = _around(outer, state, update)
            update()
        else:  # the common case: no closure to build
            plan.runner.optimizer_step(step, optimizer)
        if plan.hooks:
            _call(plan, "after_update", state)
    if scaler_active(state):
        state.scaler.update()  # type: ignore[union-attr]
    optimizer.zero_grad(set_to_none=True)
    if plan.hooks:
        _call(plan, "after_zero_grad", state)
    limit = plan.max_consecutive_skips
    changes: dict[str, Any] = {"step": state.step + 1, "window_size": 0}
    changes.update(window_loss=0.0, window_targets=0)
    if isinstance(applied, torch.Tensor):
        record, counters, seen = device_skips.count(state, applied, limit)
        if seen is not None:
            _too_many_skips(seen, limit, state.step)  # type: ignore[arg-type]
        return state.replace(**changes, **counters, device_skips=record), applied, lr
    if applied and state.scheduler is not None:
        state.scheduler.step()
    consecutive = 0 if applied else state.consecutive_skips + 1
    if limit is not None and consecutive > limit:  # host-decided: an int
        _too_many_skips(int(consecutive), limit, state.step)
    changes["skipped_updates"] = state.skipped_updates + (0 if applied else 1)
    changes["consecutive_skips"] = consecutive
    return state.replace(**changes), applied, lr


def _update_call(
    step: Step, state: TrainState, found_inf: torch.Tensor | None
) -> Callable[[], None]:
    runner, optimizer = step.plan.runner, state.optimizer
    if found_inf is None:
        return lambda: runner.optimizer_step(step, optimizer)

    def skip_in_kernel() -> None:
        # What GradScaler.step does for fused optimizers: the kernel skips the update (step
        # counters included) when found_inf is 1.
        optimizer.found_inf = found_inf.float()  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        try:
            runner.optimizer_step(step, optimizer)
        finally:
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]

    return skip_in_kernel


def _around(outer: Update, state: TrainState, inner: Callable[[], None]) -> Callable[[], None]:
    return lambda: outer(state, inner)


def _call(plan: Plan, point: str, state: TrainState) -> None:
    for hook in plan.hooks.get(point, ()):
        hook(state)


def _optimizer_step(step: Step, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _accept_every_part(part: Part) -> str | None:
    return None


class Runner:
    """How a step's phases run. This one runs the core's phases eagerly (its methods are the
    module's functions themselves: no extra call per micro-batch); ``compile_step`` and the
    pipeline step contribute subclasses (``Part(runner=...)``) that run the same record
    differently and override some of the methods:

    * ``forward_backward(step, state, batch, *, sync) -> LossOutput``: phase 1;
    * ``process_grads(step, state) -> GradReport``: phase 2;
    * ``optimizer_step(step, optimizer)``: the update inside phase 3;
    * ``refuse(part) -> str | None``: why this runner cannot run ``part``, else ``None``.
    """

    forward_backward = staticmethod(forward_backward)
    process_grads = staticmethod(process_grads)
    optimizer_step = staticmethod(_optimizer_step)
    refuse = staticmethod(_accept_every_part)


EAGER = Runner()


def make_train_step(loss_fn: LossFn, *, to_device: bool = False) -> Step:
    """Build the basic step: forward, backward, optimizer step, zero_grad, scheduler step.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss_sum,
            num_targets)`` for a token-weighted loss, optionally followed by a dict of aux
            tensors: ``(loss, aux)`` / ``(loss_sum, num_targets, aux)``.
        to_device: move every tensor of each batch to the model's device first
            (``steplib.data.to_device``), so the loader can stay on the CPU.

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
    return Step(loss_fn=on_model_device(loss_fn) if to_device else loss_fn)


def add_part(step: Any, part: Part) -> Step:
    """The one way a wrapper derives a new step: ``step`` with ``part`` added, after the one
    declared rule on composition: each name once; at most one part shares gradients across
    processes and one replaces the runner; nothing after a part marked ``last``; and the runner
    accepts every part.

    Args:
        step: the step to wrap.
        part: what the wrapper contributes.

    Returns:
        A new :class:`Step` (``step`` is not changed).

    Raises:
        ConfigError: ``step`` is not a Step, or the composition breaks the rule (the message
            says which part, why, and the fix).

    Example:
        >>> from steplib.step import Part
        >>> step = add_part(make_train_step(lambda m, b: m(b).sum()), Part(name="mine"))
        >>> step.describe()
        [{'wrapper': 'mine'}]
    """
    if not isinstance(part, Part):
        raise ConfigError(
            f"add_part(step, part) received part={describe(part)}; build one with "
            "steplib.step.Part(name=..., ...)."
        )
    name = part.name
    if not isinstance(step, Step):
        raise ConfigError(
            f"{name}() expects a Step, got {describe(step)}. Build one first: "
            f"step = make_train_step(loss_fn); step = {name}(step, ...)."
        )
    parts = (*step.parts, part)
    check_composition(parts)
    return dataclasses.replace(step, parts=parts)


def _too_many_skips(consecutive: int, limit: int, step: int) -> None:
    raise TooManySkipsError(
        f"skip_nonfinite: {consecutive} consecutive updates had a non-finite loss or "
        f"gradient (max_consecutive={limit}), at step {step}. Training has diverged: lower the "
        "learning rate, add clip(step, max_norm=1.0), check the data for NaN/inf, or raise "
        "max_consecutive."
    )


def _lr_now(state: TrainState) -> torch.Tensor | float:
    lr = state.optimizer.param_groups[0]["lr"]
    # A tensor LR is updated in place by its scheduler: an output keeps this call's value.
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

"""The three phases of a step, in the order DESIGN.md §5.4 fixes, written once; ``Step`` runs
them through its runner (:class:`~steplib.step.core.Runner`).

1. ``forward_backward``: micro-batch contexts -> forward contexts -> ``loss_fn`` -> backward of the
   (scaled) loss *sum*.
2. ``process_grads``: the window's sums over the processes, then the gradient transforms by rank
   (unscale -> normalise by the window's count -> yours -> clip -> finiteness).
3. ``apply``: the optimizer update (unless skipped) inside the parts' update functions -> scaler
   update -> zero_grad -> scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from steplib.errors import ConfigError, TooManySkipsError
from steplib.lineage import backward_failed
from steplib.schedule_ends import check_updates_left, warn_if_rate_rises
from steplib.state import EMPTY_WINDOW, TrainState
from steplib.state_checks import check_scheduler_at, scheduler_position, trained
from steplib.step import device_skips
from steplib.step.loss_output import LossOutput, parse_loss_output
from steplib.step.parts import LOCAL, Gradients, GradReport, Update
from steplib.step.plan import Plan, scaler_active

if TYPE_CHECKING:
    from steplib.step.core import Step

_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def forward_backward(step: Step, state: TrainState, batch: Any, *, sync: bool) -> LossOutput:
    """Phase 1: forward under the forward contexts, backward of the (scaled) loss sum, both
    inside the micro-batch contexts (``sync`` False: DDP's ``no_sync``, which must hold for the
    forward pass too)."""
    if getattr(state.model, "needs_sweep_step", False):  # a steplib.sweep.Copies
        raise ConfigError(
            "a step of make_train_step (not sweep_step) trains one model, and the state's "
            f"model holds {state.model.n} copies: loss_fn would see every copy's outputs at "
            "once and train them all on one loss averaged over the copies (each copy's "
            "gradient 1/n of its own run's). Run it for each copy: step = sweep_step(step, "
            "copies=copies, example_batch=batch) (steplib.sweep)."
        )
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
    lane = state.lane
    try:
        # Several optimizers: only this one's parameters take gradients, so the generator's
        # backward through the discriminator leaves the discriminator's open window alone.
        if lane.name is None:
            loss.backward()
        else:  # the optimizer's parameters now: one may have been (un)frozen or added since
            params = trained(state.optimizer)
            loss.backward(inputs=params)
    except BaseException:  # out of memory, a KeyboardInterrupt: .grad may hold part of it
        backward_failed(state)
        raise
    # backward(inputs=...) leaves a parameter the loss does not reach without a gradient,
    # silently: a step named with another model's optimizer would "update" nothing.
    if lane.name is not None and not any(p.grad is not None for p in params):
        _reached_none(lane.name)
    if plan.hooks:
        _call(plan, "after_backward", state)
    return out


def _reached_none(name: str) -> None:
    raise ConfigError(
        f"the loss of the step for optimizer {name!r} reached none of its trainable parameters: "
        "its backward computed no gradient for them, so its update would change nothing "
        "while another model's loss went unused (the steps' optimizer names swapped, or the "
        "trained model's output detached in the loss). Name the optimizer of the model this "
        "loss trains: make_train_step(d_loss, optimizer='D'), make_train_step(g_loss, "
        "optimizer='G')."
    )


def process_grads(
    step: Step, state: TrainState, *, window: tuple[torch.Tensor, Any] | None = None
) -> GradReport:
    """Phase 2: the window's sums over the processes, then every gradient transform in rank
    order, all on the device. ``window``: the window's ``(loss_sum, targets)`` where ``state``
    does not hold them yet (a compiled step's closing micro-batch runs phase 2 in its graph)."""
    plan = step.plan
    loss, count = (state.window.loss, state.window.targets) if window is None else window
    if plan.sync is LOCAL and isinstance(count, torch.Tensor):
        check_counts_shared(state)
    loss_sum, targets, averaged = plan.sync.reduce_window(state, loss, count)  # type: ignore[arg-type]
    # DDP already averaged the gradients over `averaged` processes: divide by the rest.
    divisor = targets if averaged == 1 else targets / averaged
    grads = Gradients(
        state, loss_sum=loss_sum, num_targets=targets, divisor=divisor, sync=plan.sync
    )
    for transform in plan.transforms:
        transform(grads)
    grads.settle()  # a division no transform folded in
    flag = grads.nonfinite
    if isinstance(targets, torch.Tensor) and (
        flag is not None or device_skips.decides_on_device(state.optimizer, state.scheduler)
    ):
        # A window that holds no targets (all padding) makes no update: decided with the
        # count over every process (every rank skips alike), on the device where the optimizer
        # skips in its kernel, else with the host read a skip flag costs anyway. (An int count
        # is decided on the host in `apply`; for any other step, `apply` checks it after.)
        empty = targets <= 0
        flag = empty if flag is None else flag | empty
    return GradReport(loss_sum, targets, grads.grad_norm, flag)


def check_counts_shared(state: TrainState) -> None:
    """Refuse a token-weighted window on a DDP or FSDP2 model of several ranks that no
    ``ddp_wrap``/``fsdp_wrap`` shares: the model averages the gradients over the ranks, and
    each rank would divide its own by its own window's count (a wrong update, in silence,
    wherever the ranks' counts differ)."""
    if torch.compiler.is_compiling() or not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        return  # a compiled step was checked eagerly: its first call runs eagerly
    from steplib.distributed.parallelize import is_parallel_model

    model = state.model
    models = [model, *(model.values() if isinstance(model, torch.nn.ModuleDict) else ())]
    parallel = [m for m in models if is_parallel_model(m)]
    if not parallel or torch.distributed.get_world_size() < 2:
        return
    kind = type(parallel[0]).__name__
    raise ConfigError(
        f"the step trains a {kind} model on {torch.distributed.get_world_size()} ranks without "
        "ddp_wrap or fsdp_wrap, and its loss returns a target count: the model averages the "
        "gradients over the ranks, but each rank would divide them by its own window's count "
        "(a wrong update wherever the ranks' counts differ). Wrap the step: "
        "fsdp_wrap(step) for an FSDP2 model (reduce_every_micro_batch=True to reduce-scatter "
        "after every micro-batch), ddp_wrap(step) for a DDP one."
    )


def apply(step: Step, state: TrainState, report: GradReport) -> tuple[TrainState, Any, Any]:
    """Phase 3: the optimizer update unless skipped, scaler update, zero_grad, scheduler.

    An update is skipped when the report says so (non-finite values, or a window whose target
    count tensor is 0) or when the window's count is the int 0. A decision the report holds as a
    tensor stays on the device when the optimizer can skip inside its kernel (a fused optimizer)
    and the scheduler is ``None`` or a ``LambdaLR`` (see ``steplib.step.device_skips``);
    otherwise it is read on the host, once per update.

    Returns:
        The state with the window emptied and the counters advanced; whether the update was
        applied: a bool, or a bool device tensor when the decision stayed there; and the
        learning rate it used (read after the ``before_update`` hooks, which may set it).

    Raises:
        TooManySkipsError: more skipped updates in a row than a part's
            ``max_consecutive_skips``.
    """
    plan, flag, targets = step.plan, report.nonfinite, report.num_targets
    optimizer, scheduler = state.optimizer, state.scheduler
    applied: bool | torch.Tensor = True
    on_device = False
    if not isinstance(targets, torch.Tensor) and targets <= 0:
        applied = False  # an empty window, known on the host: nothing to read
    elif flag is not None:
        on_device = device_skips.decides_on_device(optimizer, scheduler)
        # The host read, when the decision cannot stay on the device: a host-side
        # scheduler must know whether to advance. Once per update, never mid-window.
        applied = ~flag if on_device else not bool(flag)
    # The update hooks run at every closed window, applied or skipped (`out.did_update` says
    # which): a decision kept on the device cannot choose whether to call them.
    if plan.hooks:
        _call(plan, "before_update", state)  # the final, unscaled, normalised, clipped grads
    lr = lr_now(state)
    if applied is not False:
        if report.updated:  # the runner made it with phase 2
            pass
        elif plan.updates or on_device:
            update = _update_call(step, state, flag if on_device else None)
            for outer in reversed(plan.updates):
                update = _around(outer, state, update)
            update()
        else:  # the common case: no closure to build
            plan.runner.optimizer_step(step, optimizer)
    if plan.hooks:
        _call(plan, "after_update", state)
    if scaler_active(state):
        state.scaler.update()  # type: ignore[union-attr]
    if type(optimizer).zero_grad is _ZERO_GRAD:
        # What Optimizer.zero_grad(set_to_none=True) does, without its profiler range (a
        # visible share of a small model's update, docs/performance.md). An optimizer with its
        # own zero_grad gets it called.
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    else:
        optimizer.zero_grad(set_to_none=True)
    if plan.hooks:
        _call(plan, "after_zero_grad", state)
    if applied is True:
        if isinstance(targets, torch.Tensor) and flag is None:  # see process_grads
            plan.skips.check_not_empty(optimizer, targets, state.step)
        if scheduler is not None:
            scheduler.step()
        skipped, consecutive = state.skipped_updates, plan.skips.zero(optimizer, state.device)
    else:
        missed: torch.Tensor | int = 1  # skipped, decided on the host
        if isinstance(applied, torch.Tensor):  # the scheduler's position moves by it, there
            plan.skips.advance(optimizer, scheduler, applied)
            missed = (~applied).to(torch.int64)
        skipped = state.skipped_updates + missed
        consecutive = (state.consecutive_skips + missed) * missed
        limit = plan.max_consecutive_skips
        if limit is not None:
            seen = plan.skips.too_many(state, consecutive, limit, on_host=not on_device)
            if seen is not None:
                _too_many_skips(*seen, limit)
    return (
        state.replace(
            step=state.step + 1,
            window=EMPTY_WINDOW,
            skipped_updates=skipped,
            consecutive_skips=consecutive,
            scheduler_at=scheduler_position(scheduler),  # for the next update's check
        ),
        applied,
        lr,
    )


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


def _too_many_skips(consecutive: int, step: int, limit: int) -> None:
    raise TooManySkipsError(
        f"skip_nonfinite: {consecutive} consecutive updates were skipped (max_consecutive="
        f"{limit}), at step {step}: a non-finite loss or gradient (with a float16 GradScaler, "
        "scaled gradients that overflowed) or a window with no targets. Training has diverged: "
        "lower the learning rate, add clip(step, max_norm=1.0), check the data for NaN/inf "
        "and empty batches, or raise max_consecutive (a resume may raise it). At the start of "
        "a float16 run with a token-weighted loss, start the GradScaler per target: "
        "GradScaler(device, init_scale=2.0**16 / targets_per_micro_batch)."
    )


def check_scheduler(plan: Plan, state: TrainState) -> None:
    """Refuse the state's scheduler when something other than the step moved it since the
    state's last update (a ``scheduler.step()`` in the user's loop): called before the
    micro-batch that closes a window, since a runner may update inside it.

    Raises:
        ConfigError: see ``steplib.state_checks.check_scheduler_at``; a scheduler at the end
            of its cycle (``check_updates_left``).
    """
    scheduler = state.scheduler
    if scheduler is not None:
        # A position the step keeps on the device reaches the object late: compare with what
        # the step last set there.
        written = plan.skips.written(scheduler)
        check_scheduler_at(state, state.scheduler_at if written is None else written)
        # Before the update, not after: torch refuses a OneCycleLR's step past its end only
        # once the optimizer has changed the parameters.
        check_updates_left(state, 1, needs="this update")
        stepped = (
            "the state's scheduler, stepped at every update: T_max counts updates (max_steps, "
            "or epochs x updates an epoch; to count epochs, step it with the Scheduler handler)"
        )
        warn_if_rate_rises(scheduler, stepped=stepped)


def lr_now(state: TrainState) -> torch.Tensor | float:
    """The first group's learning rate as this call sees it: a float, or a copy of a tensor LR
    (which its scheduler changes in place, so an output must not hold the tensor itself)."""
    lr = state.optimizer.param_groups[0]["lr"]
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

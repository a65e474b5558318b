"""The ``Step`` record, ``make_train_step``, ``add_part`` and the ``Runner`` of its phases.

A step is a frozen record: the user's ``loss_fn`` and the parts the wrappers added
(:class:`~steplib.step.parts.Part`). Its three phases (``steplib.step.phases``) run every part's
contributions in the order DESIGN.md §5.4 fixes, whatever order the wrappers were applied in.

This module names no wrapper: a wrapper is a part, and a new wrapper changes no file here.

Why the gradient of the *sum* is accumulated and divided once per window: the target count of
a window is only known when it closes (and across ranks only after a reduction), so dividing
per micro-batch by ``k`` is wrong when micro-batches hold different numbers of targets.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from steplib.data import on_model_device
from steplib.errors import ConfigError, describe, model_batch_fn
from steplib.lineage import check_newest, note_window_grads, update_failed
from steplib.output import StepOutput, at_least_float32
from steplib.state import TrainState, Window
from steplib.state_checks import idle_error, idle_parameters
from steplib.step.parts import GradReport, Part, plain
from steplib.step.phases import apply, check_scheduler, forward_backward, lr_now, process_grads
from steplib.step.plan import Plan, check_composition

LossFn = Callable[[Any, Any], Any]  # (model, batch): Any, so a loss may take an nn.ModuleDict
LossFnWithStep = Callable[[Any, Any, torch.Tensor], Any]  # (model, batch, step)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """A training step: ``step(state, batch) -> (state, StepOutput)``. Build with
    :func:`make_train_step`, then wrap (``accumulate``, ``clip``, ``amp_wrap``, ...).

    Attributes:
        loss_fn: the user's ``loss_fn(model, batch)``.
        parts: what the wrappers added, in the order they were applied.
        optimizer: the name of the optimizer this step updates, in a state with several
            (``TrainState.create(optimizer={...})``), else ``None``.
        takes_step: whether the user's loss takes the step number (``loss_fn(model, batch,
            step)``); ``loss_fn`` then takes ``(model, (batch, step))``.
        plan: what the parts add up to (:class:`Plan`), computed when the step is built.
    """

    loss_fn: LossFn
    parts: tuple[Part, ...] = ()
    optimizer: str | None = None
    takes_step: bool = False
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

        Raises:
            ConfigError: ``state`` is not the newest state of its run (a newer one was made
                from it or beside it: :mod:`steplib.lineage`); the state has several optimizers
                and the step names none of them, or
                the step names one and the state has no optimizer of that name; an update with
                a trainable parameter in no optimizer (unfrozen since ``TrainState.create``).
        """
        if state.lane.name is not None or self.optimizer is not None:
            mine, out = self._micro_batch(_lane_of(self, state), batch, close_window)
            return state.with_lane(mine), out
        return self._micro_batch(state, batch, close_window)

    def _micro_batch(
        self, state: TrainState, batch: Any, close_window: bool
    ) -> tuple[TrainState, StepOutput]:
        check_newest(state, "step")  # before anything changes in place
        if self.takes_step:
            batch = _with_step_number(state, batch)
        window = state.window
        size = window.size + 1
        closes = close_window or size >= self.plan.window
        if closes:
            check_scheduler(self.plan, state)  # before the micro-batch a runner may update with
        out = self.plan.runner.forward_backward(self, state, batch, sync=closes)
        loss_sum, count = out.loss_sum, out.num_targets
        if loss_sum.requires_grad:  # eager: the state and output must not keep the graph alive
            loss_sum = loss_sum.detach()  # (a compiled graph's output has none: no detach)
        # A count computed from the model (a soft count, weights.sum()) carries its graph: in the
        # window it would keep every micro-batch's graph alive until the update, and after.
        if isinstance(count, torch.Tensor) and count.requires_grad:
            count = count.detach()
        window = Window(
            size,
            # The first micro-batch of a window starts the sum: no add, no zero tensor. At least
            # float32 (a bf16 sum would round), a float64 loss stays float64.
            at_least_float32(loss_sum) if size == 1 else window.loss + loss_sum,
            # int + int stays on the host; a tensor count makes it a device tensor.
            window.targets + count,
        )
        state = state.replace(micro_step=state.micro_step + 1, window=window)
        if closes:
            return self._close(state, out.aux, out.report)
        note_window_grads(state)
        return state, StepOutput(
            loss_sum=loss_sum,
            num_targets=count,
            did_update=False,
            skipped=False,
            grad_norm=None,
            lr=lr_now(state),
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
        if state.lane.name is not None or self.optimizer is not None:
            mine, out = self._flush(_lane_of(self, state))
            return state.with_lane(mine), out
        return self._flush(state)

    def _flush(self, state: TrainState) -> tuple[TrainState, StepOutput | None]:
        check_newest(state, "step.flush")
        if state.window.size == 0:
            return state, None
        check_scheduler(self.plan, state)
        self.plan.sync.sync_unsynced(state)  # its last backward ran without gradient sync
        return self._close(state, {}, None)

    @property
    def applied(self) -> tuple[tuple[str, Mapping[str, Any]], ...]:
        """``((name, settings), ...)`` of the parts, in the order they were applied."""
        return tuple((p.name, p.settings) for p in self.parts)

    def describe(self) -> list[dict[str, Any]]:
        """The composition as plain data: ``[{"wrapper": name, **settings}, ...]`` in order."""
        return [{"wrapper": name, **settings} for name, settings in self.applied]

    def settle(self, state: TrainState) -> None:
        """Set ``state``'s schedulers to the positions this step keeps on the device (a host
        wait, on CUDA): a checkpoint calls it before it saves them."""
        for lane in [state[name] for name in state.names] or [state]:
            if lane.scheduler is not None:
                self.plan.skips.settle(lane.scheduler)

    def _close(
        self, state: TrainState, aux: Mapping[str, torch.Tensor], report: GradReport | None
    ) -> tuple[TrainState, StepOutput]:
        try:
            return self._update(state, aux, report)
        except BaseException:
            update_failed(state)
            raise

    def _update(
        self, state: TrainState, aux: Mapping[str, torch.Tensor], report: GradReport | None
    ) -> tuple[TrainState, StepOutput]:
        runner = self.plan.runner
        # A parameter unfrozen since TrainState.create but in no optimizer: refused before its
        # piled-up gradients could be applied by a later add_param_group. (With several
        # optimizers each backward fills its own parameters alone: nothing piles up.)
        if state.lane.name is None and (idle := idle_parameters(state.model, [state.optimizer])):
            raise idle_error(f"update {state.step + 1}", "model", idle)
        # An async checkpoint may still be copying the parameters and optimizer state in the
        # background; this update changes them. (A runner may run the update in phase 2.)
        state.fence.wait()
        if report is None:  # phase 2, unless the runner ran it with the closing micro-batch
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


def _optimizer_step(step: Step, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _accept_every_part(part: Part) -> str | None:
    return None


class Runner:
    """How a step's phases run. This one runs the core's phases eagerly (its methods are the
    module's functions themselves: no extra call per micro-batch); ``compile_step`` and the
    pipeline step contribute subclasses (``Part(runner=...)``) that run the same record
    differently and override some of the methods:

    * ``forward_backward(step, state, batch, *, sync) -> LossOutput``: phase 1 (and phase 2
      with a closing micro-batch, whose report the output then carries);
    * ``process_grads(step, state) -> GradReport``: phase 2 (and the update with it, which the
      report then says);
    * ``optimizer_step(step, optimizer)``: the update inside phase 3;
    * ``refuse(part) -> str | None``: why this runner cannot run ``part``, else ``None``;
    * ``micro_batches``: the micro-batches one call computes the loss of (1; a pipeline's
      ``n_microbatches``), which a plain mean loss counts as its targets (``Throughput``
      names that rate ``batches_per_s``).
    """

    micro_batches = 1

    forward_backward = staticmethod(forward_backward)
    process_grads = staticmethod(process_grads)
    optimizer_step = staticmethod(_optimizer_step)
    refuse = staticmethod(_accept_every_part)


EAGER = Runner()


def make_train_step(
    loss_fn: LossFn | LossFnWithStep, *, optimizer: str | None = None, to_device: bool = False
) -> Step:
    """Build the basic step: forward, backward, optimizer step, zero_grad, scheduler step.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or ``(loss_sum,
            num_targets)`` for a token-weighted loss, optionally followed by a dict of aux
            tensors: ``(loss, aux)`` / ``(loss_sum, num_targets, aux)``. A loss with a third
            parameter, ``loss_fn(model, batch, step)``, also receives the number of updates
            so far (``state.step``) as a 0-dim int64 tensor on the model's device: for a
            curriculum or an annealed coefficient, with no host read and no recompile. A
            parameter named ``step`` with a default or keyword-only gets it by keyword. Each
            call gets its own copy (``step += 1`` in the loss changes nothing outside).
        optimizer: in a state with several named optimizers (a GAN's ``{"G": ..., "D":
            ...}``), the one this step updates: its window, scaler, scheduler and counters
            advance, and only its parameters receive gradients.
        to_device: move every tensor of each batch to the model's device first
            (``steplib.data.to_device``), so the loader can stay on the CPU.

    Returns:
        A :class:`Step`; call it as ``state, out = step(state, batch)``.

    Raises:
        ConfigError: ``loss_fn`` is not callable or cannot be called as ``loss_fn(model, batch)``;
            ``optimizer`` is not a non-empty string.

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
    step_argument = _step_argument(loss_fn)
    takes_step = step_argument is not None
    fn: LossFn = loss_fn  # type: ignore[assignment]  # the two-parameter case
    if step_argument == "positional":

        def fn(model: Any, batch_and_step: Any) -> Any:
            return loss_fn(model, *batch_and_step)

    elif step_argument == "keyword":

        def fn(model: Any, batch_and_step: Any) -> Any:
            batch, step = batch_and_step
            return loss_fn(model, batch, step=step)  # type: ignore[call-arg]

    model_batch_fn("make_train_step", "loss_fn", fn, "return F.cross_entropy(model(x), y)")
    if optimizer is not None and not (isinstance(optimizer, str) and optimizer):
        raise ConfigError(
            f"make_train_step(optimizer=...) received {describe(optimizer)}; pass the name of "
            "one of the state's optimizers, e.g. optimizer='D' for "
            "TrainState.create(optimizer={'G': opt_g, 'D': opt_d}), or leave it out."
        )
    return Step(
        loss_fn=on_model_device(fn) if to_device else fn,
        optimizer=optimizer,
        takes_step=takes_step,
    )


def _with_step_number(state: TrainState, batch: Any) -> Any:
    """``(batch, step)`` for a loss that takes the step number: a device tensor, so that a
    schedule in the loss needs no host read and a compiled step no recompile per update. A fill
    kernel, not a host-to-device copy (which would wait for the device); a new tensor for each
    call, so ``step += 1`` in the loss changes nothing outside it."""
    return batch, torch.full((), state.step, dtype=torch.int64, device=state.device)


def _step_argument(loss_fn: Any) -> str | None:
    """How ``loss_fn`` takes the step number: ``"positional"`` for ``loss_fn(model, batch,
    step)`` (a third positional parameter without a default, whatever its name), ``"keyword"``
    for a parameter named ``step`` with a default or keyword-only (``loss_fn(model, batch,
    step=None)`` must not silently keep its default), else ``None``."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return None

    def binds(*args: Any, **kwargs: Any) -> bool:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            return False
        return True

    arg = object()
    if binds(arg, arg, arg) and not binds(arg, arg):
        return "positional"  # three positional parameters, all needed
    # Not with a fourth parameter to fill: the check of the call shape refuses that one.
    if "step" in signature.parameters and binds(arg, arg, step=arg):
        return "keyword"
    return None


def _lane_of(step: Step, state: TrainState) -> TrainState:
    """The state of the optimizer ``step`` updates, out of ``state``."""
    name, names = step.optimizer, state.names
    if name is not None and name in names:
        return state[name]
    if not names:
        fix = f"build the step without optimizer={name!r}, or create the state with "
        fix += f"optimizer={{{name!r}: ...}}"
    elif name is None:
        fix = f"name the one this step updates: make_train_step(loss_fn, optimizer={names[0]!r})"
    else:
        fix = f"name one of them: make_train_step(loss_fn, optimizer={names[0]!r})"
    raise ConfigError(
        f"the step updates optimizer {name!r}; the state's optimizers are "
        f"{list(names) if names else 'one, unnamed'}: {fix}."
    )


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

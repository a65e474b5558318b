"""``sweep_step``: a built step (``make_train_step`` and its wrappers) run for N copies at once.

The step's own parts are reused, not re-implemented: its window (``accumulate``), its contexts
(``amp_wrap``'s autocast), its gradient transforms in their fixed order (``clip``,
``skip_nonfinite``, yours) and its hooks. The transforms receive :class:`CopyGradients`, whose
norm and scaling are per copy, so each copy is clipped and skipped as its own run would be.

What differs from the step it wraps, and why:

* the loss is ``vmap``-ed over the copies' stacked tensors (one batch, shared), and the sum of
  the N losses is back-propagated: the copies are independent, so each stacked gradient row is
  that copy's own gradient;
* ``StepOutput``'s ``loss``, ``grad_norm``, ``did_update``, ``skipped`` and ``lr`` are ``[N]``;
* an update skipped for one copy (non-finite, or the copy stopped) or for all (a window that
  held no targets) is a mask in the optimizer's update, decided on the device: there is no host
  read in a sweep's step;
* ``state.skipped_updates`` counts skipped copy-updates in total (a 0-dim tensor); each
  copy's updates are its optimizer ``step`` count, its skips in a row the optimizer's
  ``param_groups[0]["consecutive_skips"]``: a copy past ``max_consecutive`` is stopped
  (:mod:`steplib.sweep.stopped`), not the run;
* the scheduler advances once per sweep update for every copy: one schedule for all, so a copy
  whose update alone was skipped (non-finite) does not hold it back, though its own run would.
  An update that updated no copy (a window that held no targets, or every copy non-finite)
  does not move a ``LambdaLR`` over a sweep optimizer (its position moves on the device, as
  the step's does); another scheduler advances.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from steplib.errors import ConfigError, describe
from steplib.lineage import backward_failed, check_newest, update_failed
from steplib.output import StepOutput, at_least_float32
from steplib.state import EMPTY_WINDOW, TrainState, Window
from steplib.state_checks import scheduler_position
from steplib.step import Step
from steplib.step.core import EAGER
from steplib.step.device_skips import SkipMemory
from steplib.step.loss_output import parse_loss_output
from steplib.step.parts import LOCAL
from steplib.step.phases import check_scheduler
from steplib.sweep.copies import Copies, per_copy
from steplib.sweep.grads import CopyGradients
from steplib.sweep.per_copy_optimizer import PerCopyOptimizer
from steplib.sweep.rates import check_per_copy_schedule
from steplib.sweep.stopped import count_and_stop, stopped_buffers_kept
from steplib.sweep.trial import trial


@dataclasses.dataclass(frozen=True)
class SweepStep:
    """A step for N copies: ``step(state, batch) -> (state, StepOutput)`` with ``[N]`` outputs.
    Build it with :func:`sweep_step`; use it as any step (your loop, ``run``, handlers).

    Attributes:
        step: the step it runs per copy (the user's ``loss_fn`` and wrappers).
        copies: the :class:`Copies` it trains (the state's model).
    """

    step: Step
    copies: Copies
    losses: Any = dataclasses.field(repr=False, compare=False)
    counted: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def n(self) -> int:
        """The number of copies."""
        return self.copies.n

    def __call__(
        self, state: TrainState, batch: Any, *, close_window: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """One micro-batch for every copy; an update when it closes the window.

        Raises:
            ConfigError: ``state`` is not the newest state of its run (:mod:`steplib.lineage`);
                the state's model is not this sweep's copies, the state holds a
                float16 ``GradScaler``, an optimizer that mixes a tensor's elements
                (``torch.optim.Adafactor``) or, over per-copy rates, a scheduler that sets an
                absolute rate (:func:`~steplib.sweep.rates.check_per_copy_schedule`), or
                ``loss_fn`` counted different targets for different copies (read once
                landed: on CUDA a call or two later).
        """
        check_newest(state, "sweep step")  # before anything changes in place
        self._check(state)
        plan = self.step.plan
        size = state.window.size + 1
        closes = close_window or size >= plan.window
        with contextlib.ExitStack() as stack:
            for enter in plan.micro_contexts:
                stack.enter_context(enter(state, closes))
            stack.enter_context(stopped_buffers_kept(state.optimizer, self.copies))
            with contextlib.ExitStack() as inner:
                for enter_forward in plan.forward_contexts:
                    inner.enter_context(enter_forward(state))
                loss_sum, count, aux = self.losses(batch)
            _call(plan.hooks, "before_backward", state)
            try:
                loss_sum.sum().backward()  # independent copies: each row gets its own gradient
            except BaseException:  # .grad may hold part of it (steplib.lineage)
                backward_failed(state)
                raise
            _call(plan.hooks, "after_backward", state)
        loss_sum = at_least_float32(loss_sum.detach())
        if self.counted:
            _check_counts(count, plan.skips, state.optimizer, state.micro_step + 1)
        count = count[0]  # one shared batch: every copy counted the same targets
        state = state.replace(
            micro_step=state.micro_step + 1,
            window=Window(
                size,
                loss_sum if size == 1 else state.window.loss + loss_sum,
                state.window.targets + count,
            ),
        )
        if closes:
            return self._close(state, aux)
        return state, StepOutput(
            loss_sum=loss_sum,
            num_targets=count,
            did_update=torch.zeros(self.n, dtype=torch.bool, device=loss_sum.device),
            skipped=torch.zeros(self.n, dtype=torch.bool, device=loss_sum.device),
            grad_norm=None,
            lr=self._lr(state),
            aux=aux,
        )

    def flush(self, state: TrainState) -> tuple[TrainState, StepOutput | None]:
        """Close an open, shorter window (normalised by what it held); ``(state, None)`` when
        no window is open."""
        check_newest(state, "sweep step.flush")
        if state.window.size == 0:
            return state, None
        return self._close(state, {})

    @property
    def applied(self) -> tuple[tuple[str, Mapping[str, Any]], ...]:
        """``(("sweep", {"n": n}), *the wrapped step's)``."""
        return (("sweep", {"n": self.n}), *self.step.applied)

    def describe(self) -> list[dict[str, Any]]:
        """The composition as plain data, the sweep first."""
        return [{"wrapper": name, **settings} for name, settings in self.applied]

    def settle(self, state: TrainState) -> None:
        """As :meth:`Step.settle`: the scheduler's device position, set on it for a save."""
        self.step.settle(state)

    def _close(
        self, state: TrainState, aux: Mapping[str, torch.Tensor]
    ) -> tuple[TrainState, StepOutput]:
        try:
            return self._update(state, aux)
        except BaseException:
            update_failed(state)
            raise

    def _update(
        self, state: TrainState, aux: Mapping[str, torch.Tensor]
    ) -> tuple[TrainState, StepOutput]:
        plan, optimizer = self.step.plan, state.optimizer
        check_scheduler(plan, state)  # one stepped outside the step too is refused
        state.fence.wait()  # an async checkpoint may still be copying what this update changes
        loss_sum = torch.as_tensor(state.window.loss)  # a tensor: the window is not empty
        grads = CopyGradients(state, loss_sum=loss_sum, num_targets=state.window.targets, n=self.n)
        for transform in plan.transforms:
            transform(grads)
        grads.settle()
        targets = torch.as_tensor(grads.num_targets, device=state.device)
        lr = self._lr(state)
        _call(plan.hooks, "before_update", state)
        if isinstance(optimizer, PerCopyOptimizer):
            # Kept: finite, and from a window that held targets (all padding makes no update).
            kept = targets > 0 if grads.nonfinite is None else ~grads.nonfinite & (targets > 0)
            kept = kept.expand(self.n)
            update = lambda: optimizer.step(mask=kept)  # noqa: E731
            active = optimizer.param_groups[0]["active"]  # a stopped copy: neither (no update)
            applied, skipped = active & kept, active & ~kept
        elif grads.nonfinite is not None:  # torch's optimizers would update a NaN copy: refuse
            raise ConfigError(
                f"a transform of this sweep's step ({self.step.describe()}) skips the update of "
                f"some copies, and {type(optimizer).__name__} updates every copy or none. Use "
                "a sweep optimizer, which masks the update per copy: SweepAdamW or SweepSGD "
                "(steplib.sweep)."
            )
        else:
            update = optimizer.step
            applied = torch.ones(self.n, dtype=torch.bool, device=state.device)
            skipped = ~applied
        for outer in reversed(plan.updates):
            update = _around(outer, state, update)
        update()
        _call(plan.hooks, "after_update", state)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        _call(plan.hooks, "after_zero_grad", state)
        if isinstance(optimizer, PerCopyOptimizer):  # a copy that keeps skipping is stopped
            count_and_stop(optimizer, applied, skipped, plan=plan, update=state.step + 1)
        else:
            # It cannot skip a window that held no targets: checked once the count's host copy
            # lands, as the step does for such an optimizer (an error that names the fix).
            plan.skips.check_not_empty(optimizer, targets, state.step)
        scheduler = state.scheduler
        if isinstance(optimizer, PerCopyOptimizer) and type(scheduler) is LambdaLR:
            # An update that updated no copy (a window without targets, or every copy's update
            # non-finite) would move no copy's own run's schedule: the position moves on the
            # device, by whether any copy was updated, as the step's does by its update.
            plan.skips.advance(optimizer, scheduler, applied.any())
        elif scheduler is not None:
            scheduler.step()
        state = state.replace(
            step=state.step + 1,
            window=EMPTY_WINDOW,
            # One number each, as a checkpoint holds them: copy-updates skipped in total, and
            # updates in a row that skipped some copy. Per copy, the optimizer's step counts.
            skipped_updates=state.skipped_updates + skipped.sum(),
            consecutive_skips=torch.where(skipped.any(), state.consecutive_skips + 1, 0),
            scheduler_at=scheduler_position(scheduler),
        )
        return state, StepOutput(
            loss_sum=grads.loss_sum,
            num_targets=grads.num_targets,
            did_update=applied,
            skipped=skipped,
            grad_norm=grads.grad_norm,
            lr=lr,
            aux=aux,
        )

    def _lr(self, state: TrainState) -> torch.Tensor:
        group = state.optimizer.param_groups[0]
        if isinstance(state.optimizer, PerCopyOptimizer):
            return (group["lr"] * group["copies"]["lr"]).to(torch.float64)
        lr = torch.as_tensor(group["lr"], dtype=torch.float64)
        return lr.expand(self.n).clone()

    def _check(self, state: TrainState) -> None:
        if state.model is not self.copies:
            raise ConfigError(
                f"the sweep step was built for a Copies of {self.n}, and the state's model is "
                f"{describe(state.model)}. Create the state with the same copies: "
                "TrainState.create(model=copies, optimizer=SweepAdamW(copies.parameters(), ...))."
            )
        check_per_copy_schedule(state.scheduler, state.optimizer, "sweep step")
        if isinstance(state.optimizer, MIXING):
            raise ConfigError(
                f"a sweep cannot use torch.optim.{type(state.optimizer).__name__}: it mixes the "
                "elements of each tensor (Adafactor factors a tensor's second moment over its "
                "last two dimensions, copies included for a stacked bias, and scales each "
                "tensor's update by its whole RMS), so the copies would train on each other's "
                "gradients. Use an element-wise optimizer (SweepAdamW, SweepSGD, torch.optim."
                "AdamW, ...), or train the copies separately."
            )
        if state.scaler is not None and state.scaler.is_enabled():
            raise ConfigError(
                "a sweep cannot use a float16 GradScaler: its one loss scale would be shared "
                "by every copy, so one copy's overflow would skip them all. Train the sweep in "
                "bfloat16 (amp_wrap(step, dtype=torch.bfloat16), no scaler) or float32."
            )


# torch optimizers whose update of a tensor mixes its elements, so a stacked tensor's copies
# (Muon orthogonalises a matrix: it refuses a stacked one today, and would mix the copies).
# Looked up by name: torch 2.4 has neither, 2.5 added Adafactor.
MIXING = tuple(
    getattr(torch.optim, name) for name in ("Adafactor", "Muon") if hasattr(torch.optim, name)
)


def sweep_step(step: Step, *, copies: Copies, example_batch: Any) -> SweepStep:
    """Run ``step`` (the user's ``loss_fn`` and wrappers) for every copy of ``copies`` at once.

    The loss is called once per copy through ``torch.func.vmap`` on the one shared batch, so
    ``loss_fn`` must be a function of tensors: no host reads (``.item()``), no Python branches
    on tensor values, no in-place updates of tensors that are not registered buffers. A trial
    forward call on ``example_batch`` finds those now (it changes no tensor and no RNG).

    Args:
        step: ``make_train_step(loss_fn)``, wrapped as you like with ``accumulate``, ``clip``
            (per copy), ``skip_nonfinite`` (per copy), ``amp_wrap`` (bfloat16) or your own
            gradient transforms.
        copies: the :class:`Copies` the state trains.
        example_batch: one batch of the data (the first), for the trial call.

    Returns:
        A :class:`SweepStep`.

    Raises:
        ConfigError: ``step`` is not a Step; it is distributed (``ddp_wrap``, ``fsdp_wrap``),
            compiled (``compile_step``) or takes the step number; or ``loss_fn`` cannot run
            under ``vmap`` (which operation, where, and the fix).

    Example:
        >>> import torch
        >>> import steplib as sl
        >>> from steplib.sweep import Copies, SweepAdamW, sweep_step
        >>> copies = Copies.seeded(lambda: torch.nn.Linear(2, 1), seeds=range(4))
        >>> opt = SweepAdamW(copies.parameters(), lr=[1e-3, 3e-3, 1e-2, 3e-2])
        >>> state = sl.TrainState.create(model=copies, optimizer=opt)
        >>> batch = (torch.ones(8, 2), torch.zeros(8, 1))
        >>> loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> step = sweep_step(sl.make_train_step(loss_fn), copies=copies, example_batch=batch)
        >>> state, out = step(state, batch)
        >>> tuple(out.loss.shape), out.did_update.tolist()
        ((4,), [True, True, True, True])
    """
    if not isinstance(step, Step):
        raise ConfigError(
            f"sweep_step received {describe(step)}; pass a step: "
            "sweep_step(make_train_step(loss_fn), copies=copies, example_batch=batch)."
        )
    if not isinstance(copies, Copies):
        raise ConfigError(
            f"sweep_step(copies=...) received {describe(copies)}; pass the Copies the state "
            "trains: Copies.seeded(make_model, seeds=range(8)) or Copies.stack(models)."
        )
    plan = step.plan
    if plan.sync is not LOCAL or plan.runner is not EAGER or step.takes_step:
        what = "distributed" if plan.sync is not LOCAL else "compiled"
        what = "a loss that takes the step number" if step.takes_step else what
        raise ConfigError(
            f"sweep_step received a step that is {what} ({step.describe()}); a sweep runs "
            "one process, eagerly, with loss_fn(model, batch). Build the sweep from "
            "make_train_step(loss_fn) and accumulate / clip / skip_nonfinite / amp_wrap."
        )
    loss_fn = step.loss_fn
    # What loss_fn returns is checked once, outside vmap (under vmap a loss does not report
    # requires_grad), on a plain copy; inside, each form becomes (loss_sum, count, aux).
    device = next(copies.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # A count the loss returns as a tensor may differ per copy (checked per micro-batch).
        trial_output = parse_loss_output(loss_fn(copies.copy(0), example_batch))
    counted = isinstance(trial_output.num_targets, torch.Tensor)

    def parsed(model: Any, batch: Any) -> Any:
        loss, count, aux = _triple(loss_fn(model, batch))
        return loss, torch.as_tensor(count, device=loss.device), dict(aux)

    losses = per_copy(parsed, copies)
    trial(losses, copies, example_batch)
    return SweepStep(step=step, copies=copies, losses=losses, counted=counted)


def _check_counts(count: torch.Tensor, skips: SkipMemory, optimizer: Any, micro_step: int) -> None:
    """Refuse a count that differs between copies (one that depends on the model's outputs):
    copy 0's would normalise every copy's gradients. Read once it has landed, as
    ``check_not_empty`` reads a window's count: on the CPU at once, on CUDA a call or two
    later, never waited for."""
    differs = (count != count[0]).any()
    for landed, _ in skips.landed(optimizer, "counts differ", differs, micro_step):
        if landed:
            skips.forget(optimizer, "counts differ")
            raise ConfigError(
                "loss_fn returned a different num_targets for different copies of this "
                "sweep: it counts something that depends on the model's outputs, and a "
                "sweep shares one batch and one count, so copy 0's would normalise every "
                "copy's gradients. Count the targets from the batch alone (e.g. "
                "(labels != -100).sum()), or train such copies separately."
            )


def _triple(result: Any) -> tuple[torch.Tensor, Any, Mapping[str, torch.Tensor]]:
    """``(loss_sum, num_targets, aux)`` of any form ``parse_loss_output`` accepts."""
    if isinstance(result, torch.Tensor):
        return result, 1, {}
    if len(result) == 2:
        loss, second = result
        return (loss, 1, second) if isinstance(second, Mapping) else (loss, second, {})
    return result[0], result[1], result[2]


def _around(outer: Any, state: TrainState, inner: Any) -> Any:
    return lambda: outer(state, inner)


def _call(hooks: Mapping[str, tuple[Any, ...]], point: str, state: TrainState) -> None:
    for hook in hooks.get(point, ()):
        hook(state)

"""``make_pipeline_step``: a Step over ``torch.distributed.pipelining`` (GPipe, 1F1B, and the
interleaved schedules).

Each process holds one stage of the model, or several (the interleaved schedules: stage ``i``
on process ``i % size``, the process's stages in one ``nn.ModuleDict`` keyed by stage index).
The step is an ordinary :class:`Step` whose part replaces the runner of phase 1
(:class:`PipelineRunner`), called like any other (``state, out = step(state, batch)``,
``step.flush(state)``), so ``clip``, ``skip_nonfinite``, ``run``/``iterate``, events and
checkpoints work with it. What differs:

* **Phase 1** is the pipeline schedule: it cuts the batch into ``n_microbatches``, runs the
  forwards and backwards of all of them in the schedule's order, passing activations and
  their gradients between the stages (point-to-point), and calls the loss on the last stage.
  Every stage is given the *same* batch: the first stage reads its inputs, the last its
  target. Micro-batching inside the schedule replaces ``accumulate``, which is refused.
* **Token weighting** is the same as everywhere in steplib: the schedule back-propagates each
  micro-batch's loss *sum* (``scale_grads=False``); the sums and target counts of the last
  stage are all-reduced over the pipeline group (one small collective), and every stage
  divides its gradients by the batch's target count. The last stage's aux values are
  broadcast to every stage (:meth:`PipelineRunner.shared_aux`), so every stage reports them.
* **Clipping** uses the norm over *all* stages (:class:`PipelineSync` gives ``Gradients.norm``
  its value): each stage's local norm is raised to the power p and summed over the pipeline
  group (max for ``inf``), so every stage clips by the same coefficient, as
  ``clip_grad_norm_`` on the whole model would, and decides a ``skip_nonfinite`` skip alike.

Checkpoints: each process saves its own part, to its own directory, with the ordinary
``steplib.checkpoint.save(state, f"{root}/stage-{stage.stage_index}", step=step)`` (and
``checkpoint_every(f"{root}/stage-{stage.stage_index}", ...)``, with
``stage = pipeline_stage(step)``; with several stages per process, ``stage_index`` is its
first and the part holds them all). The stages of
:func:`~steplib.distributed.split_model` keep the model's parameter names (prefixed with the
stage index inside a ``ModuleDict``), so loading stage 0's checkpoint into stage 1 is refused
by name (the fingerprint is the same on every stage: ranks compare it with each other).

``tap``: ``after_backward`` is called once per call, after the whole schedule (this stage's
gradients are then complete); ``before_backward`` is refused (the schedule interleaves
forwards and backwards); the update hooks are called as in any step.

Not supported (refused when the step is built, by :meth:`PipelineRunner.refuse`): a part with
a window (``accumulate``: use ``n_microbatches``), with a forward or micro-batch context
(``amp_wrap``: cast the model or autocast inside the stage's forward; ``detect_anomaly``),
another gradient sync (``ddp_wrap``/``fsdp_wrap``: data x pipeline parallelism needs a 2-D
mesh), another runner (``compile_step``).

Several stages per process change nothing above: the gradients a process normalises, clips
and updates are those of all its stages (its optimizer is over the ``ModuleDict``), its share
of the norm covers them all, and its checkpoint holds them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steplib.distributed.collectives import sum_window
from steplib.errors import ConfigError, describe
from steplib.state import TrainState
from steplib.step.core import Runner, Step
from steplib.step.loss_output import LossOutput, parse_loss_output
from steplib.step.parts import GradSync, Part

PipelineLossFn = Callable[[Any, torch.Tensor], Any]


class PipelineSync(GradSync):
    """The window's loss sum and target count live on the last stage: sum them over the
    pipeline group so that every stage divides by the same count and reports the same loss;
    and the gradient norm over every stage."""

    def __init__(self, group: Any, num_stages: int) -> None:
        self.group = group
        self.num_stages = num_stages

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        total, count = sum_window(loss_sum, targets, group=self.group)
        return total, count, 1  # gradients are each stage's own: nothing averaged

    def total_norm(
        self, grads: list[torch.Tensor], norm_type: float, *, device: torch.device
    ) -> torch.Tensor:
        """The p-norm of every stage's gradients: sum of local norms ** p over the pipeline
        group, then the p-th root (the max for ``inf``), reduced in float64 so that stages
        whose gradients differ in dtype still send one dtype."""
        local = super().total_norm(grads, norm_type, device=device).to(device, torch.float64)
        dtype = grads[0].dtype if grads else torch.float32
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            return local.to(dtype)
        powered = local**norm_type
        dist.all_reduce(powered, group=self.group)
        return (powered ** (1.0 / norm_type)).to(dtype)

    def describe(self) -> dict[str, Any]:
        return {"stages": self.num_stages}


class PipelineRunner(Runner):
    """Runs phase 1 as the pipeline schedule; phases 2 and 3 are the core's. Holds what the
    schedule needs between calls: the torch schedule, this stage's module and position, the
    shapes the stages agreed on at the first call, and the per-call list the loss writes into.
    Shared by every step derived from one ``make_pipeline_step``.

    Attributes:
        module: this process's stage module, or its stages in an ``nn.ModuleDict`` keyed by
            stage index when it has several: build the optimizer and
            ``TrainState.create(model=stage.module, ...)`` from it.
        stage_indices: this process's stages, e.g. ``(0, 2)``; ``(rank,)`` with one each.
        stage_index: this process's first stage (its rank in the pipeline group).
        num_stages: the number of stages, over all processes.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        schedule: Any,
        stage_indices: tuple[int, ...],
        num_stages: int,
        n_microbatches: int,
        inputs_and_target: Callable[[Any], tuple[Any, torch.Tensor]],
        group: Any = None,
    ) -> None:
        self.module = module
        self.group = group
        self.schedule = schedule
        self.stage_indices = stage_indices
        self.stage_index = stage_indices[0]
        self.num_stages = num_stages
        self.n_microbatches = n_microbatches
        self.micro_batches = n_microbatches  # a mean loss counts each one (Runner's)
        self.inputs_and_target = inputs_and_target
        self.shapes: list[tuple[int, ...]] | None = None
        self.outputs: list[LossOutput] = []
        # The last stage's aux names, shapes and dtypes, agreed on at the first call.
        self.aux_layout: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def loss(self, user_loss: PipelineLossFn) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        """The schedule's loss: the user's, parsed as steplib parses a ``loss_fn`` result;
        back-propagates the micro-batch's loss sum and records its count and aux."""

        def microbatch_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            out = parse_loss_output(user_loss(output, target))
            aux = {k: v.detach() for k, v in out.aux.items()}
            self.outputs.append(LossOutput(out.loss_sum.detach(), out.num_targets, aux))
            return out.loss_sum

        return microbatch_loss

    def check_shapes(self, inputs: tuple[Any, ...], target: torch.Tensor) -> None:
        # The stages agreed on the activation shapes at the first call and pre-allocated their
        # receive buffers: another batch shape would hang or corrupt the exchange. Every rank
        # holds the same batch, so every rank raises alike, before any communication.
        shapes = [tuple(t.shape) for t in (*inputs, target) if isinstance(t, torch.Tensor)]
        rows = shapes[0][0] if shapes and shapes[0] else 0
        if rows % self.n_microbatches:
            raise ConfigError(
                f"pipeline step: a batch of {rows} rows cannot be cut into "
                f"n_microbatches={self.n_microbatches} equal micro-batches. Use a batch size "
                f"divisible by {self.n_microbatches} (and DataLoader(drop_last=True))."
            )
        if self.shapes is None:
            self.shapes = shapes
        elif shapes != self.shapes:
            raise ConfigError(
                f"pipeline step: this batch has shapes {shapes}, the first had {self.shapes}; "
                "the stages fixed their activation shapes at the first call. Give every call "
                "the same shapes: DataLoader(drop_last=True), and pad sequences to one length."
            )

    def forward_backward(
        self, step: Step, state: TrainState, batch: Any, *, sync: bool
    ) -> LossOutput:
        """Phase 1: the schedule's forwards and backwards of every micro-batch of ``batch``."""
        runtime = self
        if state.model is not runtime.module:
            raise ConfigError(
                f"pipeline step (stage {runtime.stage_index}): the state's model is a "
                f"{type(state.model).__name__} that is not this stage's module. Build the "
                "state from it: TrainState.create(model=pipeline_stage(step).module, ...)."
            )
        if state.scaler is not None and state.scaler.is_enabled():
            raise ConfigError(
                "pipeline step: the state has an enabled GradScaler, but the schedule's "
                "backward is not scaled. Create the state without scaler= (bfloat16 needs none)."
            )
        split = runtime.inputs_and_target(batch)
        if not (isinstance(split, tuple) and len(split) == 2):
            raise ConfigError(
                f"pipeline step: inputs_and_target(batch) returned {describe(split)}; it must "
                "return (inputs, target), inputs a tensor or a tuple of tensors."
            )
        inputs, target = split
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        runtime.check_shapes(args, target)
        runtime.outputs.clear()
        schedule = runtime.schedule
        if runtime.is_first and runtime.is_last:
            schedule.step(*args, target=target, return_outputs=False)
        elif runtime.is_first:
            schedule.step(*args, return_outputs=False)
        elif runtime.is_last:
            schedule.step(target=target, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        for hook in step.plan.hooks.get("after_backward", ()):
            hook(state)  # once: every micro-batch's backward is done
        # The micro-batches' losses are the last n: on the first call torch's shape inference
        # calls the loss once more, first, on placeholder activations.
        combined = _combined(runtime.outputs[-runtime.n_microbatches :], state.device)
        return runtime.shared_aux(combined, state.device)

    def shared_aux(self, out: LossOutput, device: torch.device) -> LossOutput:
        """``out`` with the last stage's aux values on every stage (broadcast over the
        pipeline group), as its loss is: a handler reads the same values on any rank, and
        rank 0, which logs, holds the first stage."""
        size = dist.get_world_size(self.group)
        if size == 1:
            return out
        last = (self.num_stages - 1) % size
        source = last if self.group is None else dist.get_global_rank(self.group, last)
        mine = {k: (tuple(v.shape), v.dtype) for k, v in out.aux.items()}
        if self.aux_layout is None:  # once, at the first call (a host sync, as torch's own)
            sent: list[Any] = [mine if self.is_last else None]
            dist.broadcast_object_list(sent, src=source, group=self.group)
            self.aux_layout = sent[0]
        layout = self.aux_layout
        assert layout is not None
        if self.is_last and mine != layout:
            raise ConfigError(
                f"pipeline step: loss_fn returned the aux values {sorted(out.aux)} here and "
                f"{sorted(layout)} at the first call (names, shapes and dtypes); the other "
                "stages receive them as they were first. Return the same aux at every call."
            )
        aux = dict(out.aux) if self.is_last else {}
        for name, (shape, dtype) in layout.items():
            if not self.is_last:
                aux[name] = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(aux[name], src=source, group=self.group)
        return LossOutput(out.loss_sum, out.num_targets, aux)

    def refuse(self, part: Part) -> str | None:
        """What the schedule cannot honour, refused when the part is added."""
        if part.runner is self:
            return None
        name = part.name
        if part.window is not None and part.window != 1:
            return (
                f"{name}(k={part.window}) cannot wrap a pipeline step: the schedule "
                "already accumulates over its micro-batches. Raise n_microbatches instead "
                "(make_pipeline_step(..., n_microbatches=k * m)) with a k-times larger batch."
            )
        if part.sync is not None:
            return (
                f"{name} cannot wrap a pipeline step: data x pipeline parallelism needs a 2-D "
                "mesh with a pipeline group per data-parallel replica, which "
                f"make_pipeline_step does not build. Remove {name}; the pipeline "
                "synchronises its stages itself."
            )
        if part.forward_context is not None:
            return (
                f"{name} cannot wrap a pipeline step: the schedule runs forward and backward "
                "itself, outside the step's autocast and other forward contexts. Autocast "
                "inside the stage module's forward (with torch.autocast(...)), or cast the "
                "stages, e.g. module.to(torch.bfloat16)."
            )
        if part.micro_context is not None:
            return (
                f"{name} cannot wrap a pipeline step: the schedule interleaves the "
                "micro-batches' forwards and backwards, so its micro-batch context would never "
                "be entered around them. Remove it."
            )
        if "before_backward" in part.hooks:
            return (
                f"{name}(before_backward=...) cannot wrap a pipeline step: the schedule "
                "interleaves the micro-batches' forwards and backwards, so there is no moment "
                "before backward. Use after_backward (called once, after the schedule, with "
                "this stage's gradients complete) or before_update."
            )
        if part.runner is not None:
            return (
                f"{name} cannot wrap a pipeline step: the schedule's point-to-point transfers "
                "are outside what it compiles. Compile the stage modules instead: "
                "module.compile()."
            )
        return None


def pipeline_stage(step: Step) -> PipelineRunner:
    """This process's stage of a step built by :func:`make_pipeline_step`.

    Args:
        step: a pipeline step (wrapped or not).

    Returns:
        Its :class:`PipelineRunner`: ``module`` (this process's stage, or its stages in an
        ``nn.ModuleDict``, to build the optimizer and the state from), ``stage_indices``,
        ``stage_index`` (the first of them) and ``num_stages``.

    Raises:
        ConfigError: ``step`` is not a pipeline step.

    Example:
        >>> from steplib import make_train_step
        >>> pipeline_stage(make_train_step(lambda m, b: m(b).sum()))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: pipeline_stage() needs a step built by make_pipeline_step...
    """
    runner = step.plan.runner if isinstance(step, Step) else None
    if not isinstance(runner, PipelineRunner):
        raise ConfigError(
            f"pipeline_stage() needs a step built by make_pipeline_step, got {describe(step)}."
        )
    return runner


def _combined(outputs: list[LossOutput], device: torch.device) -> LossOutput:
    """One LossOutput for the batch: sums over the micro-batches on the last stage, a zero
    loss and no targets on the others (the window's all-reduce brings them the totals)."""
    if not outputs:
        return LossOutput(torch.zeros((), device=device), 0, {})
    loss_sum = torch.stack([o.loss_sum for o in outputs]).sum()
    count: Any = sum(o.num_targets for o in outputs)
    aux = {k: torch.stack([o.aux[k] for o in outputs]) for k in outputs[0].aux}
    return LossOutput(loss_sum, count, aux)


def pair(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    shown = f"a tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else None
    raise ConfigError(
        f"pipeline step: the batch is {shown or describe(batch)}, not an (inputs, target) "
        "pair. Pass make_pipeline_step(..., inputs_and_target=lambda batch: (batch['x'], "
        "batch['y']))."
    )

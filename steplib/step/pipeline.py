"""``make_pipeline_step``: a Step over ``torch.distributed.pipelining`` (GPipe or 1F1B).

Each process holds one stage of the model. The step is a real :class:`Step`, called like any
other (``state, out = step(state, batch)``, ``step.flush(state)``), so ``clip``,
``skip_nonfinite``, ``run``/``iterate``, events and checkpoints work with it. What differs:

* **Phase 1** is the pipeline schedule: it cuts the batch into ``n_microbatches``, runs the
  forwards and backwards of all of them in the schedule's order, passing activations and
  their gradients between the stages (point-to-point), and calls the loss on the last stage.
  Every stage is given the *same* batch: the first stage reads its inputs, the last its
  target. Micro-batching inside the schedule replaces ``accumulate``, which is refused.
* **Token weighting** is the same as everywhere in steplib: the schedule back-propagates each
  micro-batch's loss *sum* (``scale_grads=False``); the sums and target counts of the last
  stage are all-reduced over the pipeline group (one small collective), and every stage
  divides its gradients by the batch's target count.
* **Clipping** uses the norm over *all* stages: each stage's local norm is raised to the
  power p and summed over the pipeline group (max for ``inf``), so every stage clips by the
  same coefficient, as ``clip_grad_norm_`` on the whole model would, and decides a
  ``skip_nonfinite`` skip alike.

Checkpoints: each stage saves its own part, to its own directory, with the ordinary
``steplib.checkpoint.save(state, f"{root}/stage-{step.stage_index}", step=step)`` (and
``checkpoint_every(f"{root}/stage-{step.stage_index}", ...)``). The stages of
:func:`~steplib.distributed.split_model` keep the model's parameter names, so loading stage
0's checkpoint into stage 1 is refused by name (the fingerprint is the same on every stage:
ranks compare it with each other).

``tap``: ``after_backward`` is called once per call, after the whole schedule (this stage's
gradients are then complete); ``before_backward`` is refused (the schedule interleaves
forwards and backwards); the update hooks are called as in any step.

Not supported (refused when the step is built): ``accumulate`` (use ``n_microbatches``),
``amp_wrap`` (the schedule's backward is not scaled; cast the model or autocast inside the
stage's forward), ``ddp_wrap``/``fsdp_wrap`` (data x pipeline parallelism needs a 2-D mesh),
``compile_step``. Interleaved schedules (several stages per process) are not offered.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steplib.errors import ConfigError, describe
from steplib.state import TrainState
from steplib.step.core import ClipConfig, GradReport, GradSync, Step
from steplib.step.loss_output import LossOutput, parse_loss_output

PipelineLossFn = Callable[[Any, torch.Tensor], Any]
_SCHEDULES = ("gpipe", "1f1b")


class PipelineSync(GradSync):
    """The window's loss sum and target count live on the last stage: sum them over the
    pipeline group so that every stage divides by the same count and reports the same loss."""

    def __init__(self, group: Any, num_stages: int) -> None:
        self.group = group
        self.num_stages = num_stages

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        counts = (
            targets.to(loss_sum.device, torch.float32)
            if isinstance(targets, torch.Tensor)
            else torch.full((), float(targets), device=loss_sum.device)
        )
        packed = torch.stack([loss_sum.float(), counts])
        dist.all_reduce(packed, group=self.group)  # one collective, stays on the device
        return packed[0], packed[1], 1  # gradients are each stage's own: nothing averaged

    def describe(self) -> dict[str, Any]:
        return {"stages": self.num_stages}


class _Runtime:
    """What the schedule needs between calls: the torch stage and schedule, this stage's
    position, the shapes the stages agreed on at the first call, and the per-call list the
    loss writes into. Shared by every step derived from one ``make_pipeline_step``."""

    def __init__(
        self,
        *,
        module: nn.Module,
        schedule: Any,
        stage_index: int,
        num_stages: int,
        n_microbatches: int,
        inputs_and_target: Callable[[Any], tuple[Any, torch.Tensor]],
    ) -> None:
        self.module = module
        self.schedule = schedule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.n_microbatches = n_microbatches
        self.inputs_and_target = inputs_and_target
        self.shapes: list[tuple[int, ...]] | None = None
        self.outputs: list[LossOutput] = []

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

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


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineStep(Step):
    """A :class:`Step` whose forward and backward run as a pipeline schedule over the stages.

    Build it with :func:`make_pipeline_step`. Its ``loss_fn`` is ``loss_fn(output, target)``
    (the last stage's output and the micro-batch's target).

    Attributes:
        pipeline: the runtime shared by every step derived from one ``make_pipeline_step``
            call: this process's stage module and position, the torch schedule, and the
            activation shapes fixed at the first call.
        module: (property) this process's stage module: build the optimizer and
            ``TrainState.create(model=step.module, ...)`` from it.
        stage_index: (property) this process's stage, 0 for the first.
        num_stages: (property) the number of stages (processes in the pipeline group).

    The other attributes (``loss_fn``, ``clip``, ``skip``, ``applied``, ...) are those of
    :class:`Step`; ``grad_sync`` sums the window's loss and target count over the stages.
    Wrapping it with ``accumulate``, ``amp_wrap``, ``ddp_wrap``/``fsdp_wrap``,
    ``compile_step`` or ``tap(before_backward=...)`` raises ``ConfigError``.
    """

    pipeline: _Runtime | None = None
    # The phase-2 settings without norm clipping and skipping, which need the global norm.
    _local: Step | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_composition(self)
        local_clip = None
        if self.clip is not None and self.clip.max_value is not None:
            local_clip = ClipConfig(None, self.clip.norm_type, self.clip.max_value)
        local = Step(loss_fn=self.loss_fn, clip=local_clip, grad_sync=self.grad_sync)
        object.__setattr__(self, "_local", local)

    @property
    def module(self) -> nn.Module:
        """This process's stage module: build the optimizer and the state from it."""
        return self._runtime.module

    @property
    def stage_index(self) -> int:
        """This process's stage, 0 for the first."""
        return self._runtime.stage_index

    @property
    def num_stages(self) -> int:
        return self._runtime.num_stages

    @property
    def _runtime(self) -> _Runtime:
        if self.pipeline is None:
            raise ConfigError(
                "PipelineStep was built without a pipeline; build it with "
                "make_pipeline_step(loss_fn, stages, n_microbatches=...)."
            )
        return self.pipeline

    def forward_backward(self, state: TrainState, batch: Any, *, sync: bool) -> LossOutput:
        """Phase 1: the schedule's forwards and backwards of every micro-batch of ``batch``."""
        runtime = self._runtime
        if state.model is not runtime.module:
            raise ConfigError(
                f"pipeline step (stage {runtime.stage_index}): the state's model is a "
                f"{type(state.model).__name__} that is not this stage's module. Build the "
                "state from it: TrainState.create(model=step.module, optimizer=...)."
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
        hooks = self.hooks
        if hooks is not None and hooks.after_backward is not None:
            hooks.after_backward(state)  # once: every micro-batch's backward is done
        # The micro-batches' losses are the last n: on the first call torch's shape inference
        # calls the loss once more, first, on placeholder activations.
        return _combined(runtime.outputs[-runtime.n_microbatches :], state.device)

    def process_grads(self, state: TrainState) -> GradReport:
        """Phase 2: the core's (window sums over the group, normalise, clip by value), then
        clip and skip by the norm over every stage."""
        local = self._local
        assert local is not None  # set in __post_init__
        report = Step.process_grads(local, state)
        clip, skip = self.clip, self.skip
        if (clip is None or clip.max_norm is None) and skip is None:
            return report
        params = [
            p for g in state.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        norm_type = clip.norm_type if clip is not None else 2.0
        norm = _global_norm([p.grad for p in params], norm_type, self.grad_sync, state.device)
        if clip is not None and clip.max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, clip.max_norm, norm)
        nonfinite = report.nonfinite
        if skip is not None:
            # The global norm and loss: every stage decides alike (no stage steps alone).
            bad = ~torch.isfinite(norm) | ~torch.isfinite(report.loss_sum)
            nonfinite = bad if nonfinite is None else nonfinite | bad
        return GradReport(report.loss_sum, report.num_targets, norm, nonfinite)


def make_pipeline_step(
    loss_fn: PipelineLossFn,
    stages: Sequence[nn.Module | None],
    *,
    n_microbatches: int,
    schedule: str = "1f1b",
    inputs_and_target: Callable[[Any], tuple[Any, torch.Tensor]] | None = None,
    group: Any = None,
) -> PipelineStep:
    """Build this process's pipeline step; every process of the pipeline group calls it.

    Args:
        loss_fn: ``loss_fn(output, target)`` on the last stage, per micro-batch, returning a
            scalar loss or ``(loss_sum, num_targets)`` (optionally with an aux dict), as a
            steplib ``loss_fn`` does. With a plain mean loss, each micro-batch counts 1.
        stages: the stage modules in pipeline order, one per process of ``group``
            (:func:`steplib.distributed.split_model` makes them); this process takes entry
            ``rank in group``. Entries of other processes may be ``None`` (build only yours).
        n_microbatches: micro-batches per batch (and per optimizer update); 1F1B needs at
            least as many as there are stages.
        schedule: ``"1f1b"`` (less activation memory) or ``"gpipe"`` (all forwards, then all
            backwards).
        inputs_and_target: ``batch -> (inputs, target)``; by default the batch is the pair.
            The first stage receives ``inputs`` (a tensor or a tuple of tensors), the last
            stage passes ``target`` to ``loss_fn``; both are cut along dimension 0.
        group: the pipeline's process group (default: all processes).

    Returns:
        A :class:`PipelineStep`; ``step.module`` is this process's stage, to build the
        optimizer and ``TrainState.create(model=step.module, ...)`` from.

    Raises:
        ConfigError: no process group; a number of stages other than the group's size; this
            process's stage missing; a bad ``loss_fn``, ``n_microbatches`` or ``schedule``;
            processes that disagree on the settings (checked with one collective, after
            which every process raises the same error instead of one hanging).

    Example:
        In one process without a process group, building the step is refused at once:

        >>> import torch
        >>> stages = [torch.nn.Linear(4, 2)]
        >>> make_pipeline_step(  # doctest: +ELLIPSIS
        ...     lambda output, target: torch.nn.functional.mse_loss(output, target),
        ...     stages,
        ...     n_microbatches=2,
        ... )
        Traceback (most recent call last):
        steplib.errors.ConfigError: make_pipeline_step needs an initialised process group ...

        Under ``torchrun --nproc-per-node=2`` (one process per stage; see
        ``tests/test_pipeline.py``):

        >>> stages = split_model(model, split_points=["3"])  # doctest: +SKIP
        >>> step = clip(make_pipeline_step(loss_fn, stages, n_microbatches=4),
        ...             max_norm=1.0)  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(step.module.parameters())  # doctest: +SKIP
        >>> state = TrainState.create(model=step.module, optimizer=opt)  # doctest: +SKIP
        >>> state = run(step, state, loader)  # doctest: +SKIP
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "make_pipeline_step needs an initialised process group (one process per stage), "
            "and none is. Launch with torchrun --nproc-per-node=<stages> and call "
            "steplib.distributed.init_distributed() before building the step."
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    settings = {
        "schedule": schedule,
        "n_microbatches": n_microbatches,
        "stages": len(stages) if isinstance(stages, Sequence) else None,
    }
    problem = _local_problem(loss_fn, stages, rank, size, n_microbatches, schedule)
    views: list[Any] = [None] * size
    # Once, at build time: a host sync is fine. Gathering the problems too means a process
    # that found one does not leave the others waiting in the first point-to-point transfer.
    dist.all_gather_object(views, (settings, problem), group=group)
    for other, (theirs, their_problem) in enumerate(views):
        if their_problem is not None:
            raise ConfigError(their_problem if other == rank else f"rank {other}: {their_problem}")
        if theirs != settings:
            raise ConfigError(
                f"make_pipeline_step: rank {rank} was given {settings} but rank {other} "
                f"{theirs}. Every process must build the pipeline with the same settings."
            )
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module = stages[rank]
    assert module is not None  # _local_problem checked it
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    runtime = _Runtime(
        module=module,
        schedule=None,
        stage_index=rank,
        num_stages=size,
        n_microbatches=n_microbatches,
        inputs_and_target=inputs_and_target or _pair,
    )
    stage = PipelineStage(module, rank, size, device, group=group)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    # scale_grads=False: the loss is a sum; steplib divides by the target count once.
    runtime.schedule = kind(stage, n_microbatches, loss_fn=runtime.loss(loss_fn), scale_grads=False)
    return PipelineStep(
        loss_fn=loss_fn,
        grad_sync=PipelineSync(group, size),
        applied=(("pipeline", settings),),
        pipeline=runtime,
    )


def _local_problem(
    loss_fn: Any, stages: Any, rank: int, size: int, n_microbatches: Any, schedule: Any
) -> str | None:
    """This process's build-time problem, as the message of the error to raise, else None."""
    if not callable(loss_fn):
        return (
            f"make_pipeline_step received loss_fn={describe(loss_fn)}, which is not callable. "
            "Pass def loss_fn(output, target): return F.cross_entropy(output, target)."
        )
    try:
        inspect.signature(loss_fn).bind(object(), object())
    except TypeError as err:
        return (
            f"make_pipeline_step: loss_fn cannot be called as loss_fn(output, target) ({err}); "
            "in a pipeline the loss sees the last stage's output and the target, not the model."
        )
    except ValueError:
        pass  # builtins without a signature
    if isinstance(stages, nn.Module) or not isinstance(stages, Sequence):
        return (
            f"make_pipeline_step received stages={describe(stages)}; pass the list of stage "
            "modules in pipeline order, e.g. split_model(model, split_points=['3'])."
        )
    if len(stages) != size:
        return (
            f"make_pipeline_step received {len(stages)} stages for a pipeline group of {size} "
            f"processes; there must be one stage per process. Split the model into {size} "
            f"stages (split_model(model, split_points=[...]) with {size - 1} child name(s)) "
            f"or launch {len(stages)} processes (torchrun --nproc-per-node={len(stages)})."
        )
    if not isinstance(stages[rank], nn.Module):
        return (
            f"make_pipeline_step: stages[{rank}] (this process's stage) is "
            f"{describe(stages[rank])}, not an nn.Module. Pass this process's stage module."
        )
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or n_microbatches < 1
    ):
        return (
            f"make_pipeline_step(n_microbatches=...) received {describe(n_microbatches)}; pass "
            "an int >= 1 (the micro-batches each batch is cut into), e.g. n_microbatches=4."
        )
    if schedule not in _SCHEDULES:
        return (
            f"make_pipeline_step(schedule=...) received {describe(schedule)}; the schedules "
            f"are {list(_SCHEDULES)}."
        )
    if schedule == "1f1b" and n_microbatches < size:
        return (
            f"make_pipeline_step: 1F1B with n_microbatches={n_microbatches} and {size} stages "
            f"leaves a stage idle; pass n_microbatches >= {size}, or schedule='gpipe'."
        )
    return None


def _check_composition(step: PipelineStep) -> None:
    """Refuse, when a wrapper is applied, what the schedule cannot honour."""
    names = [name for name, _ in step.applied]
    if step.accumulation != 1:
        raise ConfigError(
            f"accumulate(k={step.accumulation}) cannot wrap a pipeline step: the schedule "
            "already accumulates over its micro-batches. Raise n_microbatches instead "
            "(make_pipeline_step(..., n_microbatches=k * m)) with a k-times larger batch."
        )
    if step.amp is not None:
        raise ConfigError(
            "amp_wrap cannot wrap a pipeline step: the schedule runs forward and backward "
            "itself, outside the step's autocast. Autocast inside the stage module's forward "
            "(with torch.autocast(...)), or cast the stages, e.g. module.to(torch.bfloat16)."
        )
    if not isinstance(step.grad_sync, PipelineSync):
        wrapper = next((n for n in names if n in ("ddp_wrap", "fsdp_wrap")), "data parallelism")
        raise ConfigError(
            f"{wrapper} cannot wrap a pipeline step: data x pipeline parallelism needs a 2-D "
            "mesh with a pipeline group per data-parallel replica, which make_pipeline_step "
            f"does not build. Remove {wrapper}; the pipeline synchronises its stages itself."
        )
    if step.hooks is not None and step.hooks.before_backward is not None:
        raise ConfigError(
            "tap(before_backward=...) cannot wrap a pipeline step: the schedule interleaves "
            "the micro-batches' forwards and backwards, so there is no moment before "
            "backward. Use after_backward (called once, after the schedule, with this "
            "stage's gradients complete) or before_update."
        )
    if "compile_step" in names:
        raise ConfigError(
            "compile_step cannot wrap a pipeline step: the schedule's point-to-point "
            "transfers are outside what it compiles. Compile the stage modules instead: "
            "module.compile()."
        )


def _combined(outputs: list[LossOutput], device: torch.device) -> LossOutput:
    """One LossOutput for the batch: sums over the micro-batches on the last stage, a zero
    loss and no targets on the others (the window's all-reduce brings them the totals)."""
    if not outputs:
        return LossOutput(torch.zeros((), device=device), 0, {})
    loss_sum = torch.stack([o.loss_sum for o in outputs]).sum()
    count: Any = sum(o.num_targets for o in outputs)
    aux = {k: torch.stack([o.aux[k] for o in outputs]) for k in outputs[0].aux}
    return LossOutput(loss_sum, count, aux)


def _global_norm(
    grads: list[Any], norm_type: float, sync: GradSync, device: torch.device
) -> torch.Tensor:
    """The p-norm of every stage's gradients: sum of local norms ** p over the pipeline
    group, then the p-th root (the max for ``inf``), reduced in float64 so that stages whose
    gradients differ in dtype still send one dtype."""
    assert isinstance(sync, PipelineSync)
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type).to(device, torch.float64)
    else:
        local = torch.zeros((), device=device, dtype=torch.float64)
    dtype = grads[0].dtype if grads else torch.float32
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=sync.group)
        return local.to(dtype)
    powered = local**norm_type
    dist.all_reduce(powered, group=sync.group)
    return (powered ** (1.0 / norm_type)).to(dtype)


def _pair(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    shown = f"a tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else None
    raise ConfigError(
        f"pipeline step: the batch is {shown or describe(batch)}, not an (inputs, target) "
        "pair. Pass make_pipeline_step(..., inputs_and_target=lambda batch: (batch['x'], "
        "batch['y']))."
    )

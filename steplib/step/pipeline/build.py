"""``make_pipeline_step``: build this process's pipeline step, after checks that every process
runs (and agrees on) before the first point-to-point transfer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steplib.errors import ConfigError, describe
from steplib.step.core import Step, add_part
from steplib.step.parts import Part
from steplib.step.pipeline.runner import PipelineLossFn, PipelineRunner, PipelineSync, pair

# One stage per process; then the schedules that run several (stage i on process i % size).
_SINGLE = ("gpipe", "1f1b")
_SCHEDULES = (*_SINGLE, "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")


def make_pipeline_step(
    loss_fn: PipelineLossFn,
    stages: Sequence[nn.Module | None],
    *,
    n_microbatches: int,
    schedule: str = "1f1b",
    inputs_and_target: Callable[[Any], tuple[Any, torch.Tensor]] | None = None,
    group: Any = None,
) -> Step:
    """Build this process's pipeline step; every process of the pipeline group calls it.

    Args:
        loss_fn: ``loss_fn(output, target)`` on the last stage, per micro-batch, returning a
            scalar loss or ``(loss_sum, num_targets)`` (optionally with an aux dict), as a
            steplib ``loss_fn`` does. With a plain mean loss, each micro-batch counts 1.
        stages: the stage modules in pipeline order (:func:`steplib.distributed.split_model`
            makes them): one per process of ``group``, or a multiple of its size for the
            schedules that run several stages per process, placed in a loop (stage ``i`` on
            process ``i % size``: with 4 stages on 2 processes, 0 and 2 on rank 0, 1 and 3 on
            rank 1). This process takes entries ``rank, rank + size, ...``; the entries of
            other processes may be ``None`` (build only yours).
        n_microbatches: micro-batches per batch (and per optimizer update); 1F1B needs at
            least as many as there are stages; the interleaved schedules a multiple of
            ``n_microbatches // size`` (any multiple of ``size`` is).
        schedule: one stage per process: ``"1f1b"`` (less activation memory) or ``"gpipe"``
            (all forwards, then all backwards). Several stages per process (or one):
            ``"interleaved-1f1b"`` (depth first: fewer micro-batches in flight),
            ``"looped-bfs"`` (breadth first: each stage runs all its micro-batches) or
            ``"interleaved-zero-bubble"`` (splits each backward to fill the bubble; a stage
            output that is a view, as an ``nn.Linear`` on a 3-D input returns, is copied
            first: torch's split backward cannot free a view's graph).
        inputs_and_target: ``batch -> (inputs, target)``; by default the batch is the pair.
            The first stage receives ``inputs`` (a tensor or a tuple of tensors), the last
            stage passes ``target`` to ``loss_fn``; both are cut along dimension 0.
        group: the pipeline's process group (default: all processes).

    Returns:
        A :class:`~steplib.step.Step` whose runner is a :class:`PipelineRunner`;
        ``pipeline_stage(step).module`` is this process's stage (``stages[rank]``), or with
        several an ``nn.ModuleDict`` of them keyed by stage index (``{"0": ..., "2": ...}``),
        to build the optimizer and ``TrainState.create(model=..., ...)`` from.

    Raises:
        ConfigError: no process group; a number of stages that is not a multiple of the
            group's size (or not equal to it for ``"gpipe"``/``"1f1b"``); one of this
            process's stages missing; a parameter shared by stages on different processes (a
            tied weight split apart); a bad ``loss_fn``, ``n_microbatches`` or ``schedule``, or
            an ``n_microbatches`` the interleaved schedule cannot divide into rounds;
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
        >>> module = pipeline_stage(step).module  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(module.parameters())  # doctest: +SKIP
        >>> state = TrainState.create(model=module, optimizer=opt)  # doctest: +SKIP
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
    from torch.distributed.pipelining import PipelineStage

    indices = tuple(range(rank, len(stages), size))
    mine = {str(i): m for i in indices if (m := stages[i]) is not None}  # checked: modules
    module = mine[str(rank)] if len(indices) == 1 else nn.ModuleDict(mine)
    first = next(iter(module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    runtime = PipelineRunner(
        module=module,
        schedule=None,
        stage_indices=indices,
        num_stages=len(stages),
        n_microbatches=n_microbatches,
        inputs_and_target=inputs_and_target or pair,
        group=group,
    )
    if schedule == "interleaved-zero-bubble":
        # It splits each backward in two and frees the first half's graph with an in-place
        # detach_() of the stage outputs, which torch refuses on a view (pytorch#142229): an
        # nn.Linear on a 3-D input returns one. The hook hands the schedule a copy instead.
        for stage in mine.values():
            stage.register_forward_hook(_outputs_not_views)
    built = [PipelineStage(mine[str(i)], i, len(stages), device, group=group) for i in indices]
    # scale_grads=False: the loss is a sum; steplib divides by the target count once.
    runtime.schedule = _schedule_class(schedule)(
        built[0] if schedule in _SINGLE else built,
        n_microbatches,
        loss_fn=runtime.loss(loss_fn),
        scale_grads=False,
    )
    sync = PipelineSync(group, len(stages))
    part = Part(name="pipeline", settings=settings, sync=sync, runner=runtime)
    # Step(...) directly: this loss_fn is loss_fn(output, target), checked above.
    return add_part(Step(loss_fn=loss_fn), part)


def _outputs_not_views(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage's output with each tensor that is a view replaced by a copy (a forward hook)."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._is_view() else output
    if isinstance(output, tuple):
        return tuple(_outputs_not_views(module, args, item) for item in output)
    return output


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
    )

    classes = (
        ScheduleGPipe,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
        ScheduleInterleavedZeroBubble,
    )
    return classes[_SCHEDULES.index(name)]


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
    if not stages or len(stages) % size:
        return (
            f"make_pipeline_step received {len(stages)} stages for a pipeline group of {size} "
            f"processes; every process must hold as many stages as the others (stage i on "
            f"process i % {size}). Split the model into {size} stages (split_model(model, "
            f"split_points=[...]) with {size - 1} child name(s)), or {2 * size} with "
            f"schedule='interleaved-1f1b', or launch {len(stages) or 1} processes "
            f"(torchrun --nproc-per-node={len(stages) or 1})."
        )
    for index in range(rank, len(stages), size):
        if not isinstance(stages[index], nn.Module):
            return (
                f"make_pipeline_step: stages[{index}] (a stage of this process, rank {rank}) "
                f"is {describe(stages[index])}, not an nn.Module. Pass this process's stage "
                f"modules (entries {rank}, {rank + size}, ... of the list)."
            )
    shared = _shared_across_processes(stages, size)
    if shared is not None:
        return shared
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
    if schedule in _SINGLE and len(stages) != size:
        return (
            f"make_pipeline_step(schedule={schedule!r}) runs one stage per process, but "
            f"received {len(stages)} stages for {size} processes ({len(stages) // size} each). "
            "Pass schedule='interleaved-1f1b' (or 'looped-bfs', 'interleaved-zero-bubble') to "
            f"run several stages per process, or split the model into {size} stages."
        )
    if schedule == "1f1b" and n_microbatches < size:
        return (
            f"make_pipeline_step: 1F1B with n_microbatches={n_microbatches} and {size} stages "
            f"leaves a stage idle; pass n_microbatches >= {size}, or schedule='gpipe'."
        )
    rounds = max(1, n_microbatches // size)
    if schedule.startswith("interleaved") and n_microbatches % rounds:
        # torch's rule (the micro-batches go round the processes in equal rounds), checked
        # here so that every process raises it before the first transfer.
        return (
            f"make_pipeline_step(schedule={schedule!r}) with n_microbatches={n_microbatches} "
            f"on {size} processes: it runs them in {rounds} rounds of n_microbatches // "
            f"{size}, and {n_microbatches} is not a multiple of {rounds}. Pass a multiple of "
            f"{size}, e.g. n_microbatches={size * rounds}, or schedule='looped-bfs'."
        )
    return None


def _shared_across_processes(stages: Sequence[Any], size: int) -> str | None:
    """The problem with a parameter held by two stages on different processes (a tied
    weight, split apart), else None: each process would train its own copy from its own
    stage's share of the gradient, and the copies would drift apart in silence. Stages on one
    process may share one (their optimizer holds it once; its gradient adds up)."""
    holder: dict[int, tuple[int, str]] = {}
    for index, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            continue  # another process's entry, left out: that process checks it
        for name, p in stage.named_parameters(remove_duplicate=False):
            first = holder.setdefault(id(p), (index, name))
            if first[0] % size != index % size:
                return (
                    f"make_pipeline_step: stage {first[0]}'s parameter {first[1]!r} is also "
                    f"stage {index}'s {name!r} (a tied weight), and the two stages run on "
                    f"different processes ({first[0] % size} and {index % size}). Each would "
                    "train its own copy from its own stage's share of the gradient, so the "
                    "copies drift apart. Keep every use of the parameter in one stage (split "
                    "elsewhere), or untie it on purpose, e.g. model[4].weight = "
                    "nn.Parameter(model[0].weight.detach().clone())."
                )
    return None

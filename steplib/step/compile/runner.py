"""``compile_step``: the step's forward, backward, gradient processing and optimizer update under
``torch.compile``, run by :class:`CompiledRunner` over the same step record (the phases are the
core's own functions, compiled: one code path).

Once warm, each micro-batch is one graph (forward and backward by ``torch.func.grad_and_value``,
accumulation included), and the closing micro-batch, phase 2 and the update are one graph when
nothing may act between them (a skip decision, a ``tap(before_update=...)``, optimizer hooks, a
shorter last window, distributed gradients or loss scaling compile them apart or run phase 2
eagerly). The first update of an optimizer runs eagerly (it creates the optimizer's state); one
loaded from a checkpoint compiles at once, so a resumed run equals the uninterrupted one.
What runs where, why, the numerics and the measured costs: docs/performance.md, ``compile_step``.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from steplib.errors import ConfigError, describe
from steplib.lineage import backward_failed
from steplib.state import TrainState
from steplib.step.compile.fused import FusedPlan, make_fused_plan
from steplib.step.compile.graphs import (
    CompileStats,
    Region,
    hooked_update,
    inner_backend,
    keep_guards,
    micro_acc,
    micro_and_update,
    micro_first,
    needs_prepare,
    plain_step,
    prepare,
    process_and_update,
    update,
    uses_cuda_graphs,
    without_cuda_graphs,
)
from steplib.step.core import LossFn, Runner, Step, add_part
from steplib.step.loss_output import NO_AUX, LossOutput
from steplib.step.parts import LOCAL, GradReport, Part
from steplib.step.phases import forward_backward, process_grads
from steplib.step.plan import scaler_active


def compile_step(step: Step, **compile_kwargs: Any) -> Step:
    """Compile the step's forward/backward, gradient processing and optimizer update.

    Apply it last: the wrappers' settings are captured when it is applied. The first update
    runs eagerly and the second compiles (seconds on a CPU); an optimizer loaded from a
    checkpoint compiles at once, so a resumed run equals the uninterrupted one bit for bit.
    That needs state for every parameter (its proof that each had a gradient): an optimizer
    that keeps none (``SGD`` without momentum) makes its first update after a resume eagerly,
    a rounding (~1e-8) apart from the compiled one of the uninterrupted run.
    ``compile_stats(step)`` counts graphs and recompiles.

    Args:
        step: the step to compile.
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``dynamic``, ``fullgraph``,
            ``options``, ``backend`` — a backend name or callable; the default is inductor,
            whose ``size_asserts`` are off unless ``options`` sets them).

    Returns:
        The compiled step. Numerically it matches the eager one within floating-point
        reordering: ~1e-8 per update in float32, ~1e-17 in float64 (tested: 1e-5 and 1e-12
        after 200 AdamW updates). Under autocast (``amp_wrap``) inductor keeps the values
        inside a fused chain in float32 where eager rounds each op's output to float16 or
        bfloat16: 6e-5 and 7e-4 apart after 8 updates of a tiny MLP; pass
        ``options={"emulate_precision_casts": True}`` to round as eager does (1e-7 there).
        Two things amplify that difference over many updates, in any
        two implementations that round differently: a ReLU gate that a rounding difference
        flips, and Adam on a parameter whose true gradient is zero (a bias before BatchNorm,
        an attention key bias), whose rounding noise it normalises into lr-sized steps.
        With CUDA graphs (``mode="reduce-overhead"``) each micro-batch's forward/backward is
        one CUDA graph, and the optimizer's own ``step()`` runs eagerly (dynamo cannot trace
        an optimizer while CUDA graph trees run; an update mutates its inputs, which CUDA
        graphs never capture anyway).
        Random numbers: on the fused path dropout draws eager's masks; on the autograd path
        (a model the fused plan cannot take, e.g. with BatchNorm) inductor draws its own, so
        the losses differ from eager's from the first dropout on; pass
        ``options={"fallback_random": True}`` for eager's masks there too (slower).
        One semantic difference: on the fused path a parameter that gets no gradient in a
        later window receives zeros, not ``None``, so AdamW's weight decay and momentum still
        move it (the first update checks that every parameter gets one; a model whose
        parameters are used only sometimes should not be compiled this way).

    Raises:
        ConfigError: ``step`` is already compiled, or a ``compile_kwargs`` key that
            ``torch.compile`` does not take.

    Example:
        >>> from steplib import make_train_step
        >>> step = compile_step(make_train_step(lambda m, b: m(b).sum()), mode="default")
        >>> step.describe()
        [{'wrapper': 'compile_step', 'mode': 'default'}]
        >>> compile_stats(step).graphs
        0
    """
    allowed = {"mode", "dynamic", "fullgraph", "backend", "options"}
    unknown = sorted(set(compile_kwargs) - allowed)
    if unknown:
        raise ConfigError(
            f"compile_step received {unknown}, which torch.compile does not take here. Use "
            f"some of: {sorted(allowed)}, e.g. compile_step(step, mode='max-autotune')."
        )
    kwargs = dict(compile_kwargs)
    inner = inner_backend(
        kwargs.pop("backend", "inductor"),
        mode=kwargs.pop("mode", None),
        options=kwargs.pop("options", None),
        dynamic=kwargs.get("dynamic"),
    )
    runner = CompiledRunner(CompileStats(), inner, kwargs)
    settings = {k: v for k, v in compile_kwargs.items() if k != "options"}
    return add_part(step, Part(name="compile_step", settings=settings, runner=runner, last=True))


class CompiledRunner(Runner):
    """Runs a step's phases through compiled graphs once its optimizer has made one (eager)
    update; the phases themselves are the core's (one code path), compiled. Mutable on purpose
    (like :class:`CompileStats`): it caches per optimizer, never per state, holding them weakly.

    Attributes:
        stats: the graphs and recompiles counted so far (``step.plan.runner.stats``, also
            ``compile_stats(step)``).
    """

    def __init__(self, stats: CompileStats, inner: Any, kwargs: dict[str, Any]) -> None:
        self.stats = stats
        self.inner = inner
        self.kwargs = kwargs
        # Under CUDA graphs the optimizer update runs eagerly: dynamo cannot trace an optimizer
        # once CUDA graph trees run (torch asserts the tree has a current node, and it has none
        # between two no_grad graphs: an H100 run hit it), and an update's graph mutates its
        # inputs, which CUDA graphs never capture anyway. The forward/backward is captured.
        self.cuda_graphs = uses_cuda_graphs(inner)
        self.micro_first = self._region(micro_first)
        self.micro_acc = self._region(micro_acc)
        # Phase 2 scales the gradients in place: CUDA graphs never capture a graph that
        # mutates its inputs (inductor warned at each compile and ran it uncaptured), so it is
        # compiled without them.
        self.compiled_process = self._region(process_grads, inner=without_cuda_graphs(inner))
        self.process_and_update = self._region(process_and_update)
        self.micro_and_update = self._region(micro_and_update)
        self.update = self._region(update)
        self.hooked_update = self._region(hooked_update)
        # optimizer -> whether all its parameters had a gradient at its first (eager) update
        self.prepared: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self.plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, FusedPlan | None] = (
            weakref.WeakKeyDictionary()
        )
        self.raw_steps: dict[type, Callable[..., Any]] = {}
        # the step whose loss_fn is compiled for the autograd path, and that loss_fn's region
        self.autograd: tuple[LossFn, Step] | None = None

    def _region(self, fn: Callable[..., Any], *, ours: bool = True, inner: Any = None) -> Region:
        guard_filter = keep_guards if ours else None
        backend = self.inner if inner is None else inner
        return Region(fn, backend, self.stats, self.kwargs, guard_filter=guard_filter)

    def refuse(self, part: Part) -> str | None:
        return None  # it runs every part: the phases are the core's

    def forward_backward(
        self, step: Step, state: TrainState, batch: Any, *, sync: bool
    ) -> LossOutput:
        if state.optimizer not in self.prepared and not self.adopt(state):
            return forward_backward(step, state, batch, sync=sync)  # the eager first update
        plan = self.plan(step, state)
        if plan is not None:
            if plan.checked:
                try:  # one graph: its backward may have added to .grad when it raised
                    if sync and self.updates_in_graph(step, state, state.window.size + 1):
                        return self.micro_update(plan, step, state, batch)
                    return self.micro(plan, batch)
                except BaseException:
                    backward_failed(state)
                    raise
            try:
                out = self.micro(plan, batch)
            except Exception as error:
                # What the transform cannot trace (a buffer updated in place, as BatchNorm's
                # running statistics are) runs through autograd instead; a genuine error in
                # loss_fn is raised there again.
                self.give_up(state.optimizer, error)
            else:
                plan.checked = True
                return out
        return forward_backward(self.autograd_step(step), state, batch, sync=sync)

    def adopt(self, state: TrainState) -> bool:
        """Take an optimizer that holds state for every parameter already (loaded from a
        checkpoint, or stepped before) as prepared: its next update is compiled, as it was in
        the run that saved it, so a resumed run computes the same numbers. A fresh one makes
        its first update eagerly (it creates its state then), and so does one whose scheduler
        has never stepped: torch's schedulers check at their first step that the optimizer's
        own ``step`` ran, which a graph running the update's body does not tell them."""
        optimizer, scheduler = state.optimizer, state.scheduler
        if scheduler is not None and getattr(scheduler, "last_epoch", 1) <= 0:
            return False
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params or not all(optimizer.state.get(p) for p in params):
            return False
        if not self.cuda_graphs:
            prepare(optimizer)
        self.prepared[optimizer] = True  # each parameter had a gradient: it has state
        return True

    def autograd_step(self, step: Step) -> Step:
        """``step`` with its ``loss_fn`` compiled (AOTAutograd compiles the backward)."""
        if self.autograd is None or self.autograd[0] is not step.loss_fn:
            compiled = self._region(step.loss_fn, ours=False)
            self.autograd = (step.loss_fn, dataclasses.replace(step, loss_fn=compiled))
        return self.autograd[1]

    def compiles_phase2(self, step: Step, state: TrainState, size: int) -> bool:
        """Whether phase 2 of a window of ``size`` micro-batches runs as a graph."""
        return (
            state.optimizer in self.prepared
            and step.plan.sync is LOCAL
            and not scaler_active(state)
            # A shorter last window (another Python target count) would compile once more.
            and size == step.plan.window
        )

    def updates_in_graph(self, step: Step, state: TrainState, size: int) -> bool:
        """Whether the update joins phase 2's graph: nothing may act between the two."""
        plan = step.plan
        return (
            self.compiles_phase2(step, state, size)
            and not self.cuda_graphs
            and not plan.updates
            and "before_update" not in plan.hooks
            and plain_step(state.optimizer)
        )

    def micro_update(
        self, plan: FusedPlan, step: Step, state: TrainState, batch: Any
    ) -> LossOutput:
        """The closing micro-batch, phase 2 and the update in one graph (one graph entry fewer
        per update); the output carries phase 2's report, which says the update was made."""
        if any(p.grad is None for p in plan.params):  # a window of one, or grads set to None
            return self.micro(plan, batch)
        if needs_prepare(optimizer := state.optimizer):
            prepare(optimizer)
        state.fence.wait()  # what Step._close waits for before an update, which this is
        raw_step = self.raw_step(optimizer)
        out, report, updated = self.micro_and_update(plan, batch, step, state, raw_step)
        self.stats.updates += updated
        report = report._replace(updated=updated)
        return LossOutput(out[0], out[1], out[2] if out[2] else NO_AUX, report)

    def process_grads(
        self, step: Step, state: TrainState, *, window: tuple[torch.Tensor, Any] | None = None
    ) -> GradReport:
        optimizer, size = state.optimizer, state.window.size if window is None else 0
        if self.updates_in_graph(step, state, size):
            # Phase 2 and the optimizer update in one graph when nothing may skip the update;
            # phase 3's optimizer_step then only records it.
            if needs_prepare(optimizer):
                prepare(optimizer)
            report, updated = self.process_and_update(step, state, self.raw_step(optimizer))
            self.stats.updates += updated
            return report._replace(updated=updated)
        if self.compiles_phase2(step, state, size):
            return self.compiled_process(step, state)
        return process_grads(step, state, window=window)

    def optimizer_step(self, step: Step, optimizer: torch.optim.Optimizer) -> None:
        """Phase 3's optimizer update: eager the first time for this optimizer (and always
        under CUDA graphs), then compiled."""
        first = optimizer not in self.prepared
        if first or self.cuda_graphs:
            has_grads = first and all(
                p.grad is not None for g in optimizer.param_groups for p in g["params"]
            )
            optimizer.step()  # creates the optimizer's state lazily: not worth a graph
            if first:
                if not self.cuda_graphs:
                    prepare(optimizer)
                self.prepared[optimizer] = has_grads
        else:
            if needs_prepare(optimizer):  # e.g. a state loaded from a checkpoint since
                prepare(optimizer)
            if plain_step(optimizer):
                self.update(self.raw_step(optimizer), optimizer)
            else:
                self.hooked_update(optimizer)
        self.stats.updates += 1

    def raw_step(self, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
        """The optimizer class's ``step`` body, without its decorators."""
        raw = self.raw_steps.get(type(optimizer))
        if raw is None:
            raw = self.raw_steps[type(optimizer)] = inspect.unwrap(type(optimizer).step)
        return raw

    def plan(self, step: Step, state: TrainState) -> FusedPlan | None:
        """The fused forward/backward plan for ``state``, or ``None`` where autograd must run."""
        optimizer = state.optimizer
        fused = self.plans.get(optimizer, _MISSING)
        # Made again when it no longer fits: a parameter frozen since must get no gradient and
        # one added to the optimizer must get one, as under autograd (the fused graph
        # differentiates exactly the parameters it was made with).
        if fused is not _MISSING and (fused is None or fused.fits(state.model, optimizer)):
            return fused
        fused = None
        plan = step.plan
        if (
            self.prepared[optimizer]
            and plan.sync is LOCAL  # DDP/FSDP reduce in autograd hooks
            and not plan.micro_contexts
            and not plan.forward_contexts
            and not scaler_active(state)
            and "before_backward" not in plan.hooks
            and "after_backward" not in plan.hooks
        ):
            fused = make_fused_plan(state.model, optimizer, step.loss_fn)
        self.plans[optimizer] = fused
        self.stats.fused_backward = fused is not None
        return fused

    def give_up(self, optimizer: torch.optim.Optimizer, error: Exception) -> None:
        """Use autograd for this optimizer's model from now on, and say why."""
        self.plans[optimizer] = None
        self.stats.fused_backward = False
        self.stats.why_not_fused = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"

    def micro(self, plan: FusedPlan, batch: Any) -> LossOutput:
        """One micro-batch through the fused graph; its gradients end up in ``p.grad``."""
        params = plan.params
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            new, loss_sum, count, aux = self.micro_first(plan, batch)
            for p, g in zip(params, new, strict=True):
                p.grad = g
        else:
            if any(g is None for g in grads):  # a gradient set outside the step: add to it
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]  # none is None now
            if self.cuda_graphs:  # a graph adding to its inputs would not be captured
                new, loss_sum, count, aux = self.micro_first(plan, batch)
                torch._foreach_add_(grads, list(new))  # type: ignore[arg-type]
            else:
                loss_sum, count, aux = self.micro_acc(plan, grads, batch)
        return LossOutput(loss_sum, count, aux if aux else NO_AUX)


_MISSING: Any = object()


def compile_stats(step: Step) -> CompileStats:
    """The graph and recompile counts of a step built by :func:`compile_step`.

    Args:
        step: a compiled step.

    Returns:
        Its :class:`CompileStats`, updated as the step runs.

    Raises:
        ConfigError: ``step`` was not compiled.

    Example:
        >>> from steplib import make_train_step
        >>> compile_stats(compile_step(make_train_step(lambda m, b: m(b).sum()))).graphs
        0
    """
    runner = step.plan.runner if isinstance(step, Step) else None
    if not isinstance(runner, CompiledRunner):
        raise ConfigError(
            f"compile_stats() needs a step built by compile_step, got {describe(step)}. "
            "Compile it first: step = compile_step(step)."
        )
    return runner.stats

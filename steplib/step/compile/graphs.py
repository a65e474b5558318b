"""The pieces ``compile_step``'s runner compiles: the fused forward/backward of one micro-batch
(its plan: :mod:`steplib.step.compile.fused`), phase 2 with the optimizer update (after the
closing micro-batch or alone), the update without its decorators' graph breaks, the optimizer's
preparation (LR and betas as tensors, widened step counters), and the regions that count the
graphs they compile.

See :mod:`steplib.step.compile.runner` for what runs where and why.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as optim_module

from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.compile.fused import FusedPlan
from steplib.step.loss_output import NO_AUX, parse_loss_output
from steplib.step.parts import GradReport
from steplib.step.phases import process_grads

if TYPE_CHECKING:
    from steplib.step.core import Step


@dataclasses.dataclass
class CompileStats:
    """Counts of graphs compiled for one compiled step (mutable: the backend updates it).

    Attributes:
        graphs: every graph compiled so far (graph breaks give several per function).
        recompiles: graphs compiled for a function of the step that had already run compiled
            code, i.e. because a guard failed (a new shape, dtype, or a Python value a graph
            depended on) rather than for warm-up. Zero in a healthy run.
        updates: optimizer updates made through the compiled step.
        fused_backward: whether micro-batches run as one forward+backward graph (``None`` until
            the first update decided it; ``False``: ``loss_fn`` compiled, backward by autograd).
        why_not_fused: when tracing the fused graph failed, the error (the step then uses
            autograd; e.g. a buffer updated in place inside the forward, as BatchNorm does).
    """

    graphs: int = 0
    recompiles: int = 0
    updates: int = 0
    fused_backward: bool | None = None
    why_not_fused: str | None = None

    @property
    def warm(self) -> bool:
        """Two updates done: the first runs eagerly, the second compiles the graphs."""
        return self.updates >= 2


# --- the traced functions ------------------------------------------------------------------


def _grads_and_loss(plan: FusedPlan, batch: Any) -> tuple[Any, torch.Tensor, Any, dict[str, Any]]:
    counts: list[Any] = []  # a Python number count: the transform's aux takes only tensors

    def loss_of(values: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        swapped = {name: values[i] for name, i in zip(plan.names, plan.slots, strict=True)}
        result = torch.func.functional_call(plan.module, swapped, (batch,), tie_weights=False)
        out = parse_loss_output(result)
        count, aux = out.num_targets, {} if out.aux is NO_AUX else dict(out.aux)
        if isinstance(count, torch.Tensor):
            return out.loss_sum, ((count,), aux)
        counts.append(count)
        return out.loss_sum, ((), aux)

    # no_grad outside, grad_and_value inside: the graph is an inference graph to AOTAutograd
    # (no autograd bookkeeping of its own), and the transform still differentiates.
    with torch.no_grad():
        values = [p.detach() for p in plan.params]
        grads, (loss_sum, (tensor_count, aux)) = torch.func.grad_and_value(loss_of, has_aux=True)(
            values
        )
    return grads, loss_sum, tensor_count[0] if tensor_count else counts[0], aux


def micro_first(plan: FusedPlan, batch: Any) -> tuple[Any, torch.Tensor, Any, dict[str, Any]]:
    return _grads_and_loss(plan, batch)


def micro_acc(
    plan: FusedPlan, accumulated: list[torch.Tensor], batch: Any
) -> tuple[torch.Tensor, Any, dict[str, Any]]:
    grads, loss_sum, count, aux = _grads_and_loss(plan, batch)
    with torch.no_grad():
        torch._foreach_add_(accumulated, list(grads))
    return loss_sum, count, aux


def update(raw_step: Callable[..., Any], optimizer: torch.optim.Optimizer) -> None:
    # The body of the optimizer's step, under the no_grad its decorator would set, without the
    # decorator's graph breaks: one graph.
    with torch.no_grad():
        raw_step(optimizer)


def hooked_update(optimizer: torch.optim.Optimizer) -> None:
    # The class's step (with its step hooks), not the instance attribute an LR scheduler
    # installs, which dynamo refuses to trace.
    type(optimizer).step(optimizer)


def process_and_update(
    step: Step, state: TrainState, raw_step: Callable[..., Any], window: Any = None
) -> tuple[GradReport, bool]:
    # The update runs in the graph unless it may be skipped (a skip flag exists, or the window
    # holds the int count 0: known when the graph is traced, so the branch is not in the graph).
    with torch.no_grad():
        report = process_grads(step, state, window=window)
        if report.nonfinite is None and report.num_targets > 0:
            raw_step(state.optimizer)
            return report, True
    return report, False


def micro_and_update(
    plan: FusedPlan,
    batch: Any,
    step: Step,
    state: TrainState,
    raw_step: Callable[..., Any],
) -> tuple[tuple[torch.Tensor, Any, Any], GradReport, bool]:
    # `state` is the closing call's: its window does not hold this micro-batch yet. The
    # gradients are read here, not passed in: phase 2 reads them again through the optimizer.
    grads: list[torch.Tensor] = [p.grad for p in plan.params]  # type: ignore[misc]
    loss_sum, count, aux = micro_acc(plan, grads, batch)
    window = (state.window.loss + loss_sum, state.window.targets + count)
    return ((loss_sum, count, aux), *process_and_update(step, state, raw_step, window))


# --- the optimizer -------------------------------------------------------------------------


def plain_step(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's step has no hooks to run and is not differentiable."""
    return not (
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(optim_module, "_global_optimizer_pre_hooks", None)
        or getattr(optim_module, "_global_optimizer_post_hooks", None)
        or optimizer.defaults.get("differentiable", False)
    )


def _widens_counters(group: Mapping[str, Any]) -> bool:
    # fused / capturable optimizers keep float32 counters on the device by design.
    return not (group.get("fused") or group.get("capturable"))


def needs_prepare(optimizer: torch.optim.Optimizer) -> bool:
    for group in optimizer.param_groups:  # each: one added since (add_param_group) too
        if not isinstance(group["lr"], torch.Tensor):
            return True
        if not _widens_counters(group) or not group["params"]:
            continue
        if _is_adam(optimizer) and not isinstance(group["betas"][0], torch.Tensor):
            return True  # e.g. OneCycleLR wrote beta1 back as a float
        step = optimizer.state.get(group["params"][0], {}).get("step")
        if isinstance(step, torch.Tensor) and step.dtype == torch.float32:
            return True
    return False


def prepare(optimizer: torch.optim.Optimizer) -> None:
    """What a scheduler changes as float64 tensors (the LR; Adam's betas), so that a new value
    is a new input, not a recompile; float32 CPU step counters widened to float64 (see the
    module doc)."""
    adam = _is_adam(optimizer)
    for group in optimizer.param_groups:
        group["lr"] = _float64(group["lr"], group)
        if not _widens_counters(group):
            continue
        if adam:
            # OneCycleLR cycles beta1 with the LR: as a Python float every new value would
            # recompile the update (dynamo specialises it).
            group["betas"] = tuple(_float64(beta, group) for beta in group["betas"])
            if group.get("foreach"):
                # Adam's foreach update refuses a tensor LR unless capturable; torch's own
                # default picks the single-tensor one for a tensor LR, and so does this.
                group["foreach"] = False
        for p in group["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            if (
                isinstance(step, torch.Tensor)
                and step.dtype == torch.float32
                and step.device.type == "cpu"
                and step.ndim == 0
            ):
                state["step"] = step.to(torch.float64)  # type: ignore[index]


def _is_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam)  # AdamW too


def _float64(value: float | torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    # 0-dim, on the parameters' device (schedulers fill it in place), and float64: the exact
    # value eager code gets from a Python float. A float32 LR differs by ~5e-8 relative, which
    # Adam amplifies near eps into visible divergence. Except for a fused optimizer on CUDA:
    # its kernels read a float32 LR tensor (a float64 one fails, as an H100 run showed), and
    # eager code hands them a float32 value too (device_skips makes the same choice).
    device = group["params"][0].device
    fused_cuda = bool(group.get("fused")) and device.type == "cuda"
    return torch.tensor(value, dtype=torch.float32 if fused_cuda else torch.float64, device=device)


# --- guards and counting -------------------------------------------------------------------

# Globals of torch and steplib, as dynamo names them when it guards on them: torch's modules
# (``G['__import_torch_dot_...']``, ``__import__('torch')``), steplib's, the builtins, and the
# globals of the steplib module a graph starts in (``G['Step']``, ``G['torch']``, ...).
_OWN_GLOBAL = re.compile(
    r"^(?:dict\()?(?:G\['(?:__import_(?:torch|steplib)(?:_dot_\w*)?|__builtins_dict___\d+|"
    r"(?!__import_|___)\w+)'\]|__import__\('torch'\))"
)


def keep_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guard filter for the graphs that start in steplib's code: drop the guards on
    torch's and steplib's own functions and constants (one lookup each, on every call; their
    cost is in docs/performance.md), which do not change while a process trains. Every guard on
    the user's code and globals, the model, the batch, the optimizer and the global
    grad/autocast state is kept."""
    return [not (entry.is_global and _OWN_GLOBAL.match(entry.name)) for entry in entries]


def inner_backend(
    backend: Any, *, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> Any:
    """The backend ``torch.compile(backend=..., mode=..., options=...)`` would use; inductor's
    with its size asserts off unless ``options`` sets them: the generated code checks every
    input's sizes and strides again after dynamo's guards did (measured in
    docs/performance.md)."""
    if mode is not None and options is not None:
        raise ConfigError(
            "compile_step received both mode= and options=; torch.compile takes one of them. "
            "Put the mode's settings into options, or drop options."
        )
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(
            mode, {"size_asserts": False, **(options or {})}, dynamic
        )
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


# torch.compile(isolate_recompiles=...) and its guard filters are recent (torch 2.13 has them,
# 2.11 does not): older releases compile without them (recompiles may then be shared between
# two compiled steps of one function, and steplib's own guards are kept).
_COMPILE_TAKES_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


class Region:
    """One function of the step under ``torch.compile``, counting the graphs it compiles in
    :class:`CompileStats`: a graph compiled after the function has run once is a recompile
    (a guard failed: a new shape, dtype or Python value)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        inner: Any,
        stats: CompileStats,
        kwargs: dict[str, Any],
        *,
        guard_filter: Callable[..., list[bool]] | None,
    ) -> None:
        self.ran = False
        self.stats = stats
        extra: dict[str, Any] = {}
        if _COMPILE_TAKES_ISOLATE:
            # This step's graphs neither count against nor reuse another compiled step's
            # entries for the same function (several steps in one process).
            extra["isolate_recompiles"] = True
        if guard_filter is not None and _COMPILE_TAKES_ISOLATE:  # same release as guard filters
            extra["options"] = {"guard_filter_fn": guard_filter}
        self.fn = torch.compile(fn, backend=_CountingBackend(inner, self), **extra, **kwargs)
        self.copies_outputs = uses_cuda_graphs(inner)

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        self.ran = True
        if self.copies_outputs:
            # A CUDA graph's outputs live in its memory pool and are overwritten when a graph
            # of the pool runs again (each no_grad call starts a new generation). The step
            # keeps them past that: the gradients as p.grad, the loss and the report in the
            # output the handlers read later. Copies keep them; without, the next graph read
            # freed memory (a segfault on an H100, see docs/performance.md).
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)
        return out


def uses_cuda_graphs(backend: Any) -> bool:
    """Whether inductor will run the compiled graphs as CUDA graphs (``mode="reduce-overhead"``
    or ``options={"triton.cudagraphs": True}``)."""
    config = getattr(backend, "config", None)
    return isinstance(config, dict) and bool(config.get("triton.cudagraphs"))


def without_cuda_graphs(backend: Any) -> Any:
    """``backend`` itself, or, if it runs CUDA graphs, inductor's with the same settings and
    CUDA graphs off."""
    if not uses_cuda_graphs(backend):
        return backend
    settings = {**backend.config, "triton.cudagraphs": False}
    return torch._TorchCompileInductorWrapper(None, settings, backend.dynamic)


class _CountingBackend:
    """The dynamo backend of one :class:`Region`: counts, then compiles with the real one."""

    def __init__(self, inner: Any, region: Region) -> None:
        self.inner = inner
        self.region = region
        self.compiled: set[tuple[Any, ...] | None] = set()
        self.__name__ = "steplib_counting"

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # Dynamo may throw a finished trace away and trace the same frame again (a "restart":
        # e.g. once per process, to settle how a float64 learning-rate tensor is passed); the
        # second graph replaces the first, so one compile id counts once.
        compile_id = torch._guards.CompileContext.current_compile_id()
        key = None if compile_id is None else (compile_id.frame_id, compile_id.frame_compile_id)
        if key is None or key not in self.compiled:
            self.compiled.add(key)
            stats = self.region.stats
            stats.graphs += 1
            if self.region.ran:
                stats.recompiles += 1
        return self.inner(graph, example_inputs)

    def __getattr__(self, name: str) -> Any:
        # e.g. get_compiler_config, which dynamo asks the inductor wrapper for
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

"""``compile_step``: the step's forward, backward, clipping and optimizer update under
``torch.compile``.

What runs as a graph once the step is warm (three graphs in all, no graph break):

* **each micro-batch: forward + backward + accumulation, one graph.** The user's
  ``loss_fn(model, batch)`` is differentiated with ``torch.func.grad_and_value`` over
  ``torch.func.functional_call`` (the parameters are swapped in as plain tensors), so dynamo
  traces the backward pass instead of breaking the graph at ``loss.backward()``, and no
  autograd graph is built at run time. The first micro-batch of a window returns the gradients
  (they become ``p.grad``); the others add into ``p.grad`` inside their graph. On a small model
  this is what pays: the eager autograd engine, a compiled forward with an AOTAutograd backward
  and compiled autograd all cost more per micro-batch than this one graph.
* **phase 2 and the optimizer update, one graph**: ``Step.process_grads`` itself (one code
  path: the eager step's function, compiled) followed by the body of the optimizer's ``step``
  without the ``torch._dynamo.graph_break()`` calls its decorator adds. Phase 3 then only
  records the update. When something must happen between the two (``skip_nonfinite`` decides
  whether to step, a ``tap(before_update=...)``, optimizer step hooks, a shorter last window,
  distributed gradients or loss scaling), they are compiled apart or phase 2 runs eagerly.
* The learning rate is a float64 0-dim tensor in the param groups. The scheduler stays plain
  Python (once per update, it writes the new rate into that tensor), so a changing rate never
  recompiles; a ``LambdaLR`` lambda cannot be traced without specialising on the step number.

The first update of an optimizer runs eagerly (autograd, and the optimizer's lazy state
creation): it is cheaper than compiling a path that runs once, and it shows which parameters
receive gradients. The fused forward/backward is used when every parameter of the optimizer
received one, the gradients are local (no ``ddp_wrap`` / ``fsdp_wrap`` / ``detect_anomaly``:
they work in autograd hooks), there is no autocast or loss scaling and no ``tap`` around
backward; and if its first trace fails (a buffer updated in place inside the forward, as
BatchNorm's running statistics are, is refused by the transform) the step says why in
:class:`CompileStats` and uses autograd. The autograd path compiles ``loss_fn`` alone
(AOTAutograd compiles the backward).

Numerics: after the first update, Adam-style step counters become float64 CPU tensors. Eager
code reads a counter with ``.item()`` and computes the bias corrections ``1 - beta ** step`` in
double precision; compiled code computes them from the tensor, so a float32 counter moves AdamW
away from eager by ~1e-6 over 200 updates (4e-7 even for float64 parameters). Dynamo guards a
float64 CPU scalar with a NaN check that reads it (``.item()`` on a CPU tensor: no device sync).

Overhead: on a small model most of a compiled call is dynamo's entry and guard checks. The guards
on torch's and steplib's own functions and constants are dropped (:func:`_keep_guards`); every
guard on the user's code, model, batch and optimizer is kept.

Every graph compiled is counted in :class:`CompileStats`; a graph compiled for a function that
already ran compiled code is a recompile (a guard failed: a new shape, dtype, or a Python value
the graph depended on).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.core import LOCAL, GradReport, Step, _scaler_active, add_wrapper
from steplib.step.loss_output import _NO_AUX, LossOutput, parse_loss_output


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


def compile_step(step: Step, **compile_kwargs: Any) -> Step:
    """Compile the step's forward/backward, gradient processing and optimizer update.

    Apply it last: the wrappers' settings are captured when it is applied. The first update
    runs eagerly and the second compiles (seconds on a CPU); ``step.compile_stats`` counts
    graphs and recompiles.

    Args:
        step: the step to compile.
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``dynamic``, ``fullgraph``,
            ``options``, ``backend`` — a backend name or callable; the default is inductor).

    Returns:
        The compiled step. Numerically it matches the eager one within floating-point
        reordering: ~1e-8 per update in float32, ~1e-17 in float64 (tested: 1e-5 and 1e-12
        after 200 AdamW updates). Two things amplify that difference over many updates, in any
        two implementations that round differently: a ReLU gate that a rounding difference
        flips, and Adam on a parameter whose true gradient is zero (a bias before BatchNorm,
        an attention key bias), whose rounding noise it normalises into lr-sized steps.
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
        >>> step.compile_stats.graphs
        0
    """
    allowed = {"mode", "dynamic", "fullgraph", "backend", "options"}
    unknown = sorted(set(compile_kwargs) - allowed)
    if unknown:
        raise ConfigError(
            f"compile_step received {unknown}, which torch.compile does not take here. Use "
            f"some of: {sorted(allowed)}, e.g. compile_step(step, mode='max-autotune')."
        )
    stats = CompileStats()
    kwargs = dict(compile_kwargs)
    inner = _inner_backend(
        kwargs.pop("backend", "inductor"),
        mode=kwargs.pop("mode", None),
        options=kwargs.pop("options", None),
        dynamic=kwargs.get("dynamic"),
    )

    def compile_fn(fn: Callable[..., Any], *, ours: bool = True) -> _Region:
        return _Region(fn, inner, stats, kwargs, guard_filter=_keep_guards if ours else None)

    runtime = _Runtime(stats, compile_fn)
    settings = {k: v for k, v in compile_kwargs.items() if k != "options"}
    base = add_wrapper(
        step,
        "compile_step",
        settings,
        optimizer_step=runtime.optimizer_step,
        compile_stats=stats,
    )
    runtime.autograd_step = dataclasses.replace(base, loss_fn=compile_fn(step.loss_fn, ours=False))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Step)}
    return _CompiledStep(**fields, runtime=runtime)


@dataclasses.dataclass(frozen=True, slots=True)
class _CompiledStep(Step):
    """A :class:`Step` whose phases 1 and 2 run the compiled graphs of its ``runtime`` once
    its optimizer has made one (eager) update; phase 3 is the base class's, with the compiled
    ``optimizer_step``."""

    runtime: _Runtime | None = None

    def forward_backward(self, state: TrainState, batch: Any, *, sync: bool) -> LossOutput:
        runtime = self.runtime
        assert runtime is not None
        if state.optimizer not in runtime.prepared:  # the eager first update
            return Step.forward_backward(self, state, batch, sync=sync)
        plan = runtime.plan(self, state)
        if plan is not None:
            if plan.checked:
                return runtime.micro(plan, batch)
            try:
                out = runtime.micro(plan, batch)
            except Exception as error:
                # What the transform cannot trace (a buffer updated in place, as BatchNorm's
                # running statistics are) runs through autograd instead; a genuine error in
                # loss_fn is raised there again.
                runtime.give_up(state.optimizer, error)
            else:
                plan.checked = True
                return out
        assert runtime.autograd_step is not None
        return Step.forward_backward(runtime.autograd_step, state, batch, sync=sync)

    def process_grads(self, state: TrainState) -> GradReport:
        runtime = self.runtime
        assert runtime is not None
        optimizer = state.optimizer
        if (
            optimizer in runtime.prepared
            and self.grad_sync is LOCAL
            and not _scaler_active(self, state)
            # A shorter last window (another Python target count) would compile once more.
            and state.window_size == self.accumulation
        ):
            hooks = self.hooks
            if (
                self.skip is None  # the update is unconditional: phase 3 will step
                and (hooks is None or hooks.before_update is None)
                and _plain_step(optimizer)
            ):
                # Phase 2 and the optimizer update in one graph; phase 3's optimizer_step
                # then only records it.
                if _needs_prepare(optimizer):
                    _prepare(optimizer)
                report: GradReport = runtime.process_and_update(
                    self, state, runtime.raw_step(optimizer)
                )
                runtime.updated = optimizer
                return report
            return runtime.process_grads(self, state)
        return Step.process_grads(self, state)


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so that ``functional_call`` can swap in the
    parameters."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.model = model
        # A plain attribute: a criterion that is an nn.Module must not become a submodule.
        object.__setattr__(self, "loss_fn", loss_fn)

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)  # type: ignore[operator]


@dataclasses.dataclass(eq=False)
class _Plan:
    """What the fused forward/backward graph of one model and optimizer needs."""

    model: nn.Module
    module: _LossModule
    names: tuple[str, ...]  # every name of every parameter (a tied weight has several)
    slots: tuple[int, ...]  # for each name, its parameter's index in ``params``
    params: tuple[torch.Tensor, ...]
    checked: bool = False  # its first micro-batch ran


class _Runtime:
    """The compiled functions of one compiled step and what it learnt about each optimizer.

    Mutable on purpose (like :class:`CompileStats`): it caches per optimizer, never per state,
    and holds its optimizers weakly.
    """

    def __init__(self, stats: CompileStats, compile_fn: Callable[..., Any]) -> None:
        self.stats = stats
        self.autograd_step: Step | None = None
        self.micro_first = compile_fn(_micro_first)
        self.micro_acc = compile_fn(_micro_acc)
        self.process_grads = compile_fn(Step.process_grads)
        self.process_and_update = compile_fn(_process_and_update)
        self.update = compile_fn(_update)
        self.hooked_update = compile_fn(_hooked_update)
        # optimizer -> whether all its parameters had a gradient at its first (eager) update
        self.prepared: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = (
            weakref.WeakKeyDictionary()
        )
        self.plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan | None] = (
            weakref.WeakKeyDictionary()
        )
        self.raw_steps: dict[type, Callable[..., Any]] = {}
        # the optimizer whose update ran inside the phase-2 graph, until phase 3 records it
        self.updated: torch.optim.Optimizer | None = None

    def raw_step(self, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
        """The optimizer class's ``step`` body, without its decorators."""
        raw = self.raw_steps.get(type(optimizer))
        if raw is None:
            raw = self.raw_steps[type(optimizer)] = inspect.unwrap(type(optimizer).step)
        return raw

    def plan(self, step: Step, state: TrainState) -> _Plan | None:
        """The fused forward/backward plan for ``state``, or ``None`` where autograd must run."""
        optimizer = state.optimizer
        plan = self.plans.get(optimizer, _MISSING)
        if plan is not _MISSING and (plan is None or plan.model is state.model):
            return plan
        plan = None
        hooks = step.hooks
        if (
            self.prepared[optimizer]
            and step.grad_sync is LOCAL  # DDP/FSDP reduce in autograd hooks
            and step.amp is None
            and not _scaler_active(step, state)
            and (hooks is None or (hooks.before_backward is None and hooks.after_backward is None))
        ):
            plan = _make_plan(state.model, optimizer, step.loss_fn)
        self.plans[optimizer] = plan
        self.stats.fused_backward = plan is not None
        return plan

    def give_up(self, optimizer: torch.optim.Optimizer, error: Exception) -> None:
        """Use autograd for this optimizer's model from now on, and say why."""
        self.plans[optimizer] = None
        self.stats.fused_backward = False
        self.stats.why_not_fused = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"

    def micro(self, plan: _Plan, batch: Any) -> LossOutput:
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
                grads = [p.grad for p in params]
            loss_sum, count, aux = self.micro_acc(plan, grads, batch)
        return LossOutput(loss_sum, count, aux if aux else _NO_AUX)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Phase 3's optimizer update: eager the first time for this optimizer, then compiled."""
        if self.updated is optimizer:  # done by the phase-2 graph
            self.updated = None
            optimizer._opt_called = True  # type: ignore[attr-defined]
        elif optimizer not in self.prepared:
            has_grads = all(p.grad is not None for g in optimizer.param_groups for p in g["params"])
            optimizer.step()  # creates the optimizer's state lazily: not worth a graph
            _prepare(optimizer)
            self.prepared[optimizer] = has_grads
        else:
            if _needs_prepare(optimizer):  # e.g. a state loaded from a checkpoint since
                _prepare(optimizer)
            if _plain_step(optimizer):
                self.update(self.raw_step(optimizer), optimizer)
            else:
                self.hooked_update(optimizer)
            optimizer._opt_called = True  # type: ignore[attr-defined]  # the scheduler checks it
        self.stats.updates += 1


_MISSING: Any = object()


def _make_plan(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], Any]
) -> _Plan | None:
    params: list[torch.Tensor] = []
    slot_of: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in slot_of:
                if not p.requires_grad:
                    return None
                slot_of[id(p)] = len(params)
                params.append(p)
    names: list[str] = []
    slots: list[int] = []
    # Every alias of a tied weight is named, so functional_call needs no untying pass.
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in slot_of:
            names.append("model." + name)
            slots.append(slot_of[id(p)])
    if set(slots) != set(range(len(params))):
        return None  # a parameter of the optimizer that is not the model's
    return _Plan(model, _LossModule(model, loss_fn), tuple(names), tuple(slots), tuple(params))


# --- the traced functions ------------------------------------------------------------------


def _grads_and_loss(plan: _Plan, batch: Any) -> tuple[Any, torch.Tensor, Any, dict[str, Any]]:
    counts: list[Any] = []  # a Python number count: the transform's aux takes only tensors

    def loss_of(values: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        swapped = {name: values[i] for name, i in zip(plan.names, plan.slots, strict=True)}
        result = torch.func.functional_call(plan.module, swapped, (batch,), tie_weights=False)
        out = parse_loss_output(result)
        count, aux = out.num_targets, {} if out.aux is _NO_AUX else dict(out.aux)
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


def _micro_first(plan: _Plan, batch: Any) -> tuple[Any, torch.Tensor, Any, dict[str, Any]]:
    return _grads_and_loss(plan, batch)


def _micro_acc(
    plan: _Plan, accumulated: list[torch.Tensor], batch: Any
) -> tuple[torch.Tensor, Any, dict[str, Any]]:
    grads, loss_sum, count, aux = _grads_and_loss(plan, batch)
    with torch.no_grad():
        torch._foreach_add_(accumulated, list(grads))
    return loss_sum, count, aux


def _update(raw_step: Callable[..., Any], optimizer: torch.optim.Optimizer) -> None:
    # The body of the optimizer's step, under the no_grad its decorator would set, without the
    # decorator's graph breaks: one graph.
    with torch.no_grad():
        raw_step(optimizer)


def _process_and_update(step: Step, state: TrainState, raw_step: Callable[..., Any]) -> GradReport:
    with torch.no_grad():
        report = Step.process_grads(step, state)
        raw_step(state.optimizer)
    return report


def _hooked_update(optimizer: torch.optim.Optimizer) -> None:
    # The class's step (with its step hooks), not the instance attribute an LR scheduler
    # installs, which dynamo refuses to trace.
    type(optimizer).step(optimizer)


# --- the optimizer -------------------------------------------------------------------------


def _plain_step(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's step has no hooks to run and is not differentiable."""
    from torch.optim import optimizer as optim_module

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


def _needs_prepare(optimizer: torch.optim.Optimizer) -> bool:
    group = optimizer.param_groups[0]
    if not isinstance(group["lr"], torch.Tensor):
        return True
    if not _widens_counters(group) or not group["params"]:
        return False
    step = optimizer.state.get(group["params"][0], {}).get("step")
    return isinstance(step, torch.Tensor) and step.dtype == torch.float32


def _prepare(optimizer: torch.optim.Optimizer) -> None:
    """LR as a tensor; float32 CPU step counters widened to float64 (see the module doc)."""
    for group in optimizer.param_groups:
        _lr_as_tensor(group)
        if not _widens_counters(group):
            continue
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


def _lr_as_tensor(group: dict[str, Any]) -> None:
    if not isinstance(group["lr"], torch.Tensor):
        # 0-dim, on the parameters' device (schedulers fill it in place), and float64: the
        # exact value eager code gets from a Python float. A float32 LR differs by ~5e-8
        # relative, which Adam amplifies near eps into visible divergence.
        group["lr"] = torch.tensor(
            group["lr"], dtype=torch.float64, device=group["params"][0].device
        )


# --- guards and counting -------------------------------------------------------------------

# Globals of torch and steplib, as dynamo names them when it guards on them: torch's modules
# (``G['__import_torch_dot_...']``, ``__import__('torch')``), steplib's, the builtins, and the
# globals of the steplib module a graph starts in (``G['Step']``, ``G['torch']``, ...).
_OWN_GLOBAL = re.compile(
    r"^(?:dict\()?(?:G\['(?:__import_(?:torch|steplib)(?:_dot_\w*)?|__builtins_dict___\d+|"
    r"(?!__import_|___)\w+)'\]|__import__\('torch'\))"
)


def _keep_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo's guard filter for the graphs that start in steplib's code: drop the guards on
    torch's and steplib's own functions and constants (one lookup each, every call: ~20% of a
    small step's time), which do not change while a process trains. Every guard on the user's
    code and globals, the model, the batch, the optimizer and the global grad/autocast state is
    kept."""
    return [not (entry.is_global and _OWN_GLOBAL.match(entry.name)) for entry in entries]


def _inner_backend(
    backend: Any, *, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None
) -> Any:
    """The backend ``torch.compile(backend=..., mode=..., options=...)`` would use."""
    if mode is not None and options is not None:
        raise ConfigError(
            "compile_step received both mode= and options=; torch.compile takes one of them. "
            "Put the mode's settings into options, or drop options."
        )
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


class _Region:
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
        # isolate_recompiles: this step's graphs neither count against nor reuse another
        # compiled step's entries for the same function (several steps in one process).
        self.fn = torch.compile(  # type: ignore[call-overload]
            fn,
            backend=_CountingBackend(inner, self),
            isolate_recompiles=True,
            options=None if guard_filter is None else {"guard_filter_fn": guard_filter},
            **kwargs,
        )

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        self.ran = True
        return out


class _CountingBackend:
    """The dynamo backend of one :class:`_Region`: counts, then compiles with the real one."""

    def __init__(self, inner: Any, region: _Region) -> None:
        self.inner = inner
        self.region = region
        self.__name__ = "steplib_counting"

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
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

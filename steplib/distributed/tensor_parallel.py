"""Tensor parallelism: a function on the model, on ``torch.distributed.tensor.parallel`` (DTensor).

``apply_tp(model, plan, mesh=...)`` shards the modules the plan names (``ColwiseParallel``,
``RowwiseParallel``, ...) over a 1-D device mesh. Every rank gets the *same* batch; DTensor
does the communication inside forward and backward, so the step needs no wrapper:
``make_train_step``, ``clip``, ``accumulate`` and ``skip_nonfinite`` work as they are.

Why the rest of the model is replicated (``replicate_rest=True``): a model whose parameters
are partly DTensors and partly plain tensors cannot be clipped (torch's norm refuses a mixed
list) and is checkpointed in two kinds. So each leaf module that the plan leaves alone gets
its parameters replicated as DTensors, with plain tensors converted at its input and output.

Loss parallelism for a sharded vocabulary: give ``loss_parallel="<output projection>"`` so
that the logits stay sharded on the vocabulary (never gathered), and compute the loss with
:func:`parallel_cross_entropy` inside ``loss_fn``.

Composing with FSDP2 on a 2-D mesh (``dp x tp``; not tested here, it needs 4 ranks)::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp(model, plan, mesh=mesh["tp"])   # 1. TP inside each row of the mesh
    for block in model.layers:                       # 2. FSDP2 over the dp dimension
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters())  # 3. after both
    step = fsdp_wrap(clip(make_train_step(loss_fn), max_norm=1.0))

TP first, FSDP second: ``fully_shard`` over ``mesh["dp"]`` makes each TP DTensor a 2-D
DTensor (``Shard(0)`` on dp, the TP placement on tp) and reduce-scatters gradients over dp
only. The TP ranks of one dp group must get the same batch, the dp groups different ones:
a ``DistributedSampler(num_replicas=dp, rank=mesh["dp"].get_local_rank())``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib.errors import ConfigError, describe

_SHOWN = 12  # module names listed in an error before "and N more"


def apply_tp(
    model: nn.Module,
    plan: Mapping[str, Any],
    *,
    mesh: Any,
    loss_parallel: str | None = None,
    replicate_rest: bool = True,
) -> nn.Module:
    """Shard ``model``'s modules over ``mesh`` as ``plan`` says (in place; returns ``model``).

    Args:
        model: the module; its parameters on the mesh's device type (e.g. CPU for gloo).
        plan: ``{module name: ParallelStyle}``, e.g.
            ``{"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}``. Names are
            ``model.named_modules()`` names; a part may be a glob (``"layers.*.mlp.up"``), as
            ``parallelize_module`` matches them.
        mesh: a 1-D ``DeviceMesh`` (``init_device_mesh("cpu", (2,))``, or ``mesh["tp"]`` of
            a 2-D mesh).
        loss_parallel: the name of the output projection (an ``nn.Linear`` over the
            vocabulary, not in ``plan``): it is sharded column-wise and returns its logits as
            a DTensor sharded on the vocabulary, for :func:`parallel_cross_entropy`.
        replicate_rest: replicate every parameter the plan does not shard as a DTensor (see
            the module docstring: without it, ``clip`` fails on a mixed model).

    Returns:
        ``model``, parallelised; build the optimizer from it afterwards.

    Raises:
        ConfigError: the plan names a module that does not exist (the error lists the
            names), a plan value that is not a ``ParallelStyle``, a mesh that is not 1-D,
            a ``loss_parallel`` module that is missing, in the plan, or not an ``nn.Linear``,
            or (with ``replicate_rest``) a non-leaf module holding parameters of its own.

    Example:
        >>> # needs a process group; see tests/test_tensor_parallel.py
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> mesh = init_device_mesh("cpu", (2,))  # doctest: +SKIP
        >>> model = apply_tp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
        ...                  {"0": ColwiseParallel(), "2": RowwiseParallel()},
        ...                  mesh=mesh)  # doctest: +SKIP
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        parallelize_module,
    )

    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"apply_tp(model) received {describe(model)}, which is not a torch.nn.Module. "
            "Pass the module to parallelise."
        )
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) for k in plan):
        raise ConfigError(
            f"apply_tp(model, plan) received plan={describe(plan)}; pass a dict of module "
            "name -> ParallelStyle, e.g. {'up': ColwiseParallel(), 'down': RowwiseParallel()}."
        )
    for name, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ConfigError(
                f"apply_tp: plan[{name!r}] is {describe(style)}, not a ParallelStyle. Use the "
                "styles of torch.distributed.tensor.parallel: ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...)."
            )
        _check_plan_name(model, name)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        shape = f"a {mesh.ndim}-D DeviceMesh" if isinstance(mesh, DeviceMesh) else describe(mesh)
        raise ConfigError(
            f"apply_tp(mesh=...) received {shape}; tensor parallelism needs a 1-D mesh of the "
            "TP ranks. Pass init_device_mesh('cuda', (tp,)) or, on a 2-D mesh, mesh['tp']."
        )
    plan = dict(plan)
    if loss_parallel is not None:
        _check_loss_parallel_module(model, plan, loss_parallel)
        # The logits leave the head sharded on the vocabulary, as a DTensor: the loss is
        # computed on the shards and only two scalars per row are all-reduced.
        plan[loss_parallel] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    if replicate_rest:
        _replicate_rest(model, mesh)
    return model


def parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    reduction: str = "sum",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross entropy of vocabulary-sharded logits, without gathering them (loss parallelism).

    Runs ``F.cross_entropy`` under ``torch.distributed.tensor.parallel.loss_parallel()``
    for the forward *and* for the backward (torch requires both under the context). It is a
    plain function of tensors, so it composes with every wrapper and with the pipeline step:
    the context is entered only around the loss's own operations.

    Args:
        logits: a DTensor sharded on its last dimension (the head built by
            ``apply_tp(..., loss_parallel=name)``), shape ``(..., vocab)``.
        target: class indices, a plain tensor of shape ``logits.shape[:-1]``.
        reduction: ``"sum"`` (pair it with the count of targets in ``loss_fn``: token
            weighting) or ``"mean"``.
        ignore_index: targets with this value do not count.

    Returns:
        The loss as a plain 0-dim tensor (this rank's value; every TP rank holds the same).

    Raises:
        ConfigError: ``logits`` is not a vocabulary-sharded DTensor, or a bad ``reduction``.

    Example:
        Plain (unsharded) logits are refused, with the fix in the message:

        >>> import torch
        >>> logits, target = torch.randn(3, 5), torch.tensor([0, 1, 2])
        >>> parallel_cross_entropy(logits, target)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        steplib.errors.ConfigError: parallel_cross_entropy received logits of type Tensor, ...

        In a ``loss_fn``, on a model built with ``apply_tp(..., loss_parallel="head")`` under
        ``torchrun`` (see ``tests/test_tensor_parallel.py``):

        >>> def loss_fn(model, batch):  # doctest: +SKIP
        ...     inputs, target = batch
        ...     loss_sum = parallel_cross_entropy(model(inputs), target, reduction="sum")
        ...     return loss_sum, (target != -100).sum()
    """
    from torch.distributed.tensor import DTensor, Shard

    if reduction not in ("sum", "mean"):
        raise ConfigError(
            f"parallel_cross_entropy(reduction=...) received {describe(reduction)}; use 'sum' "
            "(and return (loss_sum, num_targets) from loss_fn) or 'mean'."
        )
    last = logits.ndim - 1
    if not isinstance(logits, DTensor) or not any(
        isinstance(p, Shard) and p.dim in (-1, last) for p in logits.placements
    ):
        raise ConfigError(
            f"parallel_cross_entropy received logits of type {type(logits).__name__}"
            + (f" with placements {logits.placements}" if isinstance(logits, DTensor) else "")
            + ", not a DTensor sharded on the vocabulary (last) dimension. Build the model "
            "with apply_tp(model, plan, mesh=mesh, loss_parallel='<output projection name>'), "
            "or use F.cross_entropy for unsharded logits."
        )
    loss: torch.Tensor = _LossParallel.apply(logits, target, reduction, ignore_index)
    return loss


class _LossParallel(torch.autograd.Function):
    """``F.cross_entropy`` under ``loss_parallel()`` in forward and again in backward.

    The forward builds a small inner graph from detached logits and keeps it; the backward
    runs that graph's backward under the context and hands the logits' gradient on. Why not
    a context around the whole step: the step's backward is the step's own (and, in a
    pipeline, the schedule's), so a loss cannot otherwise reach it.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, reduction: str, ignore: int
    ) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad():
            inner = logits.detach().requires_grad_(logits.requires_grad)
            with _Context(loss_parallel()):
                loss = F.cross_entropy(
                    inner.flatten(0, -2), target.flatten(), reduction=reduction, ignore_index=ignore
                )
        ctx.inner, ctx.loss = inner, loss
        return loss.to_local().detach()  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        inner, loss = ctx.inner, ctx.loss
        del ctx.inner, ctx.loss  # the inner graph is used once
        grad = DTensor.from_local(grad, loss.device_mesh, loss.placements, run_check=False)
        with _Context(loss_parallel()):
            torch.autograd.backward(loss, grad)
        return inner.grad, None, None, None


class _Context:
    """Enter a generator context manager and always leave it as on success.

    torch's ``loss_parallel()`` re-disables its custom operators only after a clean ``yield``;
    an exception inside would leave them enabled for every later DTensor cross entropy.
    Exiting with no exception always runs that clean-up; the exception still propagates.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def __enter__(self) -> None:
        self.manager.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self.manager.__exit__(None, None, None)


def _check_plan_name(model: nn.Module, name: str) -> None:
    """Resolve ``name`` part by part with ``fnmatch``, as ``parallelize_module`` does (it
    only warns and skips a name that matches nothing), and refuse a name that matches nothing.
    """
    if name == "":
        return
    level = [("", model)]
    for part in name.split("."):
        level = [
            (f"{prefix}.{child}" if prefix else child, module)
            for prefix, parent in level
            for child, module in parent.named_children()
            if fnmatch.fnmatch(child, part)
        ]
        if not level:
            raise _unknown_module(model, name, part, what="the plan names")


def _unknown_module(model: nn.Module, name: str, part: str, *, what: str) -> ConfigError:
    names = [n for n, _ in model.named_modules() if n]
    more = [f"... and {len(names) - _SHOWN} more"] if len(names) > _SHOWN else []
    return ConfigError(
        f"apply_tp: {what} {name!r}, but {type(model).__name__} has no module matching it "
        f"(nothing matches {part!r}). Its modules are: {names[:_SHOWN] + more}. Use these "
        "names (from model.named_modules()); a part may be a glob, e.g. 'layers.*.mlp.up'."
    )


def _check_loss_parallel_module(model: nn.Module, plan: Mapping[str, Any], name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"apply_tp(loss_parallel=...) received {describe(name)}; pass the name of the "
            "output projection, e.g. loss_parallel='lm_head'."
        )
    if name in plan:
        raise ConfigError(
            f"apply_tp: {name!r} is both in the plan and loss_parallel={name!r}; loss_parallel "
            "sets its style (ColwiseParallel with logits sharded on the vocabulary). Remove "
            f"{name!r} from the plan."
        )
    head = dict(model.named_modules()).get(name)
    if head is None:
        raise _unknown_module(model, name, name, what="loss_parallel names")
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            f"apply_tp(loss_parallel={name!r}) names a {type(head).__name__}; it must be the "
            "nn.Linear that projects onto the vocabulary (the model's last layer)."
        )


def _replicate_rest(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, distribute_module

    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or any(isinstance(p, DTensor) for p in own):
            continue
        if any(True for _ in module.children()):
            raise ConfigError(
                f"apply_tp(replicate_rest=True): {name or 'the model'} "
                f"({type(module).__name__}) holds parameters of its own and also has "
                "sub-modules, so its forward mixes them with the sub-modules' outputs and "
                "cannot be replicated from outside. Give it a plan entry, move the parameters "
                "into a leaf module, or pass replicate_rest=False (then clip cannot be used)."
            )
        # torch types input_fn as returning None; a returned tuple replaces the inputs.
        distribute_module(
            module,
            mesh,
            input_fn=_to_replicated,  # type: ignore[arg-type]
            output_fn=_to_local,
        )


def _to_replicated(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate

    # Every rank holds the same input (a TP group shares its batch): wrapping needs no copy.
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _to_local(module: nn.Module, output: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    # A replicated output goes on as a plain tensor (what the next, planned module expects by
    # default); a sharded one (sequence parallelism) stays a DTensor.
    if isinstance(output, DTensor) and all(isinstance(p, Replicate) for p in output.placements):
        return output.to_local()
    return output

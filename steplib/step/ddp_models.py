"""Which DDP modules a step of ``ddp_wrap`` owns, and their gradient sync when the state holds
several models (a GAN's ``{"G": apply_ddp(g), "D": apply_ddp(d)}``, one step each)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from steplib.errors import ConfigError, listed
from steplib.state import TrainState


def ddp_models(
    state: TrainState,
) -> tuple[list[DistributedDataParallel], list[DistributedDataParallel]]:
    """The DDP module(s) whose parameters this step's optimizer updates: the state's model, or
    (several models, ``model={"G": DDP(g), "D": DDP(d)}``) those holding its optimizer's
    parameters, refusing a trainable one outside every DDP module; and
    the state's other DDP modules (the models the other optimizers update)."""
    model = state.model
    if isinstance(model, DistributedDataParallel):
        return [model], []
    # The parameters this step's optimizer updates now (a student's beside a frozen teacher).
    params = {id(p) for p in _optimized(state.optimizer)}
    wrapped = [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
    found = [m for m in wrapped if any(id(p) in params for p in m.parameters())]
    if found:
        _refuse_unwrapped(model, params, found)
        return found, [m for m in wrapped if all(m is not f for f in found)]
    raise ConfigError(
        f"ddp_wrap: the state's model is a {type(model).__name__}, not a "
        "DistributedDataParallel module (nor a dict holding the one this step's optimizer "
        "updates), so gradients would never be synchronised. Wrap it before creating the "
        "state: model = steplib.distributed.apply_ddp(model) (or DistributedDataParallel(model)), "
        "then TrainState.create(model=model, ...); with several models, wrap each: "
        "model={'G': apply_ddp(g), 'D': apply_ddp(d)}."
    )


def _optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _refuse_unwrapped(
    model: nn.Module, params: set[int], found: list[DistributedDataParallel]
) -> None:
    """Refuse trainable parameters of this step outside every DDP module: nothing would
    average their gradients, so each rank would apply its own and the ranks would drift
    apart, in silence."""
    covered = {id(p) for m in found for p in m.parameters()}
    outside = [
        name
        for name, p in model.named_parameters()
        if id(p) in params and id(p) not in covered and p.requires_grad
    ]
    if outside:
        key = outside[0].split(".")[0]
        names = listed([repr(name) for name in outside], shown=5)
        raise ConfigError(
            f"ddp_wrap: this step's optimizer updates {len(outside)} parameter(s) outside "
            f"every DistributedDataParallel module ({names}): nothing averages their "
            "gradients over the ranks, so each rank would apply its own and the ranks would "
            f"drift apart. Wrap that model too: model={{..., {key!r}: apply_ddp({key})}}, "
            "or freeze those parameters (requires_grad_(False))."
        )


def check_synced(models: list[DistributedDataParallel]) -> None:
    """Refuse parameters unfrozen since their DDP module was built: its reducer synchronises
    the parameters that took gradients then, alone, so each rank would apply its own gradient
    for the others and the ranks would drift apart, in silence."""
    for model in models:
        # DDP keeps no public record of what it synchronises; its logging data counts it.
        logged: dict[str, Any] = getattr(model, "_get_ddp_logging_data", dict)()
        built = logged.get("num_parameter_tensors")
        ignored = model.parameters_to_ignore
        now = [
            n for n, p in model.module.named_parameters() if p.requires_grad and n not in ignored
        ]
        if isinstance(built, int) and len(now) > built:
            raise ConfigError(
                f"ddp_wrap: the DistributedDataParallel module ({type(model.module).__name__}) "
                f"has {len(now)} parameters that take gradients, {built} when it was built: DDP "
                "synchronises those alone, so each rank would apply its own gradient for the "
                "ones unfrozen since, and the ranks would drift apart. Build it with every "
                "parameter trainable, then freeze: apply_ddp(model, find_unused_parameters=True),"
                " then body.requires_grad_(False) (DDP then synchronises each one from its "
                "unfreeze on); or wrap the model in DDP again after the unfreeze."
            )


def average_grads(models: list[DistributedDataParallel]) -> None:
    """Average these models' gradients over the ranks by hand, as DDP's reducer would have
    (every parameter, so every rank sends the same layout)."""
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)  # type: ignore[union-attr]


@contextlib.contextmanager
def several_models(
    mine: list[DistributedDataParallel], others: list[DistributedDataParallel], sync: bool
) -> Iterator[None]:
    """A micro-batch of one of several steps (a GAN's D and G, each model under DDP).

    DDP decides at a forward whether the model's next backward all-reduces (a forward with
    sync on arms its reducer; only that backward disarms it). So the other steps' models run
    under ``no_sync`` always: this backward never reaches their parameters
    (``backward(inputs=...)``), and D armed by G's loss would all-reduce D's next micro-batch
    that ``no_sync`` should keep local (one all-reduce more per micro-batch, and rounded
    otherwise than after a resume at a window boundary, whose fresh reducer is not armed).

    A model of this step whose forward ran in an earlier step (``feed``: G's ``fake`` made in
    D's loss) was therefore never armed: at the window's last micro-batch its gradients are
    averaged by hand after the backward, once, and its buffers taken from rank 0, which DDP
    would have done at its next forward (``broadcast_buffers``).
    """
    with contextlib.ExitStack() as stack:
        for model in others if sync else [*mine, *others]:
            stack.enter_context(model.no_sync())
        if not sync:
            yield
            return
        armed: list[nn.Module] = []
        hooks = [model.register_forward_pre_hook(functools.partial(_arms, armed)) for model in mine]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        fed = [  # reached by this backward through a graph made elsewhere, never armed
            model
            for model in mine
            if all(model is not seen for seen in armed)
            and any(p.grad is not None for p in model.parameters())
        ]
        if fed:
            average_grads(fed)
            for model in fed:
                if model.broadcast_buffers:  # BatchNorm's running statistics, say
                    for buffer in model.module.buffers():
                        dist.broadcast(buffer, src=0)


def _arms(armed: list[nn.Module], model: nn.Module, args: Any) -> None:
    # DDP's own condition for preparing its reducer for the backward (sync is on here).
    if torch.is_grad_enabled():
        armed.append(model)

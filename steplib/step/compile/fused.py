"""The fused forward/backward's plan for one model and optimizer: which parameters it
differentiates (by name, for ``torch.func.functional_call``), and whether it still gives them
what autograd would (see :mod:`steplib.step.compile.runner`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class LossModule(nn.Module):
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
class FusedPlan:
    """What the fused forward/backward graph of one model and optimizer needs."""

    model: nn.Module
    module: LossModule
    names: tuple[str, ...]  # every name of every parameter (a tied weight has several)
    slots: tuple[int, ...]  # for each name, its parameter's index in ``params``
    params: tuple[torch.Tensor, ...]
    members: tuple[torch.Tensor, ...]  # the optimizer's parameters, group by group, when made
    checked: bool = False  # its first micro-batch ran

    def fits(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Whether it still differentiates what autograd would: the optimizer's parameters (by
        identity: ``==`` compares values), none frozen or given a gradient hook since."""
        members = [p for group in optimizer.param_groups for p in group["params"]]
        return (
            self.model is model
            and len(members) == len(self.members)
            and all(a is b for a, b in zip(members, self.members, strict=True))
            and all(map(autograd_would_match, self.params))
        )


def autograd_would_match(p: torch.Tensor) -> bool:
    # A gradient hook (a mask, a post-accumulate hook) runs under autograd only (read only).
    return p.requires_grad and not p._backward_hooks and not p._post_accumulate_grad_hooks


def make_fused_plan(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[nn.Module, Any], Any]
) -> FusedPlan | None:
    params: list[torch.Tensor] = []
    members: list[torch.Tensor] = []
    slot_of: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            members.append(p)
            if id(p) not in slot_of:
                if not autograd_would_match(p):
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
    return FusedPlan(
        model, LossModule(model, loss_fn), tuple(names), tuple(slots), tuple(params), tuple(members)
    )

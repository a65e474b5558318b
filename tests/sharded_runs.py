"""Training runs for the sharded-checkpoint tests, run on every rank by ``run_ranks``.

A run is built from its kind ("ddp" or "fsdp") and a seed alone: dropout (per-rank RNG), a
shuffling ``resumable_loader`` over this rank's share of the data (per-rank data position),
AdamW with a step schedule, clipping and accumulation, so that an exact resume has to restore
every piece of the state on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from steplib import (
    Events,
    Step,
    TrainState,
    accumulate,
    clip,
    ddp_wrap,
    fsdp_wrap,
    make_train_step,
    run,
)
from steplib.data import ResumableLoader, resumable_loader
from steplib.distributed import apply_ddp, apply_fsdp

UPDATES = 6  # 2 micro-batches each: 12 batches, 2 epochs of 6 per rank
SAVE_AT = 3


def model(seed: int = 0) -> nn.Module:
    # No Flatten at the end: FSDP2 warns when a sharded module returns a view.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))


def loss_fn(net: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((net(x) - y) ** 2).mean()


def plain_step() -> Step:
    """The composition every run trains with, before the distribution wrapper."""
    return clip(accumulate(make_train_step(loss_fn), 2), max_norm=1.0)


def build(kind: str, rank: int, *, seed: int = 0) -> tuple[TrainState, Step, ResumableLoader]:
    """A fresh run on this rank: same initial weights on every rank (for ``seed``), this
    rank's data, the RNG seeded per rank."""
    net = model(seed)
    net = apply_ddp(net) if kind == "ddp" else apply_fsdp(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = TrainState.create(
        model=net,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )
    wrap = ddp_wrap if kind == "ddp" else fsdp_wrap
    gen = torch.Generator().manual_seed(10 + rank)
    data = TensorDataset(torch.randn(24, 8, generator=gen), torch.randn(24, 3, generator=gen))
    torch.manual_seed(100 + rank)  # dropout differs per rank, as in real runs
    return state, wrap(plain_step()), resumable_loader(data, batch_size=4, seed=rank, shard=False)


def train(
    state: TrainState, step: Step, loader: Any, *, events: Events | None = None
) -> tuple[TrainState, list[torch.Tensor]]:
    """Run to ``UPDATES``; return the state and the loss of every update."""
    events = events or Events()
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss.detach().clone()))
    state = run(step, state, loader, events=events, max_steps=UPDATES)
    return state, losses


def local(tensor: Any) -> Any:
    """This rank's part of a (D)Tensor, copied."""
    if isinstance(tensor, DTensor):
        return tensor.to_local().detach().clone()
    return tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor


def contents(state: TrainState) -> dict[str, Any]:
    """What an exact resume must restore on this rank: its shard of the parameters and of the
    optimizer state, the scheduler, the counters and the RNG."""
    optimizer = state.optimizer
    return {
        "params": [local(p) for p in state.model.parameters()],
        "optimizer": [
            {k: local(v) for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups
            for p in group["params"]
        ],
        "lr": [float(g["lr"]) for g in optimizer.param_groups],
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "counters": [state.step, state.micro_step, state.epoch, state.window.size],
        "rng": torch.get_rng_state(),
    }


def full(state: TrainState) -> dict[str, Any]:
    """The whole parameters and AdamW moments (a collective for FSDP2: call on every rank),
    in parameter order, to compare with a plain module."""

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().detach().clone() if isinstance(t, DTensor) else local(t)

    optimizer = state.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "params": [whole(p) for p in params],
        "exp_avg": [whole(optimizer.state[p]["exp_avg"]) for p in params],
        "exp_avg_sq": [whole(optimizer.state[p]["exp_avg_sq"]) for p in params],
        "step": [local(optimizer.state[p]["step"]) for p in params],
    }

"""Data-parallel training with steplib, launched by torchrun (CPU/gloo here, GPUs/nccl alike).

    torchrun --nproc_per_node=2 examples/ddp_train.py --steps 20 --checkpoints runs/ddp/ckpt

What changes from a single-process script: ``init_distributed()``, ``apply_ddp(model)``, a
``DistributedSampler`` so each rank sees its own shard, and ``ddp_wrap(step)``. The step, the
loop and the handlers are the same; a checkpoint of a DDP state is the ranks' sharded one, which
every rank saves together. The end is ``shutdown()`` on every rank: it waits for the others
before tearing the process groups down, so that a finished job exits 0.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import steplib
from steplib.distributed import apply_ddp, init_distributed, is_main, shard_check, shutdown


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoints", default=None, help="save every 5 updates into it")
    args = parser.parse_args(argv)

    env = init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    data = TensorDataset(torch.randn(512, 20), torch.randint(0, 4, (512,)))
    shard_check(len(data), world_size=env.world_size)  # refuse silently repeated samples
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=env.world_size, rank=env.rank, seed=0
    )
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = apply_ddp(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    state = steplib.TrainState.create(model=model, optimizer=optimizer)
    step = steplib.make_train_step(loss_fn)
    step = steplib.clip(steplib.accumulate(step, args.accumulate), max_norm=1.0)
    step = steplib.ddp_wrap(step)  # last: it checks every rank built the same composition

    events = steplib.Events()
    losses: list[float] = []
    events.on("step_end", lambda e: losses.append(float(e.output.loss)), every=5)
    if is_main():
        events.on("step_end", lambda e: print(f"step {e.step} loss {losses[-1]:.4f}"), every=5)
    if args.checkpoints is not None:  # every rank: a DDP state's checkpoint is a collective
        steplib.checkpoint_every(args.checkpoints, every=5, keep_last=2).attach(events)
    state = steplib.run(step, state, loader, events=events, max_steps=args.steps)
    final = losses[-1]
    del model, state, step, optimizer, events  # free the DDP reducer before the process group
    shutdown()  # every rank: a barrier, then every process group destroyed
    return final


if __name__ == "__main__":
    main()

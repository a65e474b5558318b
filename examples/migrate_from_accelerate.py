"""A Hugging Face Accelerate training loop, rewritten with steplib.

The Accelerate original is in ``docs/migration/accelerate.md``, side by side with this script.
``Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")`` and the
``with accelerator.accumulate(model):`` block become ``accumulate(step, 4)`` and
``amp_wrap(step)``; ``accelerator.clip_grad_norm_`` under ``sync_gradients`` becomes
``clip(step, max_norm=1.0)``; ``accelerator.prepare`` becomes ``apply_ddp`` + ``ddp_wrap``
(only when launched on several processes); ``save_state`` / ``load_state`` become
``checkpoint_every`` / ``resume_from``; ``accelerator.log`` becomes ``Log`` into a logger.

    python examples/migrate_from_accelerate.py                 # one process
    torchrun --nproc_per_node=2 examples/migrate_from_accelerate.py   # was: accelerate launch
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from steplib import (
    Events,
    JsonlLogger,
    TrainMetrics,
    TrainState,
    accumulate,
    amp_wrap,
    checkpoint_every,
    clip,
    ddp_wrap,
    make_train_step,
    resume_from,
    run,
    warmup_cosine,
)
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp, init_distributed, is_main, shutdown
from steplib.handlers import Log

Batch = tuple[torch.Tensor, torch.Tensor]


def regression_data(n: int, *, seed: int) -> TensorDataset:
    """y = a fixed random linear map of x through a tanh, plus a little noise."""
    weights = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    return TensorDataset(x, torch.tanh(x @ weights) + 0.05 * torch.randn(n, 4, generator=gen))


# The body of `with accelerator.accumulate(model):` up to accelerator.backward(loss).
def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/migrate_from_accelerate")
    parser.add_argument("--max-steps", type=int, default=60)
    args = parser.parse_args(argv)

    # Accelerator() reads the launcher's environment; so does init_distributed (a no-op in a
    # single process). Nothing global is created: there is no AcceleratorState to reset.
    env = init_distributed()
    torch.manual_seed(0)  # accelerate.utils.set_seed(0)
    dataset = regression_data(1024, seed=1)
    # accelerator.prepare(train_loader): on several processes each reads its own share of
    # every epoch (shard=True); its position and shuffle order go into the checkpoint, so a
    # run resumed inside an epoch (one process or several) reads on where it stopped.
    loader = resumable_loader(dataset, batch_size=16, seed=0, shard=True)

    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    if env.world_size > 1:
        model = apply_ddp(model)  # accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The scheduler steps once per *update*. (A prepared scheduler in Accelerate skips the
    # micro-batches but steps num_processes times per update unless split_batches=True: a
    # known pitfall.)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup=5, total=args.max_steps)
    )
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)

    # Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16") and, inside the loop,
    # `if accelerator.sync_gradients: accelerator.clip_grad_norm_(params, 1.0)`.
    step = make_train_step(loss_fn)
    step = accumulate(step, 4)
    step = clip(step, max_norm=1.0)
    step = amp_wrap(step, dtype=torch.bfloat16)
    if env.world_size > 1:
        step = ddp_wrap(step)  # no all-reduce until the 4th micro-batch (accumulate's no_sync)

    checkpoints = f"{args.out}/checkpoints"
    events = Events()
    # accelerator.load_state(latest) when resuming
    events.on("fit_start", resume_from(checkpoints, data=loader))
    # accelerator.save_state(f"step_{n}") every 20 updates; keep the newest 2
    checkpoint_every(checkpoints, every=20, keep_last=2, data=loader).attach(events)
    train_metrics = TrainMetrics()
    train_metrics.attach(events)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    # accelerator.print(...) prints on the main process only
    if is_main():
        events.on("step_end", lambda e: print(f"update {e.step}: {e.output.loss:.4f}"), every=20)
    # Accelerator(log_with=...) + accelerator.log({"train_loss": ...}, step=n) every 10 updates
    with JsonlLogger(f"{args.out}/metrics.jsonl") as log:
        events.on("step_end", Log(log, sources=[train_metrics.read]), every=10)
        state = run(step, state, loader, events=events, max_steps=args.max_steps)

    result = {"steps": state.step, "world_size": env.world_size, **first_and_last(losses)}
    del model, optimizer, scheduler, state, step  # free a DDP reducer before the group
    shutdown()  # accelerator.end_training() / destroy_process_group()
    return result


def first_and_last(losses: list[torch.Tensor], n: int = 5) -> dict[str, float | None]:
    """Mean training loss of the first and the last ``n`` updates of this run (one host read;
    ``None`` when a resumed run had nothing left to do)."""
    if not losses:
        return {"first_loss": None, "last_loss": None}
    values = torch.stack(losses).tolist()
    head, tail = values[:n], values[-n:]
    return {"first_loss": sum(head) / len(head), "last_loss": sum(tail) / len(tail)}


if __name__ == "__main__":
    print(main())

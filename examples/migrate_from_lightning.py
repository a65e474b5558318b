"""A Lightning ``LightningModule`` + ``Trainer`` run, rewritten with steplib.

The Lightning original is in ``docs/migration/lightning.md``, side by side with this script.
Each Trainer flag and callback becomes one line below: ``accumulate_grad_batches`` ->
``accumulate``, ``gradient_clip_val`` -> ``clip``, ``precision="bf16-mixed"`` -> ``amp_wrap``,
``validation_step`` + ``val_check_interval`` -> ``Evaluator``, ``ModelCheckpoint`` ->
``checkpoint_every``, ``EarlyStopping`` -> ``steplib.EarlyStopping``, ``self.log`` ->
``TrainMetrics`` + ``Log`` into a ``CSVLogger``, ``ckpt_path="last"`` -> ``resume_from``.

    python examples/migrate_from_lightning.py --out runs/migrate_from_lightning
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steplib import (
    CSVLogger,
    EarlyStopping,
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    accumulate,
    amp_wrap,
    checkpoint_every,
    clip,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
    warmup_cosine,
)
from steplib.data import resumable_loader
from steplib.handlers import Log

Batch = tuple[torch.Tensor, torch.Tensor]
CLASSES = 4


def blobs(n: int, *, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 16 dimensions (the same centres for every split)."""
    centres = torch.randn(CLASSES, 16, generator=torch.Generator().manual_seed(0)) * 1.5
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    return TensorDataset(centres[y] + torch.randn(n, 16, generator=gen), y)


# LightningModule.training_step -> a loss function of (model, batch).
def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# LightningModule.validation_step + self.log("val_...") -> what the metrics' update() takes.
def eval_fn(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    x, y = batch
    logits = model(x)
    return {"value": F.cross_entropy(logits, y, reduction="none"), "preds": logits, "target": y}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/migrate_from_lightning")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # seed_everything(0)
    train_loader = resumable_loader(blobs(2048, seed=1), batch_size=32, seed=0)
    val_loader = DataLoader(blobs(512, seed=2), batch_size=256)

    # __init__ and configure_optimizers: the model, the optimizer and a per-update schedule
    # (Lightning's "interval": "step").
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = warmup_cosine(warmup=10, total=args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)

    # Trainer(accumulate_grad_batches=2, gradient_clip_val=1.0, precision="bf16-mixed")
    step = make_train_step(loss_fn)
    step = accumulate(step, 2)
    step = clip(step, max_norm=1.0)
    step = amp_wrap(step, dtype=torch.bfloat16)

    events = Events()
    # trainer.fit(..., ckpt_path="last"): continue from the newest checkpoint, if any. First,
    # so that the handlers after it see the resumed state.
    checkpoints = f"{args.out}/checkpoints"
    events.on("fit_start", resume_from(checkpoints, data=train_loader))
    train_metrics = TrainMetrics()  # self.log("train_loss", loss): a mean kept on the device
    train_metrics.attach(events)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    with CSVLogger(f"{args.out}/metrics.csv") as csv:  # CSVLogger(save_dir=...)
        # val_check_interval=25 (counted in updates here, in batches in Lightning)
        evaluator = Evaluator(
            make_eval_step(eval_fn, autocast_dtype=torch.bfloat16),
            val_loader,
            metrics={
                "loss": torchmetrics.MeanMetric(),
                "acc": torchmetrics.classification.MulticlassAccuracy(
                    num_classes=CLASSES,
                    average="micro",  # correct / total, as before
                ),
            },
            every=25,
            at_fit_end=True,
            monitor="val_loss",
            sinks=[csv],
        )
        evaluator.attach(events)
        # EarlyStopping(monitor="val_loss", patience=3): after the evaluator, same interval.
        events.on("step_end", EarlyStopping("val_loss", patience=3), every=25)
        # ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True,
        #                 every_n_train_steps=25)
        checkpoint_every(
            checkpoints,
            every=25,
            keep_last=1,
            keep_best=1,
            metric="val_loss",
            data=train_loader,
        ).attach(events)
        # log_every_n_steps=10
        events.on("step_end", Log(csv, sources=[train_metrics.read]), every=10)
        # Trainer(max_steps=...).fit(model, train_loader, val_loader)
        state = run(step, state, train_loader, events=events, max_steps=args.max_steps)

    return {
        "steps": state.step,
        **first_and_last(losses),
        "val_loss": state.extras.get("val_loss"),
        "best_val_loss": evaluator.best.value,
    }


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

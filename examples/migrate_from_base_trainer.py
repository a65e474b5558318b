"""An in-house ``BaseTrainer`` subclass (``training_step`` / ``validation_step`` / callbacks),
rewritten with steplib.

The original is in ``docs/migration/base_trainer.md``, side by side with this script.
``training_step`` becomes ``loss_fn(model, batch)``, ``validation_step`` becomes
``eval_fn(model, batch)`` fed to torchmetrics by an ``Evaluator``, the accumulation / clipping
code inside ``fit`` becomes wrappers, and each ``Callback`` subclass becomes an object with an
``attach(events)`` method whose handlers receive one ``Event`` (``trainer.global_step`` ->
``event.step``, ``trainer.model`` -> ``event.state.model``). ``fit`` itself is a short
function you own.

    python examples/migrate_from_base_trainer.py --out runs/migrate_from_base_trainer
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steplib import (
    Evaluator,
    Event,
    Events,
    TrainState,
    accumulate,
    clip,
    make_eval_step,
    make_train_step,
    run,
    warmup_cosine,
)
from steplib.cadence import due
from steplib.events import Handler
from steplib.handlers import BestValue

Batch = tuple[torch.Tensor, torch.Tensor]


def two_moons(n: int, *, seed: int) -> TensorDataset:
    """Two interleaving half circles in the plane, with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=gen)
    t = torch.rand(n, generator=gen) * torch.pi
    upper = torch.stack([t.cos(), t.sin()], 1)
    lower = torch.stack([1 - t.cos(), 0.5 - t.sin()], 1)
    x = torch.where(y[:, None] == 0, upper, lower)
    return TensorDataset(x + 0.1 * torch.randn(n, 2, generator=gen), y)


# ClassifierTrainer.training_step(self, batch) -> a function of (model, batch).
def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# ClassifierTrainer.validation_step(self, batch) -> what the metrics' update() takes. The
# averaging over batches that BaseTrainer.validate did by hand is torchmetrics' job.
def eval_fn(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    x, y = batch
    logits = model(x)
    return {"value": F.cross_entropy(logits, y, reduction="none"), "preds": logits, "target": y}


class Callback(Protocol):
    """What ``fit`` needs of a callback: it registers its own handlers."""

    def attach(self, events: Events) -> Events: ...


class LogEvery(Handler):
    """Was ``class LogEvery(Callback)`` with ``on_step_end(self, trainer)``: print the loss."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.lines: list[str] = []

    def on_step_end(self, event: Event) -> None:  # the same name: Events registers it
        if not due(self.every, event):  # every N updates (or Batches(n)): one rule
            return
        line = f"update {event.step}: loss {event.output.loss.item():.4f}"  # read every N only
        self.lines.append(line)
        print(line)


class KeepBest(Handler):
    """Was ``class KeepBest(Callback)`` with ``on_validation_end(self, trainer, metrics)``:
    save the weights whenever the held-out loss improves."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.best = BestValue(mode="min")

    def on_epoch_end(self, event: Event) -> None:
        # Attached after the Evaluator, whose epoch_end put val_loss into state.extras.
        if self.best.update(event.state.extras["val_loss"], step=event.step):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(event.state.model.state_dict(), self.path)


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_loader: Iterable[Any],
    val_loader: Iterable[Any],
    *,
    epochs: int,
    grad_accum: int,
    max_grad_norm: float,
    callbacks: Sequence[Callback] = (),
) -> tuple[TrainState, list[torch.Tensor]]:
    """BaseTrainer.fit, as a function of the pieces. Replace any line of it freely."""
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    # The accumulation and clipping fit() did inline: `loss / grad_accum`, backward, and every
    # grad_accum batches clip_grad_norm_, step, zero_grad. steplib also closes the last,
    # shorter window of each epoch (the inline version carried it into the next epoch).
    step = clip(accumulate(make_train_step(loss_fn), grad_accum), max_norm=max_grad_norm)
    events = Events()
    # BaseTrainer.validate() after each epoch, then callbacks' on_validation_end.
    Evaluator(
        make_eval_step(eval_fn),
        val_loader,
        metrics={
            "loss": torchmetrics.MeanMetric(),
            "acc": torchmetrics.classification.MulticlassAccuracy(
                num_classes=2,
                average="micro",  # correct / total, as before
            ),
        },
        at_epoch_end=True,
    ).attach(events)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    for callback in callbacks:
        callback.attach(events)
    state = run(step, state, train_loader, events=events, max_epochs=epochs)
    return state, losses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/migrate_from_base_trainer")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    train_loader = DataLoader(two_moons(1000, seed=1), batch_size=25, shuffle=True, generator=gen)
    val_loader = DataLoader(two_moons(500, seed=2), batch_size=250)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    updates = args.epochs * -(-len(train_loader) // 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup=5, total=updates))

    # trainer = ClassifierTrainer(model, optimizer, scheduler, grad_accum=4, max_grad_norm=1.0,
    #                             callbacks=[LogEvery(10), KeepBest(...)])
    # trainer.fit(train_loader, val_loader, epochs=...)
    keep_best = KeepBest(f"{args.out}/best.pt")
    state, losses = fit(
        model,
        optimizer,
        scheduler,
        train_loader,
        val_loader,
        epochs=args.epochs,
        grad_accum=4,
        max_grad_norm=1.0,
        callbacks=[LogEvery(10), keep_best],
    )
    values = torch.stack(losses).tolist()
    return {
        "steps": state.step,
        "first_loss": sum(values[:5]) / len(values[:5]),
        "last_loss": sum(values[-5:]) / len(values[-5:]),
        "val_acc": state.extras.get("val_acc"),
        "best_val_loss": keep_best.best.value,
    }


if __name__ == "__main__":
    print(main())

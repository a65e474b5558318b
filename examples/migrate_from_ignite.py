"""A PyTorch-Ignite ``create_supervised_trainer`` run, rewritten with steplib.

The Ignite original is in ``docs/migration/ignite.md``, side by side with this script. The
``Engine`` and its ``Events`` become ``steplib.run`` and ``steplib.Events``:
``@trainer.on(Events.ITERATION_COMPLETED(every=10))`` -> ``events.on("step_end", fn,
every=10)``, ``engine.state.output`` -> ``event.output`` (tensors, not ``loss.item()``),
``create_supervised_evaluator`` + ``EPOCH_COMPLETED`` -> ``Evaluator``, Ignite's
``EarlyStopping`` / ``ModelCheckpoint`` -> ``steplib.EarlyStopping`` / ``checkpoint_every``,
``ProgressBar`` -> ``steplib.ProgressBar``, ``engine.terminate()`` -> return ``Stop(...)``.

    python examples/migrate_from_ignite.py --out runs/migrate_from_ignite
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steplib import (
    EarlyStopping,
    Evaluator,
    Event,
    Events,
    ProgressBar,
    Stop,
    TrainState,
    accumulate,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    run,
)

Batch = tuple[torch.Tensor, torch.Tensor]
CLASSES = 3


def rings(n: int, *, seed: int) -> TensorDataset:
    """Three concentric rings in the plane: the class is the ring (not linearly separable)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    angle = torch.rand(n, generator=gen) * 2 * torch.pi
    radius = 1.0 + y.float() + 0.15 * torch.randn(n, generator=gen)
    return TensorDataset(torch.stack([radius * angle.cos(), radius * angle.sin()], 1), y)


# create_supervised_trainer(model, optimizer, criterion) calls criterion(model(x), y): here
# the whole computation from the batch to the loss is yours.
def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# create_supervised_evaluator(model, metrics={"acc": Accuracy(), "loss": Loss(criterion)})
def eval_fn(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    x, y = batch
    logits = model(x)
    return {"value": F.cross_entropy(logits, y, reduction="none"), "preds": logits, "target": y}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/migrate_from_ignite")
    parser.add_argument("--max-epochs", type=int, default=6)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    train_loader = DataLoader(rings(1024, seed=1), batch_size=32, shuffle=True, generator=gen)
    val_loader = DataLoader(rings(512, seed=2), batch_size=256)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState.create(model=model, optimizer=optimizer)

    # create_supervised_trainer(..., gradient_accumulation_steps=2). Ignite divides each
    # micro-batch's loss by 2; steplib divides the window's summed gradient once by what the
    # window held, so the last, shorter window of an epoch is normalised correctly.
    step = accumulate(make_train_step(loss_fn), 2)
    updates_per_epoch = -(-len(train_loader) // 2)  # run closes the last window of an epoch

    events = Events()
    # ProgressBar().attach(trainer, output_transform=lambda loss: {"loss": loss})
    ProgressBar(total=args.max_epochs * updates_per_epoch, file=sys.stderr).attach(events)
    losses: list[torch.Tensor] = []

    # @trainer.on(Events.ITERATION_COMPLETED): engine.state.output was loss.item(), one device
    # sync per iteration; event.output.loss stays a tensor until you read it.
    def record(event: Event) -> None:
        losses.append(event.output.loss)

    events.on("step_end", record)
    # @trainer.on(Events.EPOCH_COMPLETED): evaluator.run(val_loader). Evaluating on the last
    # update of each epoch (every=updates_per_epoch) lets the checkpoint below, registered
    # after it, see this epoch's val_loss.
    evaluator = Evaluator(
        make_eval_step(eval_fn),
        val_loader,
        metrics={
            "loss": torchmetrics.MeanMetric(),
            "acc": torchmetrics.classification.MulticlassAccuracy(
                num_classes=CLASSES,
                average="micro",  # correct / total, as before
            ),
        },
        every=updates_per_epoch,
        monitor="val_loss",
    )
    evaluator.attach(events)
    # EarlyStopping(patience=3, score_function=lambda e: -e.state.metrics["loss"], trainer=...)
    events.on("step_end", EarlyStopping("val_loss", patience=3), every=updates_per_epoch)
    # ModelCheckpoint(dirname, n_saved=2, score_function=..., score_name="neg_val_loss")
    checkpoint_every(
        f"{args.out}/checkpoints",
        every=updates_per_epoch,
        keep_last=1,
        keep_best=2,
        metric="val_loss",
    ).attach(events)

    # trainer.terminate() from a handler -> return Stop(reason).
    def stop_when_perfect(event: Event) -> Stop | None:
        if event.state.extras.get("val_acc", 0.0) >= 0.999:
            return Stop("validation accuracy reached 99.9%")
        return None

    events.on("epoch_end", stop_when_perfect)
    # trainer.run(train_loader, max_epochs=...)
    state = run(step, state, train_loader, events=events, max_epochs=args.max_epochs)

    return {
        "steps": state.step,
        "epochs": state.epoch,
        **first_and_last(losses),
        "val_acc": state.extras.get("val_acc"),
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

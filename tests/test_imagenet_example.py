"""pytorch/examples' imagenet/main.py's control flow, on a tiny model and data, written with
steplib equals the original's bit for bit, across a kill and resume too.

The example trains an epoch, evaluates top-1/top-5 accuracy (``AverageMeter``s weighted by
batch size), steps a ``StepLR`` per epoch, keeps ``best_acc1`` (``is_best = acc1 >
best_acc1``: a tie is no improvement) and copies the epoch's checkpoint to
``model_best.pth.tar`` when it is the best; ``--resume`` restores the model, optimizer,
scheduler, ``best_acc1`` and the epoch; ``--evaluate`` only validates.

With steplib: an ``Evaluator`` at each epoch's end with torchmetrics' top-1/top-5 accuracy,
``monitor="val_acc1", mode="max"``; the ``StepLR`` in ``handlers.Scheduler`` (stepped at
each ``epoch_end``, after the evaluation as in the example); ``checkpoint_every(...,
at_epoch_end=True, keep_best=1, metric=evaluator)`` for ``checkpoint.pth.tar`` and
``model_best.pth.tar``; ``resume_from`` for ``--resume``; ``evaluate`` on the best weights
for ``--evaluate``. The training loss the example's ``AverageMeter`` prints (weighted by
batch size) is ``TrainMetrics``' mean of ``loss * n`` over its mean ``n``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from steplib import (
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    make_eval_step,
    make_train_step,
    resumable_loader,
    run,
)
from steplib.checkpoint import (
    best_checkpoint,
    checkpoint_every,
    list_checkpoints,
    load_weights,
    resume_from,
)
from steplib.events import Event
from steplib.handlers import Scheduler, evaluate
from tests.checkpoint_helpers import assert_same

CLASSES, EPOCHS, STEP_SIZE = 6, 6, 2
Batch = tuple[torch.Tensor, torch.Tensor]


class Net(nn.Module):
    """A small ResNet-like stem: convolution, batch norm, dropout, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dropout, self.fc = nn.Dropout(0.2), nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc(self.dropout(x))


def build(resumable: bool = False) -> tuple[Net, torch.optim.Optimizer, StepLR, Any, DataLoader]:
    data = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, 6, 6, generator=data)
    y = (x.mean(dim=(2, 3)) @ torch.randn(3, CLASSES, generator=data)).argmax(dim=1)
    torch.manual_seed(17)  # the example seeds nothing else: the shuffle draws from torch's
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = StepLR(optimizer, step_size=STEP_SIZE, gamma=0.1)
    train_set = TensorDataset(x[:20], y[:20])
    train_loader: Any = DataLoader(train_set, batch_size=8, shuffle=True)
    if resumable:  # its order from its own generator; its position in a checkpoint
        train_loader = resumable_loader(train_set, batch_size=8, seed=9)
    val_loader = DataLoader(TensorDataset(x[20:], y[20:]), batch_size=4)  # 4, 4 and 2
    return model, optimizer, scheduler, train_loader, val_loader


def accuracy(
    output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...]
) -> list[torch.Tensor]:
    """The example's: the percentage of the batch whose target is in the top k."""
    with torch.no_grad():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [
            correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / len(target))
            for k in topk
        ]


def validate(model: nn.Module, val_loader: DataLoader) -> tuple[float, float]:
    """The example's validate(): top-1 and top-5 averages weighted by batch size."""
    model.eval()
    top1_sum, top5_sum, count = 0.0, 0.0, 0
    # Its DataLoader draws a base seed from torch's generator, which moves the next epoch's
    # shuffle; an Evaluator draws under a forked generator (law 10), so this one does too.
    with torch.random.fork_rng(), torch.no_grad():
        for images, target in val_loader:
            acc1, acc5 = accuracy(model(images), target, topk=(1, 5))
            top1_sum, top5_sum, count = (
                top1_sum + float(acc1[0]) * len(target),
                top5_sum + float(acc5[0]) * len(target),
                count + len(target),
            )
    return top1_sum / count, top5_sum / count


def original(resumable: bool = False) -> dict[str, Any]:
    """The example's main_worker loop, uninterrupted."""
    model, optimizer, scheduler, train_loader, val_loader = build(resumable)
    best_acc1, best_epoch, best_weights = 0.0, 0, None
    lrs, losses, accs, acc5s = [], [], [], []
    for epoch in range(EPOCHS):
        model.train()
        lrs.append(optimizer.param_groups[0]["lr"])
        loss_sum, count = 0.0, 0
        for images, target in train_loader:
            loss = F.cross_entropy(model(images), target)
            loss_sum, count = loss_sum + loss.item() * len(target), count + len(target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss_sum / count)
        acc1, acc5 = validate(model, val_loader)
        accs.append(acc1)
        acc5s.append(acc5)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if is_best:  # the copy to model_best.pth.tar
            best_epoch, best_weights = epoch + 1, copy.deepcopy(model.state_dict())
    return {
        "lrs": lrs,
        "losses": losses,
        "accs": accs,
        "acc5s": acc5s,
        "best": best_acc1,
        "best_epoch": best_epoch,
        "best_weights": best_weights,
        "last_weights": model.state_dict(),
    }


class KilledError(Exception):
    """The process dies (no handler saves)."""


def die() -> None:
    raise KilledError


def with_steplib(url: str, kill_at: int | None = None, resumable: bool = False) -> dict[str, Any]:
    model, optimizer, scheduler, train_loader, val_loader = build(resumable)
    metrics = {
        "acc1": MulticlassAccuracy(num_classes=CLASSES, top_k=1, average="micro"),
        "acc5": MulticlassAccuracy(num_classes=CLASSES, top_k=5, average="micro"),
    }
    eval_step = make_eval_step(lambda m, b: (m(b[0]), b[1]))
    evaluator = Evaluator(
        eval_step, val_loader, metrics=metrics, at_epoch_end=True, monitor="val_acc1", mode="max"
    )
    # With a resumable loader, saves inside epochs too (they hold no score: never the best).
    every = 2 if resumable else None
    ckpt = checkpoint_every(url, every=every, at_epoch_end=True, keep_best=1, metric=evaluator)
    train = TrainMetrics()
    events = Events(resume_from(ckpt), train, evaluator)
    lrs, losses = list[float](), list[float]()
    # The rate the epoch trained with (before the Scheduler steps it), printed at its end.
    events.on("epoch_end", lambda e: lrs.append(optimizer.param_groups[0]["lr"]))
    events.add(Scheduler(scheduler))
    events.add(ckpt)

    def epoch_loss(e: Event) -> None:  # the example's AverageMeter: weighted by batch size
        values = train.read(e)
        losses.append(values["loss_n"] / values["n"])

    events.on("epoch_end", epoch_loss)
    if kill_at is not None:  # the process dies: no save, the last epoch's checkpoint is there
        events.on("step_end", lambda e: die() if e.step == kill_at else None)

    def loss_fn(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        images, target = batch
        loss = F.cross_entropy(model(images), target)
        n = torch.tensor(float(len(target)))
        return loss, {"loss_n": loss.detach() * n, "n": n}

    state = TrainState.create(model=model, optimizer=optimizer)
    try:
        state = run(make_train_step(loss_fn), state, train_loader, events=events, max_epochs=EPOCHS)
    except KilledError:  # what it printed before: its whole epochs
        return {"lrs": lrs, "losses": losses}
    last_weights = copy.deepcopy(model.state_dict())
    best_url = best_checkpoint(url, evaluator)
    load_weights(model, best_url)
    # --evaluate: validate the best model alone.
    evaluated = evaluate(eval_step, model, val_loader, metrics=metrics)
    return {
        "lrs": lrs,
        "losses": losses,
        "accs": [float(values["val_acc1"]) * 100 for _, values in evaluator.history],
        "acc5s": [float(values["val_acc5"]) * 100 for _, values in evaluator.history],
        "best": float(evaluator.best.value or 0.0) * 100,
        "best_epoch": evaluator.best.step,
        "evaluated": evaluated,
        "best_weights": model.state_dict(),
        "last_weights": last_weights,
        "steps_per_epoch": len(train_loader),
        "kept": [c.step for c in list_checkpoints(url)],
    }


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["lrs"] == want["lrs"] == [0.1 * 0.1 ** (e // STEP_SIZE) for e in range(EPOCHS)]
    assert len(got["losses"]) == EPOCHS
    for value, expected in zip(
        got["losses"] + got["accs"] + got["acc5s"],
        want["losses"] + want["accs"] + want["acc5s"],
        strict=True,
    ):
        assert math.isclose(value, expected, rel_tol=1e-6)
    assert math.isclose(got["best"], want["best"], rel_tol=1e-6)
    assert got["best_epoch"] == want["best_epoch"] * got["steps_per_epoch"]  # updates
    assert_same(got["best_weights"], want["best_weights"])
    assert_same(got["last_weights"], want["last_weights"])
    assert math.isclose(got["evaluated"]["acc1"] * 100, want["best"], rel_tol=1e-6)
    assert got["kept"] == sorted({got["best_epoch"], EPOCHS * got["steps_per_epoch"]})


def test_imagenet_loop_equals_the_example_bit_for_bit(tmp_path: Path) -> None:
    want = original()
    assert 1 < want["best_epoch"] < EPOCHS  # a best before the end: is_best matters
    assert want["accs"].count(want["best"]) > 1  # a tie with the best: it must not replace it
    check(with_steplib(str(tmp_path / "ckpt")), want)


# At epoch 2's last update; inside epoch 3; inside epoch 4, before its best; after the best.
@pytest.mark.parametrize("kill_at", [6, 7, 11, 13])
def test_imagenet_loop_killed_and_resumed_equals_the_example_uninterrupted(
    tmp_path: Path, kill_at: int
) -> None:
    want = original()
    killed = with_steplib(str(tmp_path / "ckpt"), kill_at=kill_at)
    got = with_steplib(str(tmp_path / "ckpt"))  # --resume: from the last epoch's checkpoint
    got["lrs"], got["losses"] = killed["lrs"] + got["lrs"], killed["losses"] + got["losses"]
    check(got, want)


# Saves every 2 updates (3 an epoch). Killed at the best epoch's (3rd) last update, resumed
# from update 8 inside it; inside epoch 4, from update 10; inside epoch 5, from update 14.
@pytest.mark.parametrize("kill_at", [9, 11, 15])
def test_imagenet_loop_killed_inside_an_epoch_resumes_there(tmp_path: Path, kill_at: int) -> None:
    want = original(resumable=True)
    assert want["best_epoch"] == 3 and want["accs"].count(want["best"]) > 1
    killed = with_steplib(str(tmp_path / "ckpt"), kill_at=kill_at, resumable=True)
    got = with_steplib(str(tmp_path / "ckpt"), resumable=True)
    got["lrs"], got["losses"] = killed["lrs"] + got["lrs"], killed["losses"] + got["losses"]
    check(got, want)

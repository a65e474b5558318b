"""The PyTorch tutorial's transfer learning loop (beginner_source/transfer_learning_tutorial.py,
``train_model``, "ConvNet as fixed feature extractor") written with steplib equals it bit for
bit: the body frozen, SGD with momentum over the new head, ``StepLR`` stepped after each
training phase, a validation phase per epoch (``model.eval()``), the weights of the best
validation accuracy kept (``acc > best_acc``) and loaded at the end.

With steplib (docs/migration/README.md, "Best validation accuracy's weights loaded at the end
(transfer_learning)"): an ``Evaluator`` at each epoch end monitoring accuracy (``mode="max"``),
``Scheduler(StepLR)``, ``checkpoint_every(at_epoch_end=True, keep_best=1, metric=evaluator)``
and, after the run, ``load_weights(model, best_checkpoint(...))``.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from steplib import Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.checkpoint import best_checkpoint, checkpoint_every, load_weights
from steplib.handlers import Scheduler
from tests.checkpoint_helpers import assert_same

EPOCHS, CLASSES = 6, 3


def build() -> tuple[nn.Module, torch.optim.Optimizer, Any, DataLoader[Any], DataLoader[Any]]:
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(CLASSES, (64,))
    vx, vy = torch.randn(24, 8), torch.randint(CLASSES, (24,))
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))
    for p in model[:3].parameters():  # the pretrained body, frozen
        p.requires_grad = False
    optimizer = torch.optim.SGD(model[3].parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    # The tutorial shuffles its validation set too; the order changes no accuracy.
    val = DataLoader(TensorDataset(vx, vy), batch_size=8)
    return model, optimizer, scheduler, train, val


def reference() -> tuple[dict[str, torch.Tensor], list[float], float]:
    model, optimizer, scheduler, loaders = *build()[:3], {}
    loaders["train"], loaders["val"] = build()[3:]
    torch.manual_seed(1)
    best_weights, best_acc, accs = copy.deepcopy(model.state_dict()), 0.0, []
    for _ in range(EPOCHS):
        for phase in ["train", "val"]:
            model.train() if phase == "train" else model.eval()
            corrects, seen = 0, 0
            # Every DataLoader iteration draws a seed from the global generator (shuffled or
            # not): the tutorial's validation changes its next epoch's order. steplib evaluates
            # under a forked RNG (law 10), so here the validation phase does too.
            rng = torch.random.fork_rng() if phase == "val" else contextlib.nullcontext()
            with rng:
                batches = list(loaders[phase])
            for inputs, labels in batches:
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    loss = F.cross_entropy(outputs, labels)
                    if phase == "train":
                        loss.backward()
                        optimizer.step()
                corrects += int((outputs.argmax(1) == labels).sum())
                seen += len(labels)
            if phase == "train":
                scheduler.step()
            acc = corrects / seen
            if phase == "val":
                accs.append(acc)
                if acc > best_acc:
                    best_acc, best_weights = acc, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_weights)
    return model.state_dict(), accs, best_acc


def test_transfer_learning_with_steplib_equals_the_tutorial_loop(tmp_path: Path) -> None:
    want, want_accs, want_best = reference()

    model, optimizer, scheduler, train, val = build()
    torch.manual_seed(1)
    accuracy = MulticlassAccuracy(num_classes=CLASSES, average="micro")
    eval_step = make_eval_step(lambda m, b: (m(b[0]), b[1]))
    evaluator = Evaluator(
        eval_step, val, metrics={"acc": accuracy}, at_epoch_end=True, monitor="val_acc", mode="max"
    )
    ckpt = checkpoint_every(str(tmp_path), at_epoch_end=True, keep_best=1, metric=evaluator)
    accs: list[float] = []
    events = Events(evaluator, Scheduler(scheduler), ckpt)
    events.on("epoch_end", lambda e: accs.append(float(e.state.extras["val_acc"])))
    state = TrainState.create(model=model, optimizer=optimizer)
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    run(make_train_step(loss_fn), state, train, events=events, max_epochs=EPOCHS)
    load_weights(model, best_checkpoint(str(tmp_path), evaluator))

    assert accs == pytest.approx(want_accs, rel=1e-6)  # torchmetrics' is float32
    assert want_accs.index(want_best) < EPOCHS - 1  # the best is not the last epoch's
    assert_same(model.state_dict(), want)

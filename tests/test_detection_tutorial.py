"""The PyTorch tutorial's detection fine-tuning loop (intermediate_source/torchvision_tutorial.py
with torchvision's references/detection/engine.py ``train_one_epoch``) written with steplib
equals it bit for bit, on a tiny stand-in model that returns a dict of losses.

The tutorial: batches are tuples of lists (``collate_fn=lambda b: tuple(zip(*b))``: images
of different sizes and a target dict each), the model returns its losses by name, their sum
is back-propagated; SGD with momentum and weight decay; a ``LinearLR`` warmup created at the
first epoch and stepped after every update of that epoch only; a ``StepLR`` stepped after
every epoch.

With steplib (docs/migration/README.md, "Losses by name and a warmup in the first epoch
(torchvision detection)"): ``loss_fn`` returns the sum and the dict as aux; the warmup is the
state's per-update scheduler (past ``total_iters`` a ``LinearLR`` leaves the rate as it
finds it, so it may go on stepping in later epochs), ``StepLR`` a per-epoch ``Scheduler``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from steplib import Events, TrainState, make_train_step, run
from steplib.events import Event
from steplib.handlers import Scheduler
from tests.checkpoint_helpers import assert_same

EPOCHS = 4


class TinyDetector(nn.Module):
    """``model(images, targets) -> {"loss_classifier": ..., "loss_box_reg": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.features, self.cls, self.box = nn.Conv2d(3, 4, 3), nn.Linear(4, 3), nn.Linear(4, 4)

    def forward(self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> Any:
        pooled = torch.stack([self.features(i.unsqueeze(0)).mean((2, 3))[0] for i in images])
        labels = torch.stack([t["labels"] for t in targets])
        boxes = torch.stack([t["boxes"] for t in targets])
        return {
            "loss_classifier": nn.functional.cross_entropy(self.cls(pooled), labels),
            "loss_box_reg": nn.functional.smooth_l1_loss(self.box(pooled), boxes),
        }


def dataset() -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    items = []
    for i in range(20):
        image = torch.rand(3, 6 + i % 3, 7 + i % 2, generator=g)  # sizes differ
        target = {"labels": torch.randint(3, (), generator=g), "boxes": torch.rand(4, generator=g)}
        items.append((image, target))
    return items


def build() -> tuple[TinyDetector, torch.optim.Optimizer, Any, DataLoader[Any]]:
    torch.manual_seed(0)
    model = TinyDetector()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.0005)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    items: Any = dataset()  # a list is a map-style dataset
    loader: DataLoader[Any] = DataLoader(
        items, batch_size=3, shuffle=True, collate_fn=lambda b: tuple(zip(*b, strict=True))
    )
    return model, optimizer, step_lr, loader


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model, optimizer, step_lr, loader = build()
    torch.manual_seed(1)
    lrs = []
    for epoch in range(EPOCHS):  # engine.train_one_epoch, then lr_scheduler.step()
        model.train()
        warmup = None
        if epoch == 0:
            warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=1.0 / 1000, total_iters=min(1000, len(loader) - 1)
            )
        for images, targets in loader:
            loss_dict = model(list(images), list(targets))
            losses = sum(loss for loss in loss_dict.values())
            optimizer.zero_grad()
            losses.backward()
            optimizer.step()
            lrs.append(optimizer.param_groups[0]["lr"])
            if warmup is not None:
                warmup.step()
        step_lr.step()
    return model.state_dict(), lrs


class Rates:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_step_end(self, event: Event) -> None:  # the rate the update used: before its step
        self.seen.append(float(event.output.lr))


def test_detection_fine_tuning_with_steplib_equals_the_tutorial_loop() -> None:
    want, want_lrs = reference()

    model, optimizer, step_lr, loader = build()
    torch.manual_seed(1)
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / 1000, total_iters=min(1000, len(loader) - 1)
    )

    def loss_fn(m: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        images, targets = batch
        loss_dict = m(list(images), list(targets))
        losses: torch.Tensor = sum(loss for loss in loss_dict.values())
        return losses, {name: loss.detach() for name, loss in loss_dict.items()}

    rates = Rates()
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=warmup)
    events = Events(Scheduler(step_lr), rates)
    run(make_train_step(loss_fn), state, loader, events=events, max_epochs=EPOCHS)
    assert rates.seen == want_lrs
    assert_same(model.state_dict(), want)

"""pytorch/examples' siamese_network (siamese_network/main.py) written with steplib equals its
plain loop bit for bit, also stopped in the middle of an epoch and resumed in new objects.

The example's dataset draws a random pair in ``__getitem__`` from Python's ``random`` (the
first image's class and index; for an even index another image of that class, for an odd one
an image of another class). Here it also adds noise from torch's generator and the head has
dropout, so that a batch drawn one step early (a loader that prefetches in the main process),
or a generator not restored at resume, changes the result. The optimizer is Adadelta, the
learning rate a ``StepLR`` stepped after each epoch, the loss ``BCELoss`` on a sigmoid.

The plain loop uses torch's ``DataLoader`` with the generator ``resumable_loader`` builds
(``torch.Generator().manual_seed(seed)``): its workers' seeds come from it alone. Shuffled, it
uses torchdata's ``StatefulDataLoader`` (which ``resumable_loader`` builds on) instead: from
the same generator torch's draws the workers' base seed before the permutation, torchdata's
after it, so the two shuffle in different orders (docs/checkpoints.md, "Data").
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchmetrics import MeanMetric

from steplib import Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.events import Stop
from steplib.handlers import Scheduler
from tests.checkpoint_helpers import assert_same

CLASSES, PER_CLASS, BATCH, EPOCHS, LOADER_SEED = 10, 3, 4, 2, 5  # 30 pairs: 8 batches an epoch


class SiameseNetwork(nn.Module):
    """The example's network, with a small convolution instead of ResNet-18."""

    def __init__(self) -> None:
        super().__init__()
        self.resnet = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Dropout(0.3))
        self.fc.append(nn.Linear(8, 1))
        self.sigmoid = nn.Sigmoid()

    def forward_once(self, x: torch.Tensor) -> torch.Tensor:
        output = self.resnet(x)
        return output.view(output.size()[0], -1)

    def forward(self, input1: torch.Tensor, input2: torch.Tensor) -> torch.Tensor:
        output = torch.cat((self.forward_once(input1), self.forward_once(input2)), 1)
        return self.sigmoid(self.fc(output))


class AppMatcher(Dataset[Any]):
    """The example's APP_MATCHER over tiny random images, plus noise from torch's generator."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.data = torch.rand(CLASSES * PER_CLASS, 1, 6, 6, generator=gen)
        targets = np.arange(CLASSES * PER_CLASS) % CLASSES
        self.grouped_examples = {i: np.where(targets == i)[0] for i in range(CLASSES)}

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        selected_class = random.randint(0, 9)
        random_index_1 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
        image_1 = self.data[self.grouped_examples[selected_class][random_index_1]].clone()
        if index % 2 == 0:
            random_index_2 = random.randint(0, self.grouped_examples[selected_class].shape[0] - 1)
            while random_index_2 == random_index_1:
                random_index_2 = random.randint(
                    0, self.grouped_examples[selected_class].shape[0] - 1
                )
            image_2 = self.data[self.grouped_examples[selected_class][random_index_2]].clone()
            target = torch.tensor(1, dtype=torch.float)
        else:
            other_selected_class = random.randint(0, 9)
            while other_selected_class == selected_class:
                other_selected_class = random.randint(0, 9)
            random_index_2 = random.randint(
                0, self.grouped_examples[other_selected_class].shape[0] - 1
            )
            image_2 = self.data[self.grouped_examples[other_selected_class][random_index_2]]
            target = torch.tensor(0, dtype=torch.float)
        return image_1 + 0.1 * torch.randn_like(image_1), image_2.clone(), target


criterion = nn.BCELoss()


def build() -> tuple[SiameseNetwork, torch.optim.Optimizer, Any]:
    torch.manual_seed(1)
    random.seed(1)  # the example leaves Python's generator unseeded
    model = SiameseNetwork()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def example_test(model: nn.Module, test_loader: Any) -> None:
    """The example's test(): its pairs are drawn from the training's generators."""
    model.eval()
    with torch.no_grad():
        for images_1, images_2, targets in test_loader:
            criterion(model(images_1, images_2).squeeze(), targets).sum().item()


def original(
    *, shuffle: bool, workers: int, evaluate: str | None = None
) -> tuple[nn.Module, list[float]]:
    """main() and train() of the example, reduced to what changes the numbers; ``evaluate``:
    ``"example"`` calls test() after each epoch as the example does, ``"forked"`` calls it
    with the generators given back their states afterwards."""
    model, optimizer, scheduler = build()
    with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital
        warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
        train_loader = (StatefulDataLoader if shuffle else DataLoader)(
            AppMatcher(),
            batch_size=BATCH,
            shuffle=shuffle,
            num_workers=workers,
            generator=torch.Generator().manual_seed(LOADER_SEED),
        )
    losses = []
    for _ in range(EPOCHS):
        model.train()
        for images_1, images_2, targets in train_loader:
            optimizer.zero_grad()
            outputs = model(images_1, images_2).squeeze()
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if evaluate == "example":
            example_test(model, DataLoader(AppMatcher(), batch_size=10))
        elif evaluate == "forked":
            python = random.getstate()
            with torch.random.fork_rng():
                example_test(model, DataLoader(AppMatcher(), batch_size=10))
            random.setstate(python)
        scheduler.step()
    return model, losses


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    images_1, images_2, targets = batch
    return criterion(model(images_1, images_2).squeeze(), targets)


def with_steplib(
    *,
    shuffle: bool,
    workers: int,
    url: str | None = None,
    stop_at: int | None = None,
    evaluate: bool = False,
) -> tuple[nn.Module, list[float]]:
    model, optimizer, scheduler = build()
    data = resumable_loader(
        AppMatcher(), batch_size=BATCH, shuffle=shuffle, num_workers=workers, seed=LOADER_SEED
    )
    losses: list[float] = []
    events = Events(Scheduler(scheduler))
    events.on("step_end", lambda e: losses.append(float(e.output.loss)))
    if evaluate:
        step = make_eval_step(lambda m, b: criterion(m(b[0], b[1]).squeeze(), b[2]))
        val = DataLoader(AppMatcher(), batch_size=10)
        events.add(Evaluator(step, val, metrics={"loss": MeanMetric()}, at_epoch_end=True))
    if url is not None:
        ckpt = checkpoint_every(url, every=1, data=data)
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
    run(make_train_step(loss_fn), TrainState.create(model=model, optimizer=optimizer), data,
        events=events, max_epochs=EPOCHS)  # fmt: skip
    return model, losses


@pytest.mark.parametrize(("shuffle", "workers"), [(False, 0), (False, 2), (True, 0), (True, 2)])
def test_siamese_with_steplib_equals_its_plain_loop_bit_for_bit(shuffle: bool, workers: int):
    want_model, want_losses = original(shuffle=shuffle, workers=workers)
    got_model, got_losses = with_steplib(shuffle=shuffle, workers=workers)
    assert got_losses == want_losses
    assert_same(got_model.state_dict(), want_model.state_dict())


@pytest.mark.parametrize(
    ("shuffle", "workers", "stop_at"),
    [
        (False, 0, 3),
        (False, 2, 11),
        (True, 0, 3),
        (True, 0, 8),
        (True, 0, 11),
        (True, 2, 3),
        (True, 2, 8),
        (True, 2, 11),
    ],
)  # inside the first epoch, at its last batch, inside the second
def test_siamese_stopped_mid_epoch_and_resumed_equals_its_plain_loop(
    tmp_path: Path, shuffle: bool, workers: int, stop_at: int
) -> None:
    want_model, want_losses = original(shuffle=shuffle, workers=workers)
    url = str(tmp_path / "ckpt")
    _, first = with_steplib(shuffle=shuffle, workers=workers, url=url, stop_at=stop_at)
    got_model, rest = with_steplib(shuffle=shuffle, workers=workers, url=url)
    assert first + rest == want_losses
    assert_same(got_model.state_dict(), want_model.state_dict())


def test_siamese_evaluated_each_epoch_trains_as_without_evaluation() -> None:
    """The example's test() draws its pairs from Python's generator and its loader's base seed
    from torch's, which the next epoch's training pairs and dropout masks then follow: the
    example trains differently with and without it. An ``Evaluator`` draws under forked
    generators (law 10): steplib with one equals the example with test() forked, or without."""
    want_model, want_losses = original(shuffle=False, workers=0, evaluate="forked")
    without_model, without_losses = original(shuffle=False, workers=0)
    assert without_losses == want_losses
    assert_same(without_model.state_dict(), want_model.state_dict())
    got_model, got_losses = with_steplib(shuffle=False, workers=0, evaluate=True)
    assert got_losses == want_losses
    assert_same(got_model.state_dict(), want_model.state_dict())
    # What docs/migration/README.md says of the example's own evaluation.
    _, example_losses = original(shuffle=False, workers=0, evaluate="example")
    assert example_losses[:8] == want_losses[:8] and example_losses[8:] != want_losses[8:]

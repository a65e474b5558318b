"""pytorch/examples' super_resolution written with steplib equals the original bit for bit.

The example trains an ESPCN (convolutions, then ``nn.PixelShuffle``) with Adam on MSE over a
shuffled loader, evaluates the mean PSNR over the test batches after each epoch (each batch's
``10 * log10(1 / mse)``, averaged over batches), and writes the model after each epoch
(``torch.save(model, "model_epoch_{epoch}.pth")``, which ``super_resolve.py`` loads).

With steplib: the same loader to ``run``; an ``Evaluator`` at each epoch's end with the
batch's PSNR as a ``MeanMetric`` value (one weight per batch, as the example averages); and
``export_model`` at ``epoch_end`` for the per-epoch file: the weights (``state_dict``), which
``model.load_state_dict(torch.load(path, weights_only=True))`` reads back into a ``Net``
(``torch.load`` of a whole pickled module needs ``weights_only=False`` since torch 2.6).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import init
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.events import Event
from steplib.handlers import export_model
from tests.checkpoint_helpers import assert_same

UPSCALE, EPOCHS, LR = 2, 3, 0.01


class Net(nn.Module):
    """The example's model, narrower (16 channels for its 64)."""

    def __init__(self, upscale_factor: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 16, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(16, 16, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(16, 8, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(8, upscale_factor**2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        init.orthogonal_(self.conv1.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv2.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv3.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv4.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))


def images(n: int, generator: torch.Generator) -> TensorDataset:
    """(low resolution, high resolution) pairs: the target average-pooled down, as Resize."""
    high = torch.rand(n, 1, 8 * UPSCALE, 8 * UPSCALE, generator=generator)
    return TensorDataset(nn.functional.avg_pool2d(high, UPSCALE), high)


def build() -> tuple[Net, torch.optim.Optimizer, DataLoader, DataLoader]:
    data = torch.Generator().manual_seed(0)
    train_set, test_set = images(10, data), images(5, data)
    torch.manual_seed(123)
    model = Net(upscale_factor=UPSCALE)
    train_loader = DataLoader(train_set, batch_size=4, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=3, shuffle=False)  # batches of 3 and 2
    return model, torch.optim.Adam(model.parameters(), lr=LR), train_loader, test_loader


criterion = nn.MSELoss()


def reference(out: Path) -> tuple[Net, list[float], list[float], list[float]]:
    model, optimizer, train_loader, test_loader = build()
    losses, psnrs, averages = [], [], []
    for epoch in range(1, EPOCHS + 1):
        epoch_loss = 0.0
        for inputs, target in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(inputs), target)
            losses.append(loss.item())
            epoch_loss += loss.item()
            loss.backward()
            optimizer.step()
        averages.append(epoch_loss / len(train_loader))  # "Epoch {} Complete: Avg. Loss"
        # The example's test(): its DataLoader draws a base seed from torch's generator when
        # iterated, which moves the next epoch's shuffle; an Evaluator draws under a forked
        # generator (law 10), so the reference evaluates under one too.
        with torch.random.fork_rng(), torch.no_grad():
            avg_psnr = 0.0
            for inputs, target in test_loader:
                avg_psnr += 10 * math.log10(1 / criterion(model(inputs), target).item())
            psnrs.append(avg_psnr / len(test_loader))
        torch.save(model, out / f"model_epoch_{epoch}.pth")
    return model, losses, psnrs, averages


def psnr(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, target = batch
    return {"value": 10 * torch.log10(1 / criterion(model(inputs), target))}


def with_steplib(out: Path) -> tuple[Net, list[float], list[float], list[float]]:
    model, optimizer, train_loader, test_loader = build()
    evaluator = Evaluator(
        make_eval_step(psnr), test_loader, metrics={"psnr": MeanMetric()}, at_epoch_end=True
    )
    train = TrainMetrics()
    events = Events(evaluator, train)
    losses, averages = list[float](), list[float]()
    events.on("step_end", lambda e: losses.append(float(e.output.loss)))
    events.on("epoch_end", lambda e: averages.append(train.read(e)["loss"]))  # batch means'

    def checkpoint(e: Event) -> None:  # after the evaluator's epoch_end: registered later
        export_model(e.state, str(out / f"model_epoch_{e.epoch}.pth"))

    events.on("epoch_end", checkpoint)
    state = TrainState.create(model=model, optimizer=optimizer)
    run(
        make_train_step(lambda m, b: criterion(m(b[0]), b[1])),
        state,
        train_loader,
        events=events,
        max_epochs=EPOCHS,
    )
    psnrs = [float(values["val_psnr"]) for _, values in evaluator.history]
    return model, losses, psnrs, averages


def test_super_resolution_equals_the_example_bit_for_bit(tmp_path: Path) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "lib").mkdir()
    expected, expected_losses, expected_psnrs, expected_averages = reference(tmp_path / "ref")
    got, losses, psnrs, averages = with_steplib(tmp_path / "lib")
    assert losses == expected_losses
    assert_same(got.state_dict(), expected.state_dict())
    assert len(psnrs) == EPOCHS
    assert len(psnrs) == len(averages) == EPOCHS
    for value, want in zip(psnrs + averages, expected_psnrs + expected_averages, strict=True):
        assert math.isclose(value, want, rel_tol=1e-6)  # float32 metric, float64 sum
    for epoch in range(1, EPOCHS + 1):  # each epoch's file holds that epoch's model
        pickled = torch.load(tmp_path / "ref" / f"model_epoch_{epoch}.pth", weights_only=False)
        loaded = Net(upscale_factor=UPSCALE)
        loaded.load_state_dict(
            torch.load(tmp_path / "lib" / f"model_epoch_{epoch}.pth", weights_only=True)
        )
        assert_same(loaded.state_dict(), pickled.state_dict())

"""pytorch/examples' MNIST recipe (a CNN with dropout, Adadelta, ``StepLR`` stepped once per
epoch after the test pass) written the natural way with steplib, with the default evaluator
settings (a sanity pass, evaluation at each epoch end), equals the original loop bit for bit:
every loss, the parameters and the learning rate at the end.

The data is synthetic and small (12x12 images, 10 classes), shuffled by a ``DataLoader`` that
draws from the global generator, as the original's does. One difference from the original is
kept on purpose: its ``test()`` iterates a ``DataLoader``, which draws a seed from the global
generator and so shifts every later dropout mask and shuffle of its own training; steplib's
evaluation draws nothing from training (law 10). The reference here therefore tests on a list
of batches, which draws nothing, so both loops train on the same random numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from steplib import Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.events import Batches
from steplib.handlers import Log, Scheduler
from tests.reference import RecordingSink

EPOCHS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4 * 5 * 5, 16)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


TestSet = list[tuple[torch.Tensor, torch.Tensor]]


def _setup() -> tuple[DataLoader[Any], TestSet, Net, torch.optim.Optimizer]:
    """The seed, the data (the training loader shuffles from the global generator, as the
    original's does), the model and its optimizer: the same for both loops."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 1, 12, 12, generator=gen), torch.randint(0, 10, (96,), generator=gen)
    test = [(x[i : i + 16] * 0.5, y[i : i + 16]) for i in range(0, 48, 16)]
    train_loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = Net()
    return train_loader, test, model, torch.optim.Adadelta(model.parameters(), lr=1.0)


def _original() -> tuple[list[float], nn.Module, float]:
    """The loop of pytorch/examples mnist/main.py, reduced to what changes the numbers."""
    train_loader, test_set, model, optimizer = _setup()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for _ in range(EPOCHS):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            for data, target in test_set:
                F.nll_loss(model(data), target, reduction="sum").item()
        scheduler.step()
    return losses, model, optimizer.param_groups[0]["lr"]


def _steplib(log: Log | None = None) -> tuple[list[float], nn.Module, float]:
    train_loader, test_set, model, optimizer = _setup()
    state = TrainState.create(model=model, optimizer=optimizer)
    step = make_train_step(lambda m, b: F.nll_loss(m(b[0]), b[1]))
    evaluator = Evaluator(
        make_eval_step(lambda m, b: {"value": F.nll_loss(m(b[0]), b[1], reduction="sum")}),
        DataLoader(TensorDataset(*map(torch.cat, zip(*test_set, strict=True))), batch_size=16),
        metrics={"loss": MeanMetric()},
        at_epoch_end=True,
    )
    per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7))
    losses: list[float] = []
    events = Events(evaluator, per_epoch, *([log] if log else [])).on(
        "step_end", lambda event: losses.append(float(event.output.loss))
    )
    state = run(step, state, train_loader, events=events, max_epochs=EPOCHS)
    assert len(evaluator.history) == EPOCHS
    return losses, state.model, optimizer.param_groups[0]["lr"]


def test_the_mnist_recipe_equals_the_original_loop_bit_for_bit() -> None:
    want_losses, want_model, want_lr = _original()
    got_losses, got_model, got_lr = _steplib()
    assert got_losses == want_losses
    assert got_lr == want_lr == 1.0 * 0.7**EPOCHS
    for a, b in zip(got_model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_mnist_recipe_logs_every_n_batches() -> None:
    """The original prints the loss every ``log_interval`` batches; ``every=Batches(n)`` says
    the same in batches, whatever the accumulation (counted over the run, not per epoch),
    and the run's last batch (not a multiple here) is written at its end."""
    want_losses, _, _ = _original()
    sink = RecordingSink()
    _steplib(Log(sink, every=Batches(4)))
    batches = [*range(4, 6 * EPOCHS + 1, 4), 6 * EPOCHS]
    assert 6 * EPOCHS % 4 != 0
    assert [r["micro_step"] for r in sink.records] == batches
    # A record holds the shortest decimal of the float32 loss: the same float32.
    logged = [torch.tensor(r["loss"], dtype=torch.float32).item() for r in sink.records]
    assert logged == [want_losses[n - 1] for n in batches]

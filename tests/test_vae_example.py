"""pytorch/examples' VAE (vae/main.py) written with steplib equals the original loop bit for bit.

Its loss is a sum over the batch (``binary_cross_entropy(..., reduction='sum')`` plus the KL
term summed), the optimizer steps on that sum, the last batch is smaller, and it prints each
epoch's "Average loss": the sums added up over the epoch, divided by the number of samples.

With steplib (docs/migration/README.md, "A loss summed over the batch"): ``loss_fn`` returns the
sum as its loss (one micro-batch, one target: the gradient is the sum's, as the example's), and
the batch's sample count as aux; the epoch average is ``TrainMetrics``' mean of the sums over
its mean of the counts (both means over the same batches, so the ratio is total / samples).
Returning ``(loss_sum, num_samples)`` instead trains the mean per sample: the gradient divided
by the batch size, the same under ``accumulate`` and ragged batches, but not the example's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import TrainMetrics, TrainState, accumulate, make_train_step, run
from tests.checkpoint_helpers import assert_same

SAMPLES, BATCH, FEATURES, EPOCHS = 10, 4, 12, 2  # batches of 4, 4 and 2


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(FEATURES, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.fc3, self.fc4 = nn.Linear(3, 8), nn.Linear(8, FEATURES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)  # draws from torch's generator
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def loss_function(recon: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor):
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


def build() -> tuple[VAE, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(1)
    data = torch.rand(SAMPLES, FEATURES)
    model = VAE()
    batches = [data[i : i + BATCH] for i in range(0, SAMPLES, BATCH)]
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), batches


def example_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = model(x)
    return loss_function(recon, x, mu, logvar)


def reference_loop() -> tuple[VAE, list[float]]:
    model, optimizer, batches = build()
    averages = []
    for _ in range(EPOCHS):
        train_loss = 0.0
        for x in batches:
            optimizer.zero_grad()
            loss = example_loss(model, x)
            loss.backward()
            train_loss += loss.item()
            optimizer.step()
        averages.append(train_loss / SAMPLES)
    return model, averages


class EpochAverage:
    """The example's "Average loss" of each epoch, from TrainMetrics' running means."""

    def __init__(self, metrics: TrainMetrics) -> None:
        self.metrics, self.averages = metrics, list[float]()

    def on_epoch_end(self, event: Any) -> None:
        values = self.metrics.read(event)
        self.averages.append(values["loss"] / values["samples"])


def test_vae_equals_the_example_bit_for_bit_with_its_epoch_average() -> None:
    expected, expected_averages = reference_loop()
    model, optimizer, batches = build()

    def loss_fn(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return example_loss(model, x), {"samples": torch.tensor(float(len(x)))}

    metrics = TrainMetrics()
    average = EpochAverage(metrics)
    state = TrainState.create(model=model, optimizer=optimizer)
    run(make_train_step(loss_fn), state, batches, max_epochs=EPOCHS, events=[metrics, average])
    assert_same(model.state_dict(), expected.state_dict())  # bit for bit
    # The example adds the sums in Python floats, TrainMetrics on the device in float32.
    assert average.averages == [pytest.approx(a, rel=1e-6) for a in expected_averages]


def test_a_summed_loss_under_accumulate_is_the_mean_of_the_window_sums() -> None:
    # What docs/migration/README.md says of accumulate(k) with a summed loss: the window's
    # losses are averaged (each micro-batch one target), so the update is the one of
    # (sum_1 + ... + sum_k) / k, not of the big batch's sum; with plain SGD, that is k times
    # the learning rate away from it.
    model, _, batches = build()
    expected = VAE()
    expected.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(expected.parameters(), lr=1e-2)
    rng = torch.get_rng_state()
    for window in (batches[:2], batches[2:]):  # the last window holds one batch
        ref_opt.zero_grad()
        losses = [example_loss(expected, x) for x in window]
        (torch.stack(losses).sum() / len(window)).backward()
        ref_opt.step()
    torch.set_rng_state(rng)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))
    state = run(accumulate(make_train_step(example_loss), 2), state, batches)
    assert state.step == 2
    assert_same(model.state_dict(), expected.state_dict())  # bit for bit

"""pytorch/examples' mnist_forward_forward written with steplib equals the original bit for bit.

The forward-forward algorithm trains no network end to end: each layer has its own Adam and
its own loop of full-batch updates on a local loss (the "goodness" of positive samples above a
threshold, of negative ones below it), then hands its outputs, detached, to the next layer,
which trains the same way. No backward crosses a layer.

With steplib each layer is one ``run``: a state of its own (the layer and its optimizer), the
layer's loss, and the one full batch as the data, for as many epochs as the example's loop
(``max_epochs``). The next layer's batch is the trained layer's outputs, detached, as in the
example. A second form keeps every layer in one state (named optimizers) and runs each
layer's step on that optimizer's lane (``state.with_lane(run(step, state[name], ...))``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from steplib import Events, TrainState, make_train_step, run
from tests.checkpoint_helpers import assert_same

DIMS, EPOCHS, LR, THRESHOLD, LOG_INTERVAL = (20, 16, 12), 30, 0.03, 2.0, 10
Batch = tuple[torch.Tensor, torch.Tensor]  # (x_pos, x_neg)


def overlay_y_on_x(x: torch.Tensor, y: torch.Tensor | int, classes: int = 10) -> torch.Tensor:
    x_ = x.clone()
    x_[:, :classes] *= 0.0
    x_[range(x.shape[0]), y] = x.max()
    return x_


def get_y_neg(y: torch.Tensor) -> torch.Tensor:
    y_neg = y.clone()
    for idx, y_samp in enumerate(y):
        allowed = [label for label in range(10) if label != int(y_samp)]
        y_neg[idx] = torch.tensor(allowed)[torch.randint(len(allowed), size=(1,))].item()
    return y_neg


class Layer(nn.Linear):
    """The example's layer: its forward normalises its input; its optimizer is its own."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=LR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))


def layer_loss(layer: nn.Module, batch: Batch) -> torch.Tensor:
    x_pos, x_neg = batch
    g_pos, g_neg = layer(x_pos).pow(2).mean(1), layer(x_neg).pow(2).mean(1)
    return torch.log1p(torch.exp(torch.cat([-g_pos + THRESHOLD, g_neg - THRESHOLD]))).mean()


def build() -> tuple[list[Layer], Batch, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    layers = [Layer(DIMS[d], DIMS[d + 1]) for d in range(len(DIMS) - 1)]
    x, y = torch.randn(64, DIMS[0]), torch.randint(10, (64,))
    return layers, (overlay_y_on_x(x, y), overlay_y_on_x(x, get_y_neg(y))), x, y


def predict(layers: list[Layer], x: torch.Tensor) -> torch.Tensor:
    goodness_per_label = []
    for label in range(10):
        h, goodness = overlay_y_on_x(x, label), torch.zeros(len(x))
        for layer in layers:
            h = layer(h)
            goodness = goodness + h.pow(2).mean(1)
        goodness_per_label.append(goodness.unsqueeze(1))
    return torch.cat(goodness_per_label, 1).argmax(1)


def reference() -> tuple[list[Layer], list[float], torch.Tensor]:
    layers, (h_pos, h_neg), x, _ = build()
    logged = []
    for layer in layers:  # the example's Net.train, then Layer.train
        for i in range(EPOCHS):
            loss = layer_loss(layer, (h_pos, h_neg))
            layer.opt.zero_grad()
            loss.backward()
            layer.opt.step()
            if i % LOG_INTERVAL == 0:
                logged.append(loss.item())
        h_pos, h_neg = layer(h_pos).detach(), layer(h_neg).detach()
    return layers, logged, predict(layers, x)


def log_every(logged: list[float]) -> Events:
    events = Events()
    # The example prints at i % 10 == 0 (updates 1, 11, 21): step_end's e.step counts from 1.
    events.on(
        "step_end",
        lambda e: logged.append(float(e.output.loss)) if e.step % LOG_INTERVAL == 1 else None,
    )
    return events


def with_steplib() -> tuple[list[Layer], list[float], torch.Tensor]:
    layers, (h_pos, h_neg), x, _ = build()
    logged: list[float] = []
    for layer in layers:  # one run per layer: its own state, optimizer and loop
        state = TrainState.create(model=layer, optimizer=layer.opt)
        run(
            make_train_step(layer_loss),
            state,
            [(h_pos, h_neg)],
            events=log_every(logged),
            max_epochs=EPOCHS,
        )
        with torch.no_grad():
            h_pos, h_neg = layer(h_pos), layer(h_neg)
    return layers, logged, predict(layers, x)


def loss_of(name: str) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """The loss of the layer called ``name`` in the state's ``ModuleDict``."""
    return lambda model, batch: layer_loss(model.get_submodule(name), batch)


def with_one_state() -> tuple[list[Layer], list[float], torch.Tensor]:
    layers, (h_pos, h_neg), x, _ = build()
    logged: list[float] = []
    names = [f"layer{i}" for i in range(len(layers))]
    state = TrainState.create(
        model=dict(zip(names, layers, strict=True)),
        optimizer={name: layer.opt for name, layer in zip(names, layers, strict=True)},
    )
    for name in names:
        # Each step updates its layer's optimizer alone, on that optimizer's lane: the state's
        # own counters are the first layer's, so run counts max_steps on state[name] instead.
        step = make_train_step(loss_of(name), optimizer=name)
        lane = run(step, state[name], [(h_pos, h_neg)], events=log_every(logged), max_steps=EPOCHS)
        state = state.with_lane(lane)
        layer = state.model.get_submodule(name)
        with torch.no_grad():
            h_pos, h_neg = layer(h_pos), layer(h_neg)
    assert state.epoch == len(layers) * EPOCHS  # every layer's passes (one batch each)
    return layers, logged, predict(layers, x)


def test_forward_forward_equals_the_example_bit_for_bit() -> None:
    expected, expected_logged, expected_predicted = reference()
    got, logged, predicted = with_steplib()
    assert len(expected_logged) == len(DIMS[1:]) * EPOCHS // LOG_INTERVAL
    assert logged == expected_logged
    for layer, want in zip(got, expected, strict=True):
        assert_same(layer.state_dict(), want.state_dict())
        assert_same(layer.opt.state_dict(), want.opt.state_dict())
    assert torch.equal(predicted, expected_predicted)


def test_forward_forward_in_one_state_equals_the_example_bit_for_bit() -> None:
    expected, expected_logged, _ = reference()
    got, logged, _ = with_one_state()
    assert logged == expected_logged
    for layer, want in zip(got, expected, strict=True):
        assert_same(layer.state_dict(), want.state_dict())

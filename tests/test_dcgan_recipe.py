"""pytorch/examples' DCGAN (``dcgan/main.py``) written the natural way with steplib equals the
original loop in everything: the parameters, the Adam states, the BatchNorm running statistics
and ``num_batches_tracked``, and every loss (and the D(x), D(G(z)) means it prints).

As in the original, the generator runs once per batch: D's loss returns its ``fake`` as aux and
uses ``fake.detach()``; G's step gets that same ``fake`` (with its graph) through
``run(..., feed={"G": ...})``, so G's loss back-propagates through the forward D's step ran.
A second ``G(noise)`` in G's loss would update G's BatchNorm statistics twice per batch
(``num_batches_tracked`` 2x) and draw other noise.

The data is synthetic and small (64x64 images, 2 channels wide), shuffled by a ``DataLoader``
that draws from the global generator, as the original's does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steplib import Event, Events, TrainState, make_train_step, run

NZ, NGF, NDF, NC, EPOCHS = 4, 2, 2, 3, 2


def weights_init(m: Any) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


def generator() -> nn.Module:
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, NGF * 8, 4, 1, 0, bias=False),
        nn.BatchNorm2d(NGF * 8),
        nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 8, NGF * 4, 4, 2, 1, bias=False),
        nn.BatchNorm2d(NGF * 4),
        nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False),
        nn.BatchNorm2d(NGF * 2),
        nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
        nn.BatchNorm2d(NGF),
        nn.ReLU(True),
        nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False),
        nn.Tanh(),
    )


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, NDF * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1, 1).squeeze(1)


def _setup() -> tuple[DataLoader[Any], nn.Module, nn.Module, Any, Any]:
    """The seed, the data, both models and both optimizers: the same for both loops."""
    torch.manual_seed(0)
    images = torch.rand(24, NC, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    loader = DataLoader(TensorDataset(images), batch_size=4, shuffle=True)
    net_g, net_d = generator(), Discriminator()
    net_g.apply(weights_init)
    net_d.apply(weights_init)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return loader, net_g, net_d, opt_g, opt_d


def _original() -> tuple[list[list[float]], nn.Module, nn.Module, Any, Any]:
    """The training loop of pytorch/examples dcgan/main.py, on the CPU."""
    loader, net_g, net_d, opt_g, opt_d = _setup()
    criterion = nn.BCELoss()
    real_label, fake_label = 1, 0
    printed = []
    for _ in range(EPOCHS):
        for data in loader:
            net_d.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
            output = net_d(real_cpu)
            err_d_real = criterion(output, label)
            err_d_real.backward()
            d_x = output.mean().item()
            noise = torch.randn(batch_size, NZ, 1, 1)
            fake = net_g(noise)
            label.fill_(fake_label)
            output = net_d(fake.detach())
            err_d_fake = criterion(output, label)
            err_d_fake.backward()
            d_g_z1 = output.mean().item()
            err_d = err_d_real + err_d_fake
            opt_d.step()

            net_g.zero_grad()
            label.fill_(real_label)
            output = net_d(fake)
            err_g = criterion(output, label)
            err_g.backward()
            d_g_z2 = output.mean().item()
            opt_g.step()
            printed.append([err_d.item(), err_g.item(), d_x, d_g_z1, d_g_z2])
    return printed, net_g, net_d, opt_g, opt_d


# --- the recipe with steplib ------------------------------------------------------------------

criterion = nn.BCELoss()


def d_loss(model: Any, batch: list[torch.Tensor]) -> Any:
    real = batch[0]
    output = model["D"](real)
    err_real = criterion(output, torch.ones_like(output))
    noise = torch.randn(real.size(0), NZ, 1, 1)
    fake = model["G"](noise)  # the one generator forward of this batch
    fake_output = model["D"](fake.detach())
    err_fake = criterion(fake_output, torch.zeros_like(fake_output))
    aux = {"fake": fake, "D_x": output.mean(), "D_G_z1": fake_output.mean()}
    return err_real + err_fake, aux


def g_loss(model: Any, fake: torch.Tensor) -> Any:
    output = model["D"](fake)  # D as its step just updated it, as in the original
    return criterion(output, torch.ones_like(output)), {"D_G_z2": output.mean()}


def _steplib() -> tuple[list[list[float]], nn.Module, nn.Module, Any, Any]:
    loader, net_g, net_d, opt_g, opt_d = _setup()
    state = TrainState.create(model={"G": net_g, "D": net_d}, optimizer={"G": opt_g, "D": opt_d})
    steps = {
        "D": make_train_step(d_loss, optimizer="D"),
        "G": make_train_step(g_loss, optimizer="G"),
    }
    printed: list[list[float]] = []

    def record(event: Event) -> None:
        assert event.outputs is not None
        d, g = event.outputs["D"], event.outputs["G"]
        printed.append(
            [
                d.loss.item(),
                g.loss.item(),
                d.aux["D_x"].item(),
                d.aux["D_G_z1"].item(),
                g.aux["D_G_z2"].item(),
            ]
        )

    events = Events().on("step_end", record)
    feed = {"G": lambda batch, earlier: earlier["D"]["fake"]}
    run(steps, state, loader, events=events, max_epochs=EPOCHS, feed=feed)
    return printed, net_g, net_d, opt_g, opt_d


def test_dcgan_as_written_with_steplib_equals_the_original_loop_in_everything() -> None:
    expected, *objects = _original()
    printed, *ours = _steplib()
    assert printed == expected  # every loss and mean, bit for bit
    assert len(printed) == 6 * EPOCHS
    for theirs, mine in zip(objects[:2], ours[:2], strict=True):  # parameters and buffers
        their_state, my_state = theirs.state_dict(), mine.state_dict()
        assert list(their_state) == list(my_state)
        for name, tensor in their_state.items():
            assert torch.equal(my_state[name], tensor), name
    # The generator ran once per batch (the original's count), the discriminator three times.
    tracked = [t for n, t in ours[0].state_dict().items() if n.endswith("num_batches_tracked")]
    assert {int(t) for t in tracked} == {6 * EPOCHS}
    tracked = [t for n, t in ours[1].state_dict().items() if n.endswith("num_batches_tracked")]
    assert {int(t) for t in tracked} == {3 * 6 * EPOCHS}
    for theirs, mine in zip(objects[2:], ours[2:], strict=True):  # Adam's moments and steps
        their_state, my_state = theirs.state_dict()["state"], mine.state_dict()["state"]
        assert their_state.keys() == my_state.keys()
        for index, buffers in their_state.items():
            for key, value in buffers.items():
                assert torch.equal(my_state[index][key], value), (index, key)

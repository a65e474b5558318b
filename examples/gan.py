"""A GAN: two named models and optimizers in one state, a step for each, your own loop. The
generator learns to turn noise into samples of N(3, 0.5); both steps accumulate 2 micro-batches
and clip; the checkpoint holds both models, both optimizers and every counter."""

import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.checkpoint import load, save


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def d_loss(model: nn.ModuleDict, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    real, noise = batch
    fake = model["G"](noise).detach()  # this step trains D only
    return bce(model["D"](real), 1.0) + bce(model["D"](fake), 0.0)


def g_loss(model: nn.ModuleDict, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return bce(model["D"](model["G"](batch[1])), 1.0)  # gradients reach G's parameters only


def main(root: str = "runs/gan", micro_batches: int = 600) -> tuple[float, float]:
    sl.seed_everything(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    d = nn.Sequential(nn.Linear(1, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    state = sl.TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.9)),
                   "D": torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.9))},
    )  # fmt: skip
    d_step = sl.clip(sl.accumulate(sl.make_train_step(d_loss, optimizer="D"), 2), max_norm=1.0)
    g_step = sl.clip(sl.accumulate(sl.make_train_step(g_loss, optimizer="G"), 2), max_norm=1.0)
    for i in range(micro_batches):
        batch = (torch.randn(32, 1) * 0.5 + 3, torch.randn(32, 4))
        state, d_out = d_step(state, batch)
        state, g_out = g_step(state, batch)
        if i % 200 == 199:  # a host read, every 100 updates
            print(f"update {state.step}: D {d_out.loss.item():.3f}, G {g_out.loss.item():.3f}")
    state = load(save(state, root), state)  # both optimizers, both counters: state["D"].step
    samples = g(torch.randn(2000, 4)).detach()
    return samples.mean().item(), samples.std().item()


if __name__ == "__main__":
    mean, std = main()
    print(f"generated samples: mean {mean:.2f} (target 3), std {std:.2f} (target 0.5)")

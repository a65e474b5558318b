"""A GAN through `run`: two named models and optimizers in one state, a step for each, run in
order on each batch (D, then G) with every handler: periodic checkpoints of both steps, resume
(also mid-epoch, also after a kill), preemption, an evaluation of the generator with keep-best,
early stopping, a progress bar and a log with each step's loss.

The generator learns to turn noise into samples of N(3, 0.5); both steps accumulate 2
micro-batches and clip. Run it twice: the second run resumes from the newest checkpoint."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset

import steplib as sl
from steplib.checkpoint import preemption
from steplib.events import Batches
from steplib.handlers import Log


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def d_loss(model: nn.ModuleDict, batch: list[torch.Tensor]) -> torch.Tensor:
    real, noise = batch
    fake = model["G"](noise).detach()  # this step trains D only
    return bce(model["D"](real), 1.0) + bce(model["D"](fake), 0.0)


def g_loss(model: nn.ModuleDict, batch: list[torch.Tensor]) -> torch.Tensor:
    return bce(model["D"](model["G"](batch[1])), 1.0)  # gradients reach G's parameters only


def sample_error(model: Any, batch: torch.Tensor) -> torch.Tensor:
    """How far the generated samples' mean and std are from the target's (3, 0.5)."""
    samples = model["G"](batch)
    return (samples.mean() - 3).abs() + (samples.std() - 0.5).abs()


def build(seed: int = 0) -> tuple[dict[str, sl.Step], sl.TrainState, Any]:
    """The steps (by name, in the order they run), the state and a resumable loader."""
    sl.seed_everything(seed)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    d = nn.Sequential(nn.Linear(1, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    state = sl.TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.9)),
                   "D": torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.9))},
    )  # fmt: skip
    d_step = sl.clip(sl.accumulate(sl.make_train_step(d_loss, optimizer="D"), 2), max_norm=1.0)
    g_step = sl.clip(sl.accumulate(sl.make_train_step(g_loss, optimizer="G"), 2), max_norm=1.0)
    data = TensorDataset(torch.randn(3200, 1) * 0.5 + 3, torch.randn(3200, 4))
    return {"D": d_step, "G": g_step}, state, sl.resumable_loader(data, batch_size=32, seed=0)


def main(
    root: str = "runs/gan", epochs: int = 3, handlers: Sequence[Any] = ()
) -> tuple[float, float, sl.TrainState]:
    steps, state, loader = build()
    noise = [torch.randn(500, 4, generator=torch.Generator().manual_seed(1))]
    error = {"error": torchmetrics.MeanMetric()}
    evaluator = sl.Evaluator(
        sl.make_eval_step(sample_error), noise, metrics=error, every=25, monitor="val_error"
    )
    ckpt = sl.checkpoint_every(root, every=25, keep_last=2, keep_best=1, metric=evaluator)
    state = sl.run(
        steps,  # D's step, then G's, on each batch; state.step counts G's updates (its first)
        state,
        loader,
        events=[
            sl.resume_from(ckpt),  # continues from the newest checkpoint, if any
            evaluator,
            sl.EarlyStopping(evaluator, patience=4),
            ckpt,
            preemption(ckpt),  # SIGTERM: save at the next update, then stop
            sl.ProgressBar(every=25),  # "D loss", "G loss"
            Log(sl.JsonlLogger(f"{root}/log.jsonl"), every=Batches(50)),  # D/loss, G/loss
            *handlers,
        ],
        max_epochs=epochs,
    )
    generator: nn.Module = state.model["G"]  # type: ignore[index]
    samples = generator(noise[0]).detach()
    return samples.mean().item(), samples.std().item(), state


if __name__ == "__main__":
    mean, std, _ = main()
    print(f"generated samples: mean {mean:.2f} (target 3), std {std:.2f} (target 0.5)")

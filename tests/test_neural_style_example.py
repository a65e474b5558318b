"""pytorch/examples' fast_neural_style (neural_style/neural_style.py) written with steplib
equals the original loop bit for bit, resumed mid-run too.

Its loss runs a frozen, pretrained VGG (``requires_grad=False``, in eval mode) on the
transformer's output and on the content image; Adam trains the transformer alone. With steplib
both live in one module (so that ``to_device`` and a checkpoint see them), and
``checkpoint_every(..., trainable_only=True)`` keeps the frozen network out of every file: a
digest of it is checked at resume instead. Here the frozen network has a BatchNorm, so a
resume or an evaluation that put it back in train mode would change the numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from steplib import TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, list_checkpoints, resume_from
from steplib.data import resumable_loader
from tests.checkpoint_helpers import assert_same

IMAGES, BATCH, UPDATES, CONTENT_WEIGHT, STYLE_WEIGHT = 12, 3, 8, 1.0, 10.0


class Style(nn.Module):
    """The transformer being trained, and the frozen feature network of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 1)
        )
        norm = nn.BatchNorm2d(5)
        # "Pretrained" statistics, which the train mode would overwrite.
        norm.running_mean, norm.running_var = torch.rand(5) - 0.5, torch.rand(5) + 0.5
        self.vgg = nn.Sequential(nn.Conv2d(3, 5, 3), norm, nn.ReLU())
        self.vgg.requires_grad_(False).eval()


def gram(features: torch.Tensor) -> torch.Tensor:
    b, c, h, w = features.shape
    flat = features.view(b, c, h * w)
    return flat.bmm(flat.transpose(1, 2)) / (c * h * w)


def style_loss(model: Style, x: torch.Tensor, style_gram: torch.Tensor) -> torch.Tensor:
    y = model.transformer(x)
    features_y, features_x = model.vgg(y), model.vgg(x)
    content = CONTENT_WEIGHT * F.mse_loss(features_y, features_x)
    style = STYLE_WEIGHT * F.mse_loss(gram(features_y), style_gram[: len(x)])
    return content + style


def build() -> tuple[Style, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Style()
    images, style = torch.rand(IMAGES, 3, 6, 6), torch.rand(1, 3, 6, 6)
    style_gram = gram(model.vgg(style)).expand(BATCH, -1, -1).detach()
    return model, torch.optim.Adam(model.transformer.parameters(), lr=1e-2), images, style_gram


def reference() -> Style:
    model, optimizer, images, style_gram = build()
    model.transformer.train()  # the example's transformer.train(); the VGG stays as it is
    done = 0
    while done < UPDATES:
        for x in images.split(BATCH):
            optimizer.zero_grad()
            style_loss(model, x, style_gram).backward()
            optimizer.step()
            done += 1
            if done == UPDATES:
                break
    return model


def with_steplib(directory: str, *, stop_at: int | None = None) -> tuple[Style, str | None]:
    model, optimizer, images, style_gram = build()
    state = TrainState.create(model=model, optimizer=optimizer)
    step = make_train_step(lambda m, x: style_loss(model, x, style_gram))  # m is model
    data = resumable_loader(images, batch_size=BATCH, shuffle=False)
    ckpt = checkpoint_every(directory, every=1, keep_last=1, trainable_only=True)
    resume = resume_from(ckpt)
    run(step, state, data, events=[resume, ckpt], max_steps=stop_at or UPDATES)
    return model, resume.loaded


def test_neural_style_with_a_frozen_network_in_the_loss_equals_the_example(tmp_path: Path) -> None:
    expected = reference()
    directory = str(tmp_path / "ckpt")
    with_steplib(directory, stop_at=UPDATES // 2 + 1)  # mid-epoch: 4 batches a pass
    got, loaded = with_steplib(directory)  # a new process's objects, resumed
    assert loaded is not None and loaded.endswith("step-00000005")
    assert_same(got.state_dict(), expected.state_dict())  # bit for bit
    assert not got.vgg.training and got.transformer.training
    (saved,) = list_checkpoints(directory)
    weights = torch.load(Path(directory) / saved.name / "model.pt", weights_only=True)
    frozen = {name for name, p in got.named_parameters() if not p.requires_grad}
    assert frozen and sorted(weights) == sorted(got.state_dict().keys() - frozen)

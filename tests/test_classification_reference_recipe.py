"""The pieces of torchvision's classification reference recipe (references/classification/
train.py) written as its plain loop and with steplib give the same parameters bit for bit,
also resumed in the middle of an epoch:

* label smoothing (``CrossEntropyLoss(label_smoothing=...)``) on mixed soft targets;
* mixup / cutmix as a batch transform in the loader's ``collate_fn``, drawing from a generator
  of its own (with ``state_dict()``, so the loader's position holds it), or from torch's
  global generator as torchvision's ``v2.MixUp`` does (saved by every checkpoint);
* an EMA of the weights (torch's ``AveragedModel``, as torchvision's ``ExponentialMovingAverage``)
  updated every ``k`` batches of an epoch (``i % k == 0``) and restarted (``n_averaged = 0``)
  during the warmup epochs; it averages the buffers too;
* a learning rate warmed up linearly, then cosine, stepped per epoch (``SequentialLR``);
* no weight decay on biases and normalisation layers (torchvision's ``set_weight_decay`` with
  ``norm_weight_decay=0.0`` and ``bias`` at 0.0, steplib's ``weight_decay_groups``);
* an evaluation of the model and of its EMA at each epoch's end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import TensorDataset, default_collate
from torchmetrics import MeanMetric

from steplib import ConfigError, Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.events import Stop
from steplib.handlers import Scheduler
from steplib.param_groups import weight_decay_groups

CLASSES, EPOCHS, WARMUP_EPOCHS, EMA_STEPS, BATCH, WD = 4, 4, 1, 2, 8, 1e-4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU()
        )
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(6, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class MixUpCutMix:
    """torchvision's RandomChoice([MixUp(alpha=1), CutMix(alpha=1)]) for one batch (Beta(1, 1)
    is the uniform distribution), drawing from torch's global generator as ``v2.MixUp`` does."""

    generator: torch.Generator | None = None

    def __call__(self, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = default_collate(samples)
        g = self.generator
        target = F.one_hot(y, CLASSES).float()
        lam = float(torch.rand((), generator=g))
        if torch.rand((), generator=g) < 0.5:  # mixup
            x = x.mul(lam).add(x.roll(1, 0), alpha=1 - lam)
        else:  # cutmix: a box of area (1 - lam) from the rolled batch
            h, w = x.shape[-2:]
            cy, cx = (int(torch.randint(n, (), generator=g)) for n in (h, w))
            ry, rx = int(0.5 * (1 - lam) ** 0.5 * h), int(0.5 * (1 - lam) ** 0.5 * w)
            y0, y1, x0, x1 = max(cy - ry, 0), min(cy + ry, h), max(cx - rx, 0), min(cx + rx, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = x.roll(1, 0)[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
        return x, target.mul(lam).add(target.roll(1, 0), alpha=1 - lam)


class OwnMixUpCutMix(MixUpCutMix):
    """The same from a generator of its own, whose state it gives and takes."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        assert self.generator is not None
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.generator is not None
        self.generator.set_state(state["generator"])


def mixer(seed: int | None) -> MixUpCutMix:
    return MixUpCutMix() if seed is None else OwnMixUpCutMix(seed)


def set_weight_decay(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """torchvision's utils.set_weight_decay(model, wd, norm_weight_decay=0.0,
    custom_keys_weight_decay=[("bias", 0.0)])."""
    norm_classes = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
    params: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], "bias": []}
    decays = {"other": weight_decay, "norm": 0.0, "bias": 0.0}

    def add(module: nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            if name == "bias":
                params["bias"].append(p)
            elif isinstance(module, norm_classes):
                params["norm"].append(p)
            else:
                params["other"].append(p)
        for child in module.children():
            add(child)

    add(model)
    return [{"params": ps, "weight_decay": decays[k]} for k, ps in params.items() if ps]


def ema_of(model: nn.Module) -> AveragedModel:
    """torchvision's ExponentialMovingAverage, with train.py's decay adjustment."""
    alpha = min(1.0, (1.0 - 0.99) * BATCH * EMA_STEPS / EPOCHS)

    def ema_avg(averaged: torch.Tensor, param: torch.Tensor, _: Any) -> torch.Tensor:
        return (1.0 - alpha) * averaged + alpha * param

    return AveragedModel(model, avg_fn=ema_avg, use_buffers=True)


def _setup() -> tuple[TensorDataset, list[Any], Net]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, 8, 8, generator=gen), torch.randint(CLASSES, (40,), generator=gen)
    val = [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(CLASSES, (8,), generator=gen))]
    return TensorDataset(x, y), val, Net()


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=0.1, total_iters=WARMUP_EPOCHS
    )
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS - WARMUP_EPOCHS)
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup, cosine], milestones=[WARMUP_EPOCHS]
    )


criterion = nn.CrossEntropyLoss(label_smoothing=0.1)


def _evaluate(model: nn.Module, val: list[Any]) -> None:
    model.eval()
    with torch.no_grad():
        for image, target in val:
            criterion(model(image), target).item()


def _original(seed: int | None = 7) -> tuple[list[float], nn.Module, nn.Module]:
    """train.py's main() and train_one_epoch(), reduced to what changes the numbers."""
    dataset, val, model = _setup()
    optimizer = torch.optim.SGD(set_weight_decay(model, WD), lr=0.5, momentum=0.9, weight_decay=WD)
    lr_scheduler = _schedule(optimizer)
    model_ema = ema_of(model)
    loader = resumable_loader(dataset, batch_size=BATCH, seed=5, collate_fn=mixer(seed))
    losses = []
    for epoch in range(EPOCHS):
        model.train()
        for i, (image, target) in enumerate(loader):
            output = model(image)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % EMA_STEPS == 0:
                model_ema.update_parameters(model)
                if epoch < WARMUP_EPOCHS:
                    # Reset ema buffer to keep copying weights during warmup period
                    model_ema.n_averaged.fill_(0)
            losses.append(loss.item())
        lr_scheduler.step()
        _evaluate(model, val)
        _evaluate(model_ema, val)
    return losses, model, model_ema


def _steplib(
    url: str | None = None, stop_at: int | None = None, seed: int | None = 7
) -> tuple[list[float], Any, Any]:
    dataset, val, model = _setup()
    optimizer = torch.optim.SGD(weight_decay_groups(model, WD), lr=0.5, momentum=0.9)
    state = TrainState.create(model=model, optimizer=optimizer)
    step = make_train_step(lambda m, b: criterion(m(b[0]), b[1]))
    mix = mixer(seed)
    data = resumable_loader(dataset, batch_size=BATCH, seed=5, collate_fn=mix)
    model_ema = ema_of(model)

    def update_ema(event: Any) -> None:
        if event.batch_index % EMA_STEPS == 0:
            model_ema.update_parameters(model)
            if event.epoch < WARMUP_EPOCHS:
                model_ema.n_averaged.fill_(0)

    def evaluator(model: nn.Module, prefix: str) -> Evaluator:
        return Evaluator(
            make_eval_step(lambda m, b: {"value": criterion(m(b[0]), b[1])}),
            val,
            metrics={"loss": MeanMetric()},
            at_epoch_end=True,
            model=model,
            prefix=prefix,
        )

    losses: list[float] = []
    events = Events().on("step_end", update_ema)
    events.add(Scheduler(_schedule(optimizer)))
    events.add(evaluator(model, "val_")).add(evaluator(model_ema, "ema_val_"))
    events.on("step_end", lambda e: losses.append(float(e.output.loss)))
    if url is not None:
        ckpt = checkpoint_every(url, every=1, data=data, extras={"ema": model_ema})
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
    run(step, state, data, events=events, max_epochs=EPOCHS)
    return losses, model, model_ema


def _same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_the_classification_recipe_with_steplib_equals_its_plain_loop_bit_for_bit() -> None:
    want_losses, want_model, want_ema = _original()
    got_losses, got_model, got_ema = _steplib()
    assert got_losses == want_losses
    _same(got_model, want_model)
    _same(got_ema, want_ema)


@pytest.mark.parametrize(
    ("stop_at", "seed"), [(6, 7), (7, 7), (10, 7), (6, None)]
)  # inside epochs (an EMA update due at the resumed pass's first batch, or not), an epoch's
# last update; mixing from the global generator
def test_the_classification_recipe_resumed_mid_epoch_equals_its_plain_loop(
    tmp_path: Path, stop_at: int, seed: int | None
) -> None:
    want_losses, want_model, want_ema = _original(seed)
    url = str(tmp_path / "ckpt")
    first, _, _ = _steplib(url, stop_at=stop_at, seed=seed)
    rest, got_model, got_ema = _steplib(url, seed=seed)
    assert first + rest == want_losses
    _same(got_model, want_model)
    _same(got_ema, want_ema)


def test_a_collate_fn_with_a_state_is_refused_with_workers() -> None:
    """Each worker calls a copy made anew every epoch: its generator would start over."""
    dataset, _, _ = _setup()
    with pytest.raises(ConfigError, match="num_workers=0"):
        resumable_loader(dataset, batch_size=BATCH, collate_fn=OwnMixUpCutMix(7), num_workers=1)

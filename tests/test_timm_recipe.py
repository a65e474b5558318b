"""timm's ``train.py`` (huggingface/pytorch-image-models, ``train_one_epoch`` and ``main``'s
epoch loop) written as its plain loop and with steplib give the same parameters and the same
EMA weights bit for bit, also resumed mid-epoch and at an epoch's end:

* gradient accumulation as timm does it (``loss /= accum_steps``, the epoch's shorter last
  window divided by what it holds, an update at every epoch's last batch);
* ``clip_grad_norm_`` before each update (``--clip-grad``), with float16 autocast and
  ``NativeScaler`` too (unscale, clip, step, update);
* ``Mixup`` (mixup or cutmix per batch, label smoothing in the mixed targets), drawing from
  numpy's global generator, switched off from ``--mixup-off-epoch``;
* ``CosineLRScheduler`` with a warmup, stepped per update (``step_update(num_updates)``);
* ``ModelEmaV3`` updated after each update with ``step=num_updates`` (its first update copies
  the weights, then its warmup of the decay), averaging parameters and buffers with ``lerp``;
* an evaluation of the model and of its EMA after each epoch, the EMA's top-1 ranking the
  checkpoints, of which ``CheckpointSaver`` keeps the best ``max_history``.

The timm pieces are copied here, reduced to what changes the numbers (timm is no dependency).
"""

from __future__ import annotations

import functools
import math
import operator
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset, default_collate
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    Evaluator,
    Events,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_eval_step,
    make_train_step,
    run,
    seed_everything,
)
from steplib.checkpoint import checkpoint_every, list_checkpoints, resume_from
from steplib.data import resumable_loader
from steplib.events import Stop
from steplib.handlers import EMA, Scheduler
from steplib.param_groups import weight_decay_groups
from tests.checkpoint_helpers import assert_same

CLASSES, BATCH, ACCUM, EPOCHS, WARMUP_EPOCHS, MIXUP_OFF_EPOCH = 4, 8, 2, 4, 1, 3
LR, WD, CLIP, EMA_DECAY, HISTORY = 0.2, 1e-4, 1.0, 0.99, 2
UPDATES_PER_EPOCH = 3  # 5 batches of 8 in windows of 2, 2 and 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU()
        )
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(6, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


# ---- timm, reduced (timm/data/mixup.py: Mixup in mode="batch", correct_lam=True) -------------
class Mixup:
    def __init__(self, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0) -> None:
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix_prob, self.switch_prob, self.label_smoothing = 1.0, 0.5, 0.1
        self.mixup_enabled = True

    def _params_per_batch(self) -> tuple[float, bool]:
        lam, use_cutmix = 1.0, False
        if self.mixup_enabled and np.random.rand() < self.mix_prob:
            use_cutmix = np.random.rand() < self.switch_prob
            lam_mix = (
                np.random.beta(self.cutmix_alpha, self.cutmix_alpha)
                if use_cutmix
                else np.random.beta(self.mixup_alpha, self.mixup_alpha)
            )
            lam = float(lam_mix)
        return lam, bool(use_cutmix)

    def _mix_batch(self, x: torch.Tensor) -> float:
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.0:
            return 1.0
        if use_cutmix:  # rand_bbox + cutmix_bbox_and_lam
            img_h, img_w = x.shape[-2:]
            ratio = np.sqrt(1 - lam)
            cut_h, cut_w = int(img_h * ratio), int(img_w * ratio)
            cy, cx = np.random.randint(0, img_h), np.random.randint(0, img_w)
            yl, yh = np.clip(cy - cut_h // 2, 0, img_h), np.clip(cy + cut_h // 2, 0, img_h)
            xl, xh = np.clip(cx - cut_w // 2, 0, img_w), np.clip(cx + cut_w // 2, 0, img_w)
            lam = 1.0 - float((yh - yl) * (xh - xl)) / float(img_h * img_w)
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
        else:
            x_flipped = x.flip(0).mul_(1.0 - lam)
            x.mul_(lam).add_(x_flipped)
        return lam

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lam = self._mix_batch(x)
        off = self.label_smoothing / CLASSES
        on = 1.0 - self.label_smoothing + off
        y1 = torch.full((len(target), CLASSES), off).scatter_(1, target.view(-1, 1), on)
        y2 = torch.full((len(target), CLASSES), off).scatter_(1, target.flip(0).view(-1, 1), on)
        return x, y1 * lam + y2 * (1.0 - lam)


def soft_target_cross_entropy(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """timm/loss/cross_entropy.py: SoftTargetCrossEntropy."""
    return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


class CosineLRScheduler:
    """timm/scheduler/cosine_lr.py with scheduler.py's step / step_update, one cycle, no noise."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        t_initial: int,
        warmup_t: int,
        warmup_lr_init: float,
        t_in_epochs: bool,
    ) -> None:
        self.optimizer, self.t_initial, self.t_in_epochs = optimizer, t_initial, t_in_epochs
        self.warmup_t, self.warmup_lr_init, self.lr_min = warmup_t, warmup_lr_init, 0.0
        self.base_values = [group["lr"] for group in optimizer.param_groups]
        self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
        self.update_groups([warmup_lr_init] * len(self.base_values))

    def _get_lr(self, t: int) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        i = t // self.t_initial
        t_curr = t - self.t_initial * i
        if i >= 1:  # cycle_limit=1
            return [self.lr_min for _ in self.base_values]
        return [
            self.lr_min
            + 0.5 * (v - self.lr_min) * (1 + math.cos(math.pi * t_curr / self.t_initial))
            for v in self.base_values
        ]

    def step(self, epoch: int, metric: float | None = None) -> None:
        if self.t_in_epochs:
            self.update_groups(self._get_lr(epoch))

    def step_update(self, num_updates: int, metric: float | None = None) -> None:
        if not self.t_in_epochs:
            self.update_groups(self._get_lr(num_updates))

    def update_groups(self, values: list[float]) -> None:
        for group, value in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = value

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)


class ModelEmaV3(nn.Module):
    """timm/utils/model_ema.py: ModelEmaV3 (foreach, exclude_buffers=False)."""

    def __init__(self, model: nn.Module, *, decay: float, use_warmup: bool) -> None:
        super().__init__()
        self.module = deepcopy(model).eval()
        self.decay, self.min_decay, self.update_after_step = decay, 0.0, 0
        self.use_warmup, self.warmup_gamma, self.warmup_power = use_warmup, 1.0, 2 / 3

    def get_decay(self, step: int) -> float:
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            return max(min(decay, self.decay), self.min_decay)
        return self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        decay = self.get_decay(step)
        ema_lerp, model_lerp = [], []
        for ema_v, model_v in zip(
            self.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            if ema_v.is_floating_point():
                ema_lerp.append(ema_v)
                model_lerp.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp, model_lerp, weight=1.0 - decay)


class CheckpointSaver:
    """timm/utils/checkpoint_saver.py: which epochs' checkpoint files save_checkpoint keeps."""

    def __init__(self, *, decreasing: bool, max_history: int) -> None:
        self.checkpoint_files: list[tuple[int, float]] = []  # (epoch, metric), best first
        self.decreasing, self.max_history = decreasing, max_history
        self.cmp = operator.lt if decreasing else operator.gt

    def save_checkpoint(self, epoch: int, metric: float) -> None:
        worst = self.checkpoint_files[-1] if self.checkpoint_files else None
        if len(self.checkpoint_files) < self.max_history or self.cmp(metric, worst[1]):  # type: ignore[index]
            if len(self.checkpoint_files) >= self.max_history:
                self.checkpoint_files = self.checkpoint_files[: self.max_history - 1]
            self.checkpoint_files.append((epoch, metric))
            self.checkpoint_files.sort(key=lambda x: x[1], reverse=not self.decreasing)


def ema_decay(n: int) -> float:
    """ModelEmaV3.get_decay(n) with update_after_step=0 and use_warmup=True, for steplib's EMA:
    the first update copies the weights, then 1 - (1 + t) ** -2/3 up to the decay."""
    t = n - 1
    return 0.0 if t <= 0 else min(1 - (1 + t) ** (-2 / 3), EMA_DECAY)


# ---- the run ----------------------------------------------------------------------------------
def _setup() -> tuple[TensorDataset, list[Any], Net]:
    seed_everything(0)  # random, numpy (Mixup's generator) and torch
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, 8, 8, generator=gen), torch.randint(CLASSES, (40,), generator=gen)
    val = [(torch.randn(16, 3, 8, 8, generator=gen), torch.randint(CLASSES, (16,), generator=gen))]
    return TensorDataset(x, y), val, Net()


def _top1(model: nn.Module, val: list[Any]) -> float:
    """train.py's validate(): the top-1 accuracy in percent."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for image, target in val:
            correct += int((model(image).argmax(-1) == target).sum())
            total += len(target)
    return 100.0 * correct / total


def _schedule(optimizer: torch.optim.Optimizer, per_update: bool) -> CosineLRScheduler:
    """create_scheduler_v2(sched="cosine", sched_on_updates=...): with it, epochs in updates."""
    unit = UPDATES_PER_EPOCH if per_update else 1
    return CosineLRScheduler(
        optimizer,
        t_initial=EPOCHS * unit,
        warmup_t=WARMUP_EPOCHS * unit,
        warmup_lr_init=1e-3,
        t_in_epochs=not per_update,
    )


def _sgd(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, nesterov=True)  # timm's "sgd"


def _param_groups_weight_decay(model: nn.Module) -> list[dict[str, Any]]:
    """timm/optim/_param_groups.py: no weight decay on 1-d parameters and biases."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": WD}]


@functools.cache  # the tests compare with it, never change it
def _timm(per_update: bool = True, amp: bool = False) -> dict[str, Any]:
    """train.py's main() and train_one_epoch(), reduced to what changes the numbers; with
    ``amp``, float16 autocast and timm/utils/cuda.py's NativeScaler (on CPU here)."""
    dataset, val, model = _setup()
    amp_autocast = partial(torch.autocast, "cpu", dtype=torch.float16, enabled=amp)
    loss_scaler = torch.amp.GradScaler("cpu") if amp else None
    optimizer = _sgd(_param_groups_weight_decay(model))
    model_ema = ModelEmaV3(model, decay=EMA_DECAY, use_warmup=True)
    mixup_fn = Mixup()
    loader = resumable_loader(dataset, batch_size=BATCH, seed=5)
    lr_scheduler = _schedule(optimizer, per_update)
    saver = CheckpointSaver(decreasing=False, max_history=HISTORY)  # eval_metric "top1"
    for epoch in range(EPOCHS):
        if epoch >= MIXUP_OFF_EPOCH:
            mixup_fn.mixup_enabled = False
        model.train()
        accum_steps = ACCUM
        last_accum_steps = len(loader) % accum_steps
        num_updates = epoch * UPDATES_PER_EPOCH
        last_batch_idx = len(loader) - 1
        last_batch_idx_to_accum = len(loader) - last_accum_steps
        optimizer.zero_grad()
        for batch_idx, (input, target) in enumerate(loader):
            last_batch = batch_idx == last_batch_idx
            need_update = last_batch or (batch_idx + 1) % accum_steps == 0
            if batch_idx >= last_batch_idx_to_accum:
                accum_steps = last_accum_steps
            input, target = mixup_fn(input, target)
            with amp_autocast():
                loss = soft_target_cross_entropy(model(input), target)
            if accum_steps > 1:
                loss /= accum_steps
            if loss_scaler is not None:  # NativeScaler.__call__
                loss_scaler.scale(loss).backward()
                if need_update:
                    loss_scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    loss_scaler.step(optimizer)
                    loss_scaler.update()
            else:
                loss.backward()
                if need_update:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
            if not need_update:
                continue
            num_updates += 1
            optimizer.zero_grad()
            model_ema.update(model, step=num_updates)
            lr_scheduler.step_update(num_updates=num_updates)
        _top1(model, val)
        metric = _top1(model_ema.module, val)  # with an EMA, its metrics rank the checkpoints
        saver.save_checkpoint(epoch, metric=metric)
        lr_scheduler.step(epoch + 1, metric)
    return {"model": model, "ema": model_ema.module, "kept": saver}


def _steplib(
    url: str | None = None,
    stop_at: int | None = None,
    per_update: bool = True,
    mix_in_loader: bool = False,
    amp: bool = False,
) -> dict[str, Any]:
    dataset, val, model = _setup()
    optimizer = _sgd(weight_decay_groups(model, WD))
    scaler = torch.amp.GradScaler("cpu") if amp else None
    state = TrainState.create(model=model, optimizer=optimizer, scaler=scaler)
    mixup_fn = Mixup()

    def mixed(samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return mixup_fn(*default_collate(samples))  # timm's FastCollateMixup's place

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        input, target = batch if mix_in_loader else mixup_fn(*batch)
        return soft_target_cross_entropy(m(input), target)

    step = accumulate(clip(make_train_step(loss_fn), max_norm=CLIP), ACCUM)
    if amp:
        step = amp_wrap(step, dtype=torch.float16)
    collate = mixed if mix_in_loader else default_collate
    data = resumable_loader(dataset, batch_size=BATCH, seed=5, collate_fn=collate)
    lr_scheduler = _schedule(optimizer, per_update)
    ema = EMA(model, decay=ema_decay, average_buffers=True)

    def mixup_off(event: Any) -> None:
        mixup_fn.mixup_enabled = event.state.epoch < MIXUP_OFF_EPOCH

    def evaluator(model: nn.Module, prefix: str) -> Evaluator:
        def top1(m: nn.Module, b: Any) -> dict[str, torch.Tensor]:
            return {"value": (m(b[0]).argmax(-1) == b[1]).float() * 100.0}

        return Evaluator(
            make_eval_step(top1),
            val,
            metrics={"top1": MeanMetric()},
            at_epoch_end=True,
            model=model,
            prefix=prefix,
            monitor=f"{prefix}top1",
            mode="max",
        )

    events = Events().on("fit_start", mixup_off).on("epoch_start", mixup_off)
    events.add(ema)
    # where train.py calls them (one acts, by t_in_epochs); e.epoch: the epochs completed
    events.on("step_end", lambda e: lr_scheduler.step_update(num_updates=e.step))
    events.on("epoch_end", lambda e: lr_scheduler.step(e.epoch))
    ema_eval = evaluator(ema.module, "ema_val_")  # with an EMA, timm ranks by its metric
    events.add(evaluator(model, "val_")).add(ema_eval)
    if url is not None:
        ckpt = checkpoint_every(
            url,
            every=2,
            at_epoch_end=True,
            keep_last=1,
            keep_best=HISTORY,
            metric=ema_eval,
            data=data,
        )
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
    run(step, state, data, events=events, max_epochs=EPOCHS)
    return {"model": model, "ema": ema.module}


def _same(a: nn.Module, b: nn.Module) -> None:
    assert_same(a.state_dict(), b.state_dict())


@pytest.mark.parametrize(("per_update", "amp"), [(True, False), (False, False), (True, True)])
def test_timms_train_loop_with_steplib_equals_it_bit_for_bit(per_update: bool, amp: bool) -> None:
    """``amp``: float16 with timm's NativeScaler (unscale, clip, step, update) is amp_wrap's."""
    want, got = _timm(per_update, amp), _steplib(per_update=per_update, amp=amp)
    _same(got["model"], want["model"])
    _same(got["ema"], want["ema"])


def _kept(url: str) -> list[int]:
    """The epochs (0-based, as timm names checkpoint-{epoch}.pth.tar) of the ranked checkpoints
    kept, best first."""
    ranked = [c for c in list_checkpoints(url) if "ema_val_top1" in c.metrics]
    ranked.sort(key=lambda c: -c.metrics["ema_val_top1"])  # stable: the older of a tie first
    return [c.epoch - 1 for c in ranked]


@pytest.mark.parametrize(
    ("stop_at", "per_update", "mix_in_loader"),
    [
        (4, True, False),
        (6, True, False),
        (10, True, False),
        (4, False, False),
        (6, False, False),
        (4, True, True),
        (10, True, True),
    ],
)  # mid-epoch, an epoch's last update, after mixup was switched off (epoch 3: a resumed epoch
# has no epoch_start); the learning rate stepped per update or per epoch; mixup in the loss or
# in the loader's collate_fn (numpy's global generator, saved by the checkpoint, either way)
def test_timms_train_loop_resumed_equals_it_uninterrupted(
    tmp_path: Path, stop_at: int, per_update: bool, mix_in_loader: bool
) -> None:
    want = _timm(per_update)
    url = str(tmp_path / "ckpt")
    _steplib(url, stop_at=stop_at, per_update=per_update, mix_in_loader=mix_in_loader)
    got = _steplib(url, per_update=per_update, mix_in_loader=mix_in_loader)
    _same(got["model"], want["model"])
    _same(got["ema"], want["ema"])
    # timm's checkpoint-{epoch} files are the best HISTORY; its last.pth.tar, the newest
    kept = _kept(url)
    assert kept[:HISTORY] == [epoch for epoch, _ in want["kept"].checkpoint_files]
    assert set(kept[HISTORY:]) <= {EPOCHS - 1}


def test_a_timm_scheduler_in_the_state_or_a_scheduler_handler_is_refused_when_built() -> None:
    """Its step(epoch) needs the count, which neither passes: it failed with a TypeError at
    the first update (the state's), or at the first epoch's end (the handler's)."""
    model = Net()
    optimizer = _sgd(model.parameters())
    timm_scheduler = _schedule(optimizer, per_update=False)
    with pytest.raises(ConfigError, match=r"step\(\) needs epoch: .*step_update"):
        TrainState.create(model=model, optimizer=optimizer, scheduler=timm_scheduler)
    with pytest.raises(ConfigError, match=r"step\(\) needs epoch: .*lambda e: scheduler\.step"):
        Scheduler(timm_scheduler)

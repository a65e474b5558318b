"""facebookresearch/moco's ``main_moco.py`` (MoCo v1/v2: a query encoder trained by SGD, a key
encoder that follows it by momentum, a queue of keys, InfoNCE with a temperature, a per-epoch
cosine or step schedule) written as its plain loop and with steplib gives the same encoders, the
same queue and pointer, the same optimizer state and the same losses, bit for bit, also killed
and resumed in new objects inside an epoch, at an epoch's end and after the queue wrapped.

The ``MoCo`` module below is a port of ``moco/builder.py`` (written here, not copied) on a tiny
encoder: the momentum update of the key encoder at the start of each forward, the keys'
batch shuffle for batch norm (``randperm`` from the global generator; across ranks under DDP),
``concat_all_gather`` of the keys before they replace the oldest in the queue, logits over the
positive key and the queue divided by ``T``. With steplib the module is the model, as it is in
``main_moco.py``: ``loss_fn`` is the example's ``criterion(*model(im_q, im_k))``, the queue and
its pointer are buffers and the key encoder is frozen parameters of the model, so a checkpoint
holds them without their being named. The schedule is ``Scheduler(LambdaLR(...))`` or
``Scheduler(MultiStepLR(...))`` stepped per epoch, the example's ``adjust_learning_rate``.
The recipe: docs/migration/README.md, "Momentum contrast (MoCo)".
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, MultiStepLR
from torch.utils.data import Dataset

from steplib import Events, TrainState, make_train_step, run, seed_everything
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.events import Stop
from steplib.handlers import Scheduler
from tests.checkpoint_helpers import assert_same

DIM, QUEUE, MOMENTUM_K, TEMPERATURE = 8, 40, 0.99, 0.2  # --moco-dim, -k, -m, -t (scaled down)
LR, MOMENTUM, WEIGHT_DECAY, SCHEDULE = 0.03, 0.9, 1e-4, [2, 3]  # --lr, --momentum, --wd
BATCH, SAMPLES, EPOCHS = 8, 52, 4  # 6 updates an epoch (drop_last), 24 in all
UPDATES = SAMPLES // BATCH


def concat_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """builder.py's ``concat_all_gather`` (no gradient); one process: the tensor itself."""
    if not dist.is_initialized():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


class Encoder(nn.Module):
    """A tiny stand-in for the ResNet: a body with batch norm and an ``fc`` head (``--mlp``
    replaces it by an MLP, as builder.py does)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.fc: nn.Module = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class MoCo(nn.Module):
    """builder.py's ``MoCo(base_encoder, dim, K, m, T, mlp=True)``."""

    def __init__(self, dim: int = DIM, k: int = QUEUE, m: float = MOMENTUM_K) -> None:
        super().__init__()
        self.k, self.m, self.t = k, m, TEMPERATURE
        self.encoder_q, self.encoder_k = Encoder(dim), Encoder(dim)
        for encoder in (self.encoder_q, self.encoder_k):  # --mlp (MoCo v2)
            encoder.fc = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), encoder.fc)
        for q, k_ in zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True):
            k_.data.copy_(q.data)
            k_.requires_grad = False  # updated by momentum, not by gradient
        self.register_buffer("queue", F.normalize(torch.randn(dim, k), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self) -> None:
        for q, k_ in zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True):
            k_.data = k_.data * self.m + q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        keys = concat_all_gather(keys)
        n = keys.shape[0]
        ptr = int(self.queue_ptr)  # a host read, as in builder.py
        assert self.k % n == 0
        self.queue[:, ptr : ptr + n] = keys.T
        self.queue_ptr[0] = (ptr + n) % self.k

    @torch.no_grad()
    def _batch_shuffle(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = concat_all_gather(x)
        ranks = gathered.shape[0] // x.shape[0]
        shuffle = torch.randperm(gathered.shape[0])
        if dist.is_initialized():
            dist.broadcast(shuffle, src=0)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return gathered[shuffle.view(ranks, -1)[rank]], torch.argsort(shuffle)

    @torch.no_grad()
    def _batch_unshuffle(self, x: torch.Tensor, unshuffle: torch.Tensor) -> torch.Tensor:
        gathered = concat_all_gather(x)
        ranks = gathered.shape[0] // x.shape[0]
        rank = dist.get_rank() if dist.is_initialized() else 0
        return gathered[unshuffle.view(ranks, -1)[rank]]

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, unshuffle = self._batch_shuffle(im_k)
            k = F.normalize(self.encoder_k(im_k), dim=1)
            k = self._batch_unshuffle(k, unshuffle)
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", q, self.queue.clone().detach())
        logits = torch.cat([l_pos, l_neg], dim=1) / self.t
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


class TwoCrops(Dataset[tuple[list[torch.Tensor], int]]):
    """``ImageFolder`` with ``TwoCropsTransform``: two random views of each sample, drawn from
    the global generator when the sample is loaded (as torchvision's transforms draw)."""

    def __init__(self) -> None:
        self.data = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        x = self.data[i]
        views = [x * (1 + 0.2 * torch.randn(6)) + 0.1 * torch.randn(6) for _ in range(2)]
        return views, 0


def cosine(epoch: int) -> float:
    """``adjust_learning_rate``'s ``--cos`` factor: ``lr *= 0.5 * (1 + cos(pi * e / E))``."""
    return 0.5 * (1.0 + math.cos(math.pi * epoch / EPOCHS))


def adjust_learning_rate(optimizer: torch.optim.Optimizer, epoch: int, cos: bool) -> None:
    """main_moco.py's, as written there."""
    lr = LR
    if cos:
        lr *= cosine(epoch)
    else:
        for milestone in SCHEDULE:
            lr *= 0.1 if epoch >= milestone else 1.0
    for group in optimizer.param_groups:
        group["lr"] = lr


def _setup() -> tuple[MoCo, torch.optim.Optimizer, Any]:
    seed_everything(0)
    model = MoCo()
    optimizer = torch.optim.SGD(
        model.parameters(), LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    return model, optimizer, resumable_loader(TwoCrops(), batch_size=BATCH, seed=3, drop_last=True)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    images, _ = batch
    output, target = model(im_q=images[0], im_k=images[1])
    return F.cross_entropy(output, target)


@functools.cache  # the tests compare with it, never change it
def _plain(cos: bool) -> dict[str, Any]:
    """main_moco.py's ``main_worker`` and ``train`` (one process; the loader: steplib's
    shuffled one, for the order)."""
    model, optimizer, loader = _setup()
    losses, lrs = [], []
    for epoch in range(EPOCHS):
        adjust_learning_rate(optimizer, epoch, cos)
        model.train()
        for images, target in loader:
            loss = loss_fn(model, (images, target))
            losses.append(loss.detach())
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {"model": model, "optimizer": optimizer, "losses": losses, "lrs": lrs}


def _steplib(cos: bool, url: str | None = None, stop_at: int | None = None) -> dict[str, Any]:
    model, optimizer, loader = _setup()
    schedule = LambdaLR(optimizer, cosine) if cos else MultiStepLR(optimizer, SCHEDULE, gamma=0.1)
    events = Events(Scheduler(schedule))
    if url is not None:
        ckpt = checkpoint_every(url, every=5)
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("killed") if e.step == stop_at else None)
    losses: list[torch.Tensor] = []
    lrs: list[float] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    events.on("step_end", lambda e: lrs.append(float(e.output.lr)))
    state = TrainState.create(model=model, optimizer=optimizer)
    run(make_train_step(loss_fn), state, loader, events=events, max_epochs=EPOCHS)
    return {"model": model, "optimizer": optimizer, "losses": losses, "lrs": lrs}


def _same(got: dict[str, Any], want: dict[str, Any], first: int = 0) -> None:
    # both encoders, their batch-norm statistics, the queue and its pointer
    assert_same(got["model"].state_dict(), want["model"].state_dict())
    # the momentum buffers; the rates of each update (after the last epoch the scheduler has
    # set the next epoch's, which the loop sets only when it starts one)
    assert_same(got["optimizer"].state_dict()["state"], want["optimizer"].state_dict()["state"])
    assert_same(got["losses"], want["losses"][first:])
    assert got["lrs"] == want["lrs"][first:]


@pytest.mark.parametrize("cos", [True, False])
def test_moco_loop_with_steplib_equals_it_bit_for_bit(cos: bool) -> None:
    want = _plain(cos)
    assert int(want["model"].queue_ptr) == EPOCHS * UPDATES * BATCH % QUEUE  # it wrapped
    _same(_steplib(cos), want)


@pytest.mark.parametrize(("stop_at", "cos"), [(4, True), (6, True), (13, False), (17, True)])
# inside the first epoch (before the queue wrapped); at the first epoch's end (the schedule
# stepped); inside the third (after a step-schedule milestone); inside the last
def test_moco_loop_killed_and_resumed_equals_it_uninterrupted(
    tmp_path: Path, stop_at: int, cos: bool
) -> None:
    url = str(tmp_path / "ckpt")
    _steplib(cos, url, stop_at=stop_at)
    _same(_steplib(cos, url), _plain(cos), first=stop_at)

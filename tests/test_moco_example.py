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
The recipe: docs/migration/README.md, "A momentum encoder and a queue of keys (MoCo)".
"""

from __future__ import annotations

import contextlib
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
from steplib.distributed import apply_ddp
from steplib.handlers import EMA, Scheduler
from steplib.step import ddp_wrap
from steplib.testing import assert_no_host_sync, run_ranks
from tests.checkpoint_helpers import (
    KilledError,
    assert_same,
    assert_same_on_ranks,
    assert_same_run,
    record_and_kill,
)

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

    queue: torch.Tensor  # buffers
    queue_ptr: torch.Tensor

    def __init__(self, dim: int = DIM, k: int = QUEUE, m: float = MOMENTUM_K) -> None:
        super().__init__()
        self.k, self.m, self.t = k, m, TEMPERATURE
        self.encoder_q: nn.Module = Encoder(dim)
        self.encoder_k: nn.Module = Encoder(dim)
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


class DeviceQueueMoCo(MoCo):
    """The enqueue without builder.py's host read of the pointer (on a GPU, a wait for every
    queued kernel each step): the same copies, indexed on the device."""

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        keys = concat_all_gather(keys)
        n = keys.shape[0]
        assert self.k % n == 0  # no wrap inside a batch
        self.queue.index_copy_(1, self.queue_ptr + torch.arange(n), keys.T)
        self.queue_ptr.copy_((self.queue_ptr + n) % self.k)


class EmaKeyMoCo(MoCo):
    """The key encoder as steplib's ``EMA`` of the query encoder (``ema.module``), averaged
    by the handler after each update instead of by the forward before the keys."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = EMA(self.encoder_q, decay=MOMENTUM_K)
        self.encoder_k = self.ema.module

    def _momentum_update_key_encoder(self) -> None:
        pass


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


def _setup(world: int = 1, moco: type[MoCo] = MoCo) -> tuple[MoCo, torch.optim.Optimizer, Any]:
    """The model, the optimizer and the loader; on ``world`` ranks each loads its share of
    the epoch (DistributedSampler's), ``--batch-size`` divided among them."""
    seed_everything(0)
    model = moco()
    optimizer = torch.optim.SGD(
        model.parameters(), LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    loader = resumable_loader(
        TwoCrops(), batch_size=BATCH // world, seed=3, drop_last=True, shard=world > 1
    )
    return model, optimizer, loader


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    images, _ = batch
    output, target = model(im_q=images[0], im_k=images[1])
    return F.cross_entropy(output, target)


def _result(model: nn.Module, optimizer: Any, losses: list[Any], lrs: list[float]) -> Any:
    """Copies (``run_ranks`` sends results back with ``torch.save``)."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict()["state"],
        "losses": [loss.clone() for loss in losses],
        "lrs": lrs,
    }


@functools.cache  # the tests compare with it, never change it
def _plain(cos: bool, world: int = 1) -> dict[str, Any]:
    """main_moco.py's ``main_worker`` and ``train`` (the loader: steplib's shuffled one, for
    the order); on ranks, the model in ``DistributedDataParallel``."""
    model, optimizer, loader = _setup(world)
    net: Any = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    losses, lrs = [], []
    for epoch in range(EPOCHS):
        adjust_learning_rate(optimizer, epoch, cos)
        net.train()
        for images, target in loader:
            loss = loss_fn(net, (images, target))
            losses.append(loss.detach())
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return _result(model, optimizer, losses, lrs)


def _steplib(
    cos: bool, url: str | None = None, kill_at: int | None = None, world: int = 1
) -> dict[str, Any]:
    model, optimizer, loader = _setup(world)
    net: Any = apply_ddp(model) if world > 1 else model
    schedule = LambdaLR(optimizer, cosine) if cos else MultiStepLR(optimizer, SCHEDULE, gamma=0.1)
    events = Events(Scheduler(schedule))
    if url is not None:
        ckpt = checkpoint_every(url, every=5)
        events.add(resume_from(ckpt)).add(ckpt)
    resumed, losses, lrs = record_and_kill(events, kill_at)
    state = TrainState.create(model=net, optimizer=optimizer)
    step = make_train_step(loss_fn)
    with contextlib.suppress(KilledError):
        run(ddp_wrap(step) if world > 1 else step, state, loader, events=events, max_epochs=EPOCHS)
    return {**_result(model, optimizer, losses, lrs), "resumed": resumed[0]}


@pytest.mark.parametrize("cos", [True, False])
def test_moco_loop_with_steplib_equals_it_bit_for_bit(cos: bool) -> None:
    want = _plain(cos)
    assert int(want["model"]["queue_ptr"]) == EPOCHS * UPDATES * BATCH % QUEUE  # it wrapped
    assert_same_run(_steplib(cos), want)


@pytest.mark.parametrize(("kill_at", "cos"), [(4, True), (8, True), (14, False), (22, True)])
# inside the first epoch, before any save (a fresh start); after the first epoch's end (the
# schedule stepped) and the queue's first wrap; inside the third epoch (a step-schedule
# milestone passed); inside the last; each resumed from the last save (every 5 updates)
def test_moco_loop_killed_and_resumed_equals_it_uninterrupted(
    tmp_path: Path, kill_at: int, cos: bool
) -> None:
    url = str(tmp_path / "ckpt")
    _steplib(cos, url, kill_at=kill_at)
    resumed = _steplib(cos, url)
    assert resumed["resumed"] == kill_at // 5 * 5
    assert_same_run(resumed, _plain(cos))


def _ranks(fn: Any) -> list[dict[str, Any]]:
    return run_ranks(fn, world=2)


def test_moco_under_ddp_with_steplib_equals_its_ddp_loop() -> None:
    """2 gloo ranks: keys gathered from both before the enqueue, the key batch shuffled
    across them for batch norm (``apply_ddp`` + ``ddp_wrap``)."""
    want = _ranks(functools.partial(_plain_on_ranks, cos=True))
    assert not torch.equal(want[0]["losses"][0], want[1]["losses"][0])  # each rank its own
    assert_same_on_ranks(_ranks(functools.partial(_steplib_on_ranks, cos=True)), want)


def test_moco_under_ddp_killed_and_resumed_equals_it_uninterrupted(tmp_path: Path) -> None:
    """Killed at update 13 and resumed from update 10 in new processes."""
    url = str(tmp_path / "ckpt")
    want = _ranks(functools.partial(_plain_on_ranks, cos=True))
    _ranks(functools.partial(_steplib_on_ranks, cos=True, url=url, kill_at=13))
    got = _ranks(functools.partial(_steplib_on_ranks, cos=True, url=url))
    assert [rank["resumed"] for rank in got] == [10, 10]
    assert_same_on_ranks(got, want)


def _plain_on_ranks(rank: int, world: int, *, cos: bool) -> dict[str, Any]:
    return _plain(cos, world=world)


def _steplib_on_ranks(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    return _steplib(world=world, **kwargs)


def test_the_pointers_host_read_is_found_and_the_device_enqueue_is_the_same() -> None:
    """builder.py reads the queue's pointer on the host inside the step (``int(queue_ptr)``):
    ``assert_no_host_sync`` names that line; the enqueue indexed on the device reads nothing
    and trains the same bits."""
    model, optimizer, loader = _setup()
    state = TrainState.create(model=model, optimizer=optimizer)
    with pytest.raises(AssertionError, match=r"__int__.*int\(self\.queue_ptr\)"):
        assert_no_host_sync(make_train_step(loss_fn), state, list(loader))
    model, optimizer, loader = _setup(moco=DeviceQueueMoCo)
    state = TrainState.create(model=model, optimizer=optimizer)
    step = make_train_step(loss_fn)
    for epoch in range(EPOCHS):
        adjust_learning_rate(optimizer, epoch, cos=True)
        state = assert_no_host_sync(step, state, loader)
    assert_same(model.state_dict(), _plain(True)["model"])


@pytest.mark.parametrize("train_mode", [False, True])
def test_steplibs_ema_as_the_key_encoder_is_not_mocos(train_mode: bool) -> None:
    """What the recipe's page says: ``EMA``'s module is an average to evaluate, in eval mode
    (batch norm on running statistics: the keys change) and averaged after each update with
    ``lerp``; builder.py's key encoder trains in train mode and is averaged before each
    forward (its first average, before any update, is not a no-op in floating point), so it
    ends one average behind."""
    want = _plain(True)
    model, optimizer, loader = _setup(moco=EmaKeyMoCo)
    assert isinstance(model, EmaKeyMoCo)
    model.encoder_k.train(train_mode)
    events = Events(Scheduler(LambdaLR(optimizer, cosine)), model.ema)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    state = TrainState.create(model=model, optimizer=optimizer)
    run(make_train_step(loss_fn), state, loader, events=events, max_epochs=EPOCHS)

    def apart(prefix: str) -> float:
        got = model.state_dict()
        return max(
            float((got[k] - v).abs().max())
            for k, v in want["model"].items()
            if k.startswith(prefix) and v.is_floating_point() and "running" not in k
        )

    loss_apart = max(float((a - b).abs()) for a, b in zip(losses, want["losses"], strict=True))
    if not train_mode:  # 0.84 in the losses, 0.24 in the query encoder
        assert loss_apart > 0.1 and apart("encoder_q") > 0.1
    else:  # the same training up to rounding (1e-6), the key encoder an average ahead (3e-3)
        assert 0 < loss_apart < 1e-5 and 0 < apart("encoder_q") < 1e-5
        assert apart("encoder_k") > 1e-3

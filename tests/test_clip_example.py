"""mlfoundations/open_clip's ``train_one_epoch`` (two towers trained by AdamW on the symmetric
cross-entropy of their normalised features' similarities, scaled by a learnt temperature
clamped at 100 after each update) written as its plain loop and with steplib gives the same
parameters, optimizer state and losses, bit for bit, also killed and resumed in new objects,
and on 2 gloo ranks (the model in DDP, every rank's features gathered into one loss).

What the port keeps of open_clip (written here, not copied): ``ClipLoss`` without
``local_loss``, its features gathered from every rank, the rate set by hand before each update
by ``cosine_lr``'s warm-up then cosine (a numpy number: written as a float with steplib, whose
checkpoints refuse numpy scalars), no weight decay on gains, biases and ``logit_scale``,
``clip_grad_norm_`` over every parameter, and ``logit_scale.clamp_(0, ln 100)`` after the
optimizer step. With steplib, the rate and the clamp are one ``tap(before_update=...,
after_update=...)``, the clipping ``clip``.

Three things the port measured, each pinned here (the recipe and what it says:
docs/migration/README.md, "Contrastive losses across ranks and micro-batches (open_clip)"):

* the features of the other ranks must be gathered *with* their gradients
  (``torch.distributed.nn.functional.all_gather``): then ``ddp_wrap`` on 2 ranks gives the
  gradient of one process over both ranks' batches (law 6); a plain ``all_gather`` (open_clip's
  default, ``gather_with_grad=False``) gives the towers half of theirs and ``logit_scale`` all
  of its own;
* ``accumulate`` is law 2 for losses that add up over samples: a contrastive loss over each
  micro-batch has fewer negatives, another loss (measured). A window's negatives in one loss
  are one ``loss_fn`` call over the window's batch, its towers run chunk by chunk under
  ``torch.utils.checkpoint`` (the memory of one chunk's activations, as ``--accum-freq``);
* open_clip's ``--accum-freq k`` backpropagates the whole loss once per chunk, so each chunk's
  features get their gradient once but ``logit_scale``, in every one of those losses, gets k
  times its own (open_clip#761 asks whether to divide the loss by k: that would shrink the
  towers' gradients instead).
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from steplib import Events, TrainState, accumulate, clip, make_train_step, run, seed_everything, tap
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.step import Step, ddp_wrap
from steplib.testing import run_ranks
from tests.checkpoint_helpers import KilledError, assert_same, record_and_kill

IMAGE, WIDTH, EMBED = 6, 16, 8
BATCH, SAMPLES, EPOCHS = 8, 48, 2  # 6 updates an epoch, 12 in all
UPDATES = SAMPLES // BATCH
LR, WARMUP, WD, GRAD_CLIP = 0.002, 3, 0.1, 1.0  # --lr, --warmup, --wd, --grad-clip-norm
MAX_LOGIT_SCALE = math.log(100)
EVERY = 4  # a save every 4 updates: inside the first epoch, inside the second


def _tower() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IMAGE, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, EMBED)
    )


class TinyClip(nn.Module):
    """A stand-in for open_clip's ``CLIP`` fine-tuned from a pretrained one: two MLP towers
    over images and caption vectors, each normalised, started from one encoder's weights (so
    pairs already match); the temperature as ``logit_scale`` just under its clamp, where a
    pretrained CLIP's is, so the clamp binds within the run."""

    def __init__(self) -> None:
        super().__init__()
        self.visual, self.text = _tower(), _tower()
        self.text.load_state_dict(self.visual.state_dict())
        self.logit_scale = nn.Parameter(torch.tensor(MAX_LOGIT_SCALE - 0.01))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        image, text = (
            F.normalize(self.visual(images), dim=-1),
            F.normalize(self.text(texts), dim=-1),
        )
        return image, text, self.logit_scale.exp()


def inner(model: nn.Module) -> Any:
    return model.module if isinstance(model, DistributedDataParallel) else model


def clip_loss(
    image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor, *, with_grad: bool = True
) -> torch.Tensor:
    """``ClipLoss`` (``local_loss=False``): every rank's pairs in one similarity matrix; the
    other ranks' features gathered with their gradients, or as open_clip's default does
    (``with_grad=False``: detached copies, this rank's own put back)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        if with_grad:
            # torch 2.13 deprecates all_gather_tensor_autograd (open_clip's) for this one
            gather = getattr(funcol, "all_gather_single_autograd", None)
            gather = gather or funcol.all_gather_tensor_autograd
            world: Any = dist.group.WORLD
            image, text = (gather(t, 0, world) for t in (image, text))
        else:
            parts = []
            for mine in (image, text):
                copies = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
                dist.all_gather(copies, mine)
                copies[dist.get_rank()] = mine
                parts.append(torch.cat(copies))
            image, text = parts
    logits = scale * image @ text.T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def lr_at(step: int) -> Any:
    """``cosine_lr``'s rate for ``step``, as open_clip computes it (a numpy float64)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    done, steps = step - WARMUP, EPOCHS * UPDATES - WARMUP
    return 0.5 * (1 + np.cos(np.pi * done / steps)) * LR


def _setup(world: int = 1, ddp: Any = DistributedDataParallel) -> tuple[nn.Module, Any, Any]:
    """main.py's model and AdamW (gains, biases and ``logit_scale`` without weight decay); the
    loader: steplib's shuffled one, on ``world`` ranks each its share."""
    seed_everything(0)
    model: nn.Module = TinyClip()
    if world > 1:
        model = ddp(model)

    def exclude(name: str, p: torch.Tensor) -> bool:
        return p.ndim < 2 or "ln" in name or "bias" in name or "logit_scale" in name

    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": WD},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.98), eps=1e-6)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(SAMPLES, IMAGE, generator=generator)
    captions = images + 0.1 * torch.randn(SAMPLES, IMAGE, generator=generator)
    pairs = list(zip(images, captions, strict=True))
    loader = resumable_loader(pairs, batch_size=BATCH // world, seed=3, shard=world > 1)
    return model, optimizer, loader


def _result(model: nn.Module, optimizer: Any, losses: list[Any]) -> dict[str, Any]:
    saved = optimizer.state_dict()
    groups = [
        {k: float(v) if k == "lr" else v for k, v in g.items()} for g in saved["param_groups"]
    ]
    return {
        "model": {k: v.clone() for k, v in inner(model).state_dict().items()},
        "optimizer": {**saved, "param_groups": groups},
        "losses": [loss.detach().clone() for loss in losses],
    }


@functools.cache  # the tests compare with it, never change it
def _plain(world: int = 1) -> dict[str, Any]:
    """open_clip's ``train_one_epoch`` (``--accum-freq 1``) over the epochs."""
    model, optimizer, loader = _setup(world)
    losses, clamped = [], 0
    for epoch in range(EPOCHS):
        for i, (images, texts) in enumerate(loader):
            step = UPDATES * epoch + i
            for group in optimizer.param_groups:  # scheduler(step)
                group["lr"] = lr_at(step)
            optimizer.zero_grad()
            total_loss = clip_loss(*model(images, texts))
            total_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP, norm_type=2.0)
            optimizer.step()
            with torch.no_grad():
                clamped += int(inner(model).logit_scale > MAX_LOGIT_SCALE)
                inner(model).logit_scale.clamp_(0, MAX_LOGIT_SCALE)
            losses.append(total_loss)
    return {**_result(model, optimizer, losses), "clamped": clamped}


def loss_fn(model: Any, batch: Any) -> torch.Tensor:
    images, texts = batch
    return clip_loss(*model(images, texts))


def set_rate(state: TrainState) -> None:
    """Before the update: ``cosine_lr``'s rate for it (``state.step`` updates done so far)."""
    for group in state.optimizer.param_groups:
        group["lr"] = float(lr_at(state.step))


def clamp_logit_scale(state: TrainState) -> None:
    with torch.no_grad():
        inner(state.model).logit_scale.clamp_(0, MAX_LOGIT_SCALE)


def clip_step() -> Step:
    step = clip(make_train_step(loss_fn), max_norm=GRAD_CLIP)
    return tap(step, before_update=set_rate, after_update=clamp_logit_scale)


def _steplib(url: str | None = None, kill_at: int | None = None, world: int = 1) -> dict[str, Any]:
    model, optimizer, loader = _setup(world, ddp=apply_ddp)
    events = Events()
    ckpt = checkpoint_every(url, every=EVERY) if url is not None else None
    if ckpt is not None:
        events.add(resume_from(ckpt))
        events.add(ckpt)
    resumed, losses, lrs = record_and_kill(events, kill_at)
    state = TrainState.create(model=model, optimizer=optimizer)
    with contextlib.suppress(KilledError):
        step = ddp_wrap(clip_step()) if world > 1 else clip_step()
        run(step, state, loader, events=events, max_epochs=EPOCHS)
    return {**_result(model, optimizer, losses), "resumed": resumed[0], "lrs": lrs}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    first = got["resumed"]
    assert_same(got["model"], want["model"])
    assert_same(got["optimizer"], want["optimizer"])
    assert_same(got["losses"], want["losses"][first:])
    assert got["lrs"] == [float(lr_at(n)) for n in range(first, EPOCHS * UPDATES)]


def test_open_clip_loop_with_steplib_equals_it_bit_for_bit() -> None:
    want = _plain()
    assert want["clamped"] > 0  # the clamp bound: the temperature rose to its limit
    assert float(want["model"]["logit_scale"]) == pytest.approx(MAX_LOGIT_SCALE)
    _same(_steplib(), want)


@pytest.mark.parametrize("kill_at", [2, 6, 11])
# before any save (a fresh start), after the save at 4 (in the warm-up's wake, inside the first
# epoch), after the save at 8 (inside the second)
def test_open_clip_loop_killed_and_resumed_equals_it_uninterrupted(
    tmp_path: Path, kill_at: int
) -> None:
    url = str(tmp_path / "ckpt")
    _steplib(url, kill_at=kill_at)
    resumed = _steplib(url)
    assert resumed["resumed"] == kill_at // EVERY * EVERY
    _same(resumed, _plain())


def _unaligned(world: int = 1) -> tuple[nn.Module, Any]:
    """The model with a text tower not yet aligned (every rank alike): large gradients."""
    model, _, loader = _setup(world, ddp=apply_ddp)
    torch.manual_seed(5)
    for layer in inner(model).text:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()
    return model, loader


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in inner(model).named_parameters() if p.grad is not None}


def _first_gradients(with_grad: bool, world: int) -> dict[str, torch.Tensor]:
    """The gradients of the first batch (every rank's share), after DDP's average."""
    model, loader = _unaligned(world)
    images, texts = next(iter(loader))
    clip_loss(*model(images, texts), with_grad=with_grad).backward()
    grads = _grads(model)
    del model
    return grads


def _on_ranks(rank: int, world: int, *, root: Path) -> dict[str, Any]:
    url = str(root / "ckpt")
    _steplib(url, kill_at=6, world=world)
    return {
        "plain": _plain(world),
        "steplib": _steplib(world=world),
        "resumed": _steplib(url, world=world),
        "with_grad": _first_gradients(True, world),
        "without": _first_gradients(False, world),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("clip-ranks")
    return run_ranks(functools.partial(_on_ranks, root=root), world=2, timeout=180)


def test_open_clip_under_ddp_killed_and_resumed_equals_its_ddp_loop(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        assert rank["resumed"]["resumed"] == 4
        _same({**rank["steplib"], "resumed": 0}, rank["plain"])
        _same(rank["resumed"], rank["plain"])
    assert_same(ranks[0]["steplib"]["model"], ranks[1]["steplib"]["model"])


def test_features_gathered_with_their_gradients_give_one_process_gradients(
    ranks: list[dict[str, Any]],
) -> None:
    # Law 6 for a loss over every rank's batch: the same gradients as one process over the
    # whole batch (to rounding: the matrix products are summed in another order).
    alone = _first_gradients(True, world=1)
    assert min(float(g.abs().max()) for g in alone.values()) > 1e-3
    for rank in ranks:
        for name, grad in alone.items():
            torch.testing.assert_close(rank["with_grad"][name], grad, rtol=1e-4, atol=1e-6)
            # open_clip's default: the towers get half their gradient, logit_scale all of its
            half = 1.0 if name == "logit_scale" else 0.5
            torch.testing.assert_close(rank["without"][name], half * grad, rtol=1e-4, atol=1e-6)


def chunked_loss_fn(model: Any, batch: Any, chunks: int = 2) -> torch.Tensor:
    """The recipe: a window's pairs in one loss, the towers run chunk by chunk and their
    activations recomputed in the backward (the memory of one chunk's, as ``--accum-freq``)."""
    outputs = [
        checkpoint(model, images, texts, use_reentrant=False)
        for images, texts in zip(*(part.chunk(chunks) for part in batch), strict=True)
    ]
    image, text = (torch.cat([out[i] for out in outputs]) for i in (0, 1))
    return clip_loss(image, text, outputs[0][2])


def _update_gradients(step: Any, batches: list[Any]) -> dict[str, torch.Tensor]:
    """The gradients an update applies (``before_update``: final), of a fresh unaligned model."""
    model, _ = _unaligned()
    seen: dict[str, torch.Tensor] = {}
    step = tap(step, before_update=lambda state: seen.update(_grads(state.model)))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    for batch in batches:
        state, _ = step(state, batch)
    return seen


def _open_clip_accum_freq(batches: list[Any]) -> dict[str, torch.Tensor]:
    """open_clip's ``--accum-freq len(batches)``: the features cached without gradients, then
    per batch its features again with gradients among the cached others, the whole loss's
    backward each time."""
    model, _ = _unaligned()
    with torch.no_grad():
        cached = [model(images, texts)[:2] for images, texts in batches]
    for j, (images, texts) in enumerate(batches):
        image, text, scale = model(images, texts)
        images_all = torch.cat([image if i == j else c[0] for i, c in enumerate(cached)])
        texts_all = torch.cat([text if i == j else c[1] for i, c in enumerate(cached)])
        clip_loss(images_all, texts_all, scale).backward()
    return _grads(model)


def test_a_contrastive_window_is_one_loss_over_its_batch_not_a_sum_of_micro_batches() -> None:
    _, loader = _unaligned()
    batch = next(iter(loader))
    halves = [tuple(part[i * 4 : i * 4 + 4] for part in batch) for i in (0, 1)]
    whole = _update_gradients(make_train_step(loss_fn), [batch])
    assert min(float(g.abs().max()) for g in whole.values()) > 1e-3

    def apart(grads: dict[str, torch.Tensor], name: str) -> float:
        return float((grads[name] - whole[name]).abs().max() / whole[name].abs().max())

    # accumulate: the mean of two losses of 3 negatives each, not one of 7 (law 2 is for
    # losses that add up over samples): another gradient, by a third and more
    summed = _update_gradients(accumulate(make_train_step(loss_fn), 2), halves)
    assert max(apart(summed, name) for name in whole) > 0.3
    # the recipe: the whole window's loss, its towers chunk by chunk: the same gradients
    chunked = _update_gradients(make_train_step(chunked_loss_fn), [batch])
    for name, grad in whole.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6)
    # open_clip's --accum-freq 2: the towers' gradients, and logit_scale's twice
    accum_freq = _open_clip_accum_freq(halves)
    for name, grad in whole.items():
        times = 2.0 if name == "logit_scale" else 1.0
        torch.testing.assert_close(accum_freq[name], times * grad, rtol=1e-4, atol=1e-6)

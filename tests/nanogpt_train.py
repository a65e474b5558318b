"""nanoGPT's train.py (karpathy/nanoGPT) on a tiny GPT and a few hundred random tokens in
memory, as the example writes it (:func:`nanogpt`), and the same training with steplib
(:func:`with_steplib`); compared by ``tests/test_nanogpt_train_example.py``.

The original's loop is kept line for line where it matters: the seed ``1337 + rank``, the
first batch fetched before the loop and each next one right after the forward pass (both from
torch's global generator), ``estimate_loss`` at every ``eval_interval`` iterations (iteration
0 too) on ``eval_iters`` batches per split drawn from that generator as well, ``get_lr(it)``
set on every group, ``loss / gradient_accumulation_steps``, ``require_backward_grad_sync`` on
the last micro step only, clipping, the (disabled, float32) ``GradScaler``, and the checkpoint
after an evaluation that improved ``best_val_loss`` (or always), which ``init_from="resume"``
loads. On the CPU its ``ctx`` is a ``nullcontext``: no autocast.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 - nanoGPT's name
from torchmetrics import MeanMetric

from steplib import (
    Evaluator,
    Events,
    TrainState,
    accumulate,
    clip,
    ddp_wrap,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.distributed import apply_ddp
from steplib.events import Event
from steplib.param_groups import weight_decay_groups
from steplib.schedules import AbsoluteLR
from tests.nanogpt_model import GPT, GPTConfig


@dataclasses.dataclass(frozen=True)
class Config:
    """train.py's configuration, scaled down (its names)."""

    eval_interval: int = 3
    eval_iters: int = 2
    always_save_checkpoint: bool = True
    gradient_accumulation_steps: int = 2
    batch_size: int = 4
    block_size: int = 8
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.1  # nanoGPT's shakespeare_char config uses 0.2: the forward draws too
    bias: bool = False
    vocab_size: int = 32
    learning_rate: float = 1e-2
    max_iters: int = 9  # iterations 0..9: ten updates
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    decay_lr: bool = True
    warmup_iters: int = 2
    lr_decay_iters: int = 7  # < max_iters: warmup, cosine decay and the floor all run
    min_lr: float = 1e-3

    def model_args(self) -> dict[str, Any]:
        names = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
        return {name: getattr(self, name) for name in names}


def corpus(c: Config) -> dict[str, torch.Tensor]:
    """train.bin and val.bin: random tokens, from a generator of their own."""
    gen = torch.Generator().manual_seed(0)
    return {
        "train": torch.randint(c.vocab_size, (300,), generator=gen),
        "val": torch.randint(c.vocab_size, (100,), generator=gen),
    }


def get_batch(c: Config, data: dict[str, torch.Tensor], split: str) -> tuple[Any, Any]:
    """train.py's get_batch: random offsets from torch's global generator."""
    tokens = data[split]
    ix = torch.randint(len(tokens) - c.block_size, (c.batch_size,))
    x = torch.stack([tokens[i : i + c.block_size] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + c.block_size] for i in ix])
    return x, y


def get_lr(c: Config, it: int) -> float:
    """train.py's learning rate schedule (cosine with warmup), verbatim."""
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it > c.lr_decay_iters:
        return c.min_lr
    decay_ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return c.min_lr + coeff * (c.learning_rate - c.min_lr)


class KilledError(Exception):
    """The process dies (nothing saves)."""


def nanogpt(
    c: Config,
    out_dir: str,
    *,
    init_from: str = "scratch",
    kill_at: int | None = None,
    rank: int = 0,
    world: int = 1,
    fork_eval: bool = False,
) -> dict[str, Any]:
    """train.py's main body. Returns what it printed and the final weights; with ``kill_at``,
    raises ``KilledError`` at the start of that iteration (after its evaluation and save).
    ``fork_eval``: ``estimate_loss`` under ``torch.random.fork_rng()`` (not the original's)."""
    gradient_accumulation_steps = c.gradient_accumulation_steps
    ddp = world > 1
    if ddp:
        master_process, seed_offset = rank == 0, rank
        assert gradient_accumulation_steps % world == 0
        gradient_accumulation_steps //= world
    else:
        master_process, seed_offset = True, 0
    torch.manual_seed(1337 + seed_offset)
    ctx = nullcontext()  # device_type == 'cpu'
    data = corpus(c)
    iter_num: int = 0
    best_val_loss: Any = 1e9  # a tensor after the first evaluation
    checkpoint: Any = None
    model: Any = GPT(GPTConfig(**c.model_args()))  # init_from 'scratch' draws its weights; so
    if init_from == "resume":  # does 'resume', before it loads the checkpoint's
        checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=False)
        model.load_state_dict(checkpoint["model"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # dtype == 'float32'
    optimizer = model.configure_optimizers(
        c.weight_decay, c.learning_rate, (c.beta1, c.beta2), "cpu"
    )
    if init_from == "resume":
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None
    if ddp:
        model = DDP(model)

    @torch.no_grad()
    def estimate_loss() -> dict[str, torch.Tensor]:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(c.eval_iters)
            for k in range(c.eval_iters):
                X, Y = get_batch(c, data, split)  # noqa: N806
                with ctx:
                    _logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    printed: dict[str, list[Any]] = {
        "evals": [],
        "improved": [],
        "losses": [],
        "lrs": [],
        "saved": [],
    }
    X, Y = get_batch(c, data, "train")  # noqa: N806 - fetch the very first batch
    raw_model = model.module if ddp else model
    while True:
        lr = get_lr(c, iter_num) if c.decay_lr else c.learning_rate
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % c.eval_interval == 0 and master_process:
            with torch.random.fork_rng() if fork_eval else nullcontext():
                losses = estimate_loss()
            printed["evals"].append((iter_num, float(losses["train"]), float(losses["val"])))
            printed["improved"].append(bool(losses["val"] < best_val_loss))
            if losses["val"] < best_val_loss or c.always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {
                        "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "model_args": c.model_args(),
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                    }
                    torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
                    printed["saved"].append(iter_num)
        if iter_num == kill_at:
            raise KilledError
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch(c, data, "train")  # noqa: N806 - prefetch the next batch
            scaler.scale(loss).backward()
        if c.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if master_process:
            printed["losses"].append(loss.item() * gradient_accumulation_steps)
            printed["lrs"].append(lr)
        iter_num += 1
        if iter_num > c.max_iters:
            break
    return {**printed, "best_val_loss": float(best_val_loss), "model": raw_model.state_dict()}


class TrainBatches:
    """``get_batch('train')`` as data for ``run``: an endless stream from torch's global
    generator, drawn when the loop asks for the next batch (after the previous step, as the
    original draws it after the forward pass).

    With ``eval_draws``, it also makes the draws nanoGPT's ``estimate_loss`` takes from that
    generator after the batch that starts an evaluated iteration, so that the batches after it
    are the original's. Its position (batches drawn) is its state, which
    a checkpoint saves: a resumed stream knows where the next evaluation falls.
    """

    def __init__(
        self, c: Config, data: dict[str, torch.Tensor], *, eval_draws: bool, world: int
    ) -> None:
        self.c, self.data, self.eval_draws = c, data, eval_draws
        self.every = c.eval_interval * c.gradient_accumulation_steps // world  # micro-batches
        self.drawn = 0

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while True:
            batch = get_batch(self.c, self.data, "train")
            if self.eval_draws and self.drawn % self.every == 0:
                for split in ("train", "val"):  # what estimate_loss drew here
                    for _ in range(self.c.eval_iters):
                        get_batch(self.c, self.data, split)
            self.drawn += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.drawn = state["drawn"]


class EvalBatches:
    """``estimate_loss``'s ``eval_iters`` batches of one split, for an ``Evaluator`` (which
    draws under a fork of the global generator: what it draws never moves training's).

    ``as_nanogpt``: first make the draws that precede this split's in the original, so that
    the batches are its own: the training batch it fetched before it evaluated, and for
    ``"val"`` the ``"train"`` split's.
    """

    def __init__(
        self, c: Config, data: dict[str, torch.Tensor], split: str, *, as_nanogpt: bool
    ) -> None:
        self.c, self.data, self.split, self.as_nanogpt = c, data, split, as_nanogpt

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.as_nanogpt:
            get_batch(self.c, self.data, "train")  # the batch fetched before estimate_loss
            if self.split == "val":
                for _ in range(self.c.eval_iters):
                    get_batch(self.c, self.data, "train")
        for _ in range(self.c.eval_iters):
            yield get_batch(self.c, self.data, self.split)


def with_steplib(
    c: Config,
    url: str,
    *,
    as_nanogpt: bool = True,
    kill_at: int | None = None,
    rank: int = 0,
    world: int = 1,
    record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The same training with steplib; ``as_nanogpt=False``: evaluation draws nothing from
    training's generator (steplib's law 10). Returns ``record`` (filled as the run goes, so
    that a killed run's holds what it printed) with the evaluator and the final weights."""
    torch.manual_seed(1337 + rank)
    data = corpus(c)
    model: Any = GPT(GPTConfig(**c.model_args()))
    if world > 1:
        model = apply_ddp(model)
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, c.weight_decay), lr=c.learning_rate, betas=(c.beta1, c.beta2)
    )
    state = TrainState.create(
        model=model,
        optimizer=optimizer,
        scheduler=AbsoluteLR(optimizer, functools.partial(get_lr, c)),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
    )

    def loss_fn(model: Any, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x, y = batch
        _, loss = model(x, y)
        return loss, {"loss": loss.detach()}  # the micro-batch's, which nanoGPT prints

    step = make_train_step(loss_fn)
    step = clip(step, max_norm=c.grad_clip)
    step = accumulate(step, c.gradient_accumulation_steps // world)
    if world > 1:
        step = ddp_wrap(step)
    evaluator = Evaluator(
        make_eval_step(lambda model, batch: model(*batch)[1]),
        {split: EvalBatches(c, data, split, as_nanogpt=as_nanogpt) for split in ("train", "val")},
        metrics={"loss": MeanMetric()},
        every=c.eval_interval,
        monitor="val_loss",
        sanity_batches=0,
    )
    # ckpt.pt after every evaluation (always_save_checkpoint), or only the best and the newest.
    keep = {"keep_last": 1} if c.always_save_checkpoint else {"keep_best": 1, "metric": evaluator}
    ckpt = checkpoint_every(url, every=c.eval_interval, at_end=False, **keep)
    events = Events(resume_from(ckpt), evaluator, ckpt)
    # nanoGPT evaluates at iteration 0 too (a resumed run's first update was evaluated).
    events.on("fit_start", evaluator.unless_evaluated)
    printed = {} if record is None else record
    printed.update(losses=[], lrs=[], saved=[], improved=[], evaluator=evaluator)

    def log(e: Event) -> None:
        printed["losses"].append(float(e.output.aux["loss"]))
        printed["lrs"].append(float(e.output.lr))

    events.on("step_end", log)
    events.on("checkpoint_end", lambda e: printed["saved"].append(e.checkpoint.step))
    events.on("validation_end", lambda e: printed["improved"].append(evaluator.improved))
    if kill_at is not None:
        events.on("step_end", lambda e: _die() if e.step == kill_at else None)
    train = TrainBatches(c, data, eval_draws=as_nanogpt and rank == 0, world=world)
    try:
        state = run(step, state, train, events=events, max_steps=c.max_iters + 1)
    finally:
        model = state.model.module if world > 1 else state.model
        printed.update(
            evals=[(s, float(v["train_loss"]), float(v["val_loss"])) for s, v in evaluator.history],
            best_val_loss=evaluator.best.value,
            best_step=evaluator.best.step,
            model={k: v.clone() for k, v in model.state_dict().items()},
        )
    return printed


def _die() -> None:
    raise KilledError

"""The two workloads and the one recipe that every contender runs.

Everything a contender needs to build its copy of the experiment is in :class:`Setup`: the same
initial weights (a deep copy of one seeded template), the same pool of micro-batches (already on
the device, so no contender pays for a host-to-device copy the others do not), the same loss
function and the same optimizer and schedule constructors.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib.schedules import warmup_cosine

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def mlp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TinyTransformer(nn.Module):
    """A pre-norm causal transformer LM: 2 layers, d=128, 4 heads, FFN 4d, vocabulary 256
    by default (``d``, ``heads`` and ``layers`` make the bigger one).

    Dropout is 0 on purpose: dropout draws from the global RNG, and contenders that run
    interleaved in one process would then each see a different mask, so their weights could
    not be compared bit for bit.
    """

    def __init__(
        self, *, vocab: int = 256, d: int = 128, heads: int = 4, seq: int = 64, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        # enable_nested_tensor=False: the nested-tensor fast path is inference-only and would
        # warn for a norm_first layer.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        h = self.encoder(h, mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(h)
        return out


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its loss and how to make its micro-batches.

    Attributes:
        name: the ``--workload`` name.
        description: one line for the table and the JSON.
        build_model: makes the (randomly initialised) model; called once under a fixed seed.
        make_batches: ``(n, generator) -> n micro-batches`` on the CPU.
        loss_fn: ``loss_fn(model, batch)``, a mean loss.
        lr: the AdamW base learning rate.
        pool: micro-batches in the data pool each contender cycles through (a multiple of the
            accumulation, so that window boundaries line up with the pool's end for all).
    """

    name: str
    description: str
    build_model: Callable[[], nn.Module]
    make_batches: Callable[[int, torch.Generator], list[Batch]]
    loss_fn: LossFn
    lr: float
    pool: int


def _mlp_batches(n: int, gen: torch.Generator) -> list[Batch]:
    return [
        (torch.randn(32, 64, generator=gen), torch.randn(32, 1, generator=gen)) for _ in range(n)
    ]


def _lm_batches(n: int, gen: torch.Generator) -> list[Batch]:
    out = []
    for _ in range(n):
        seq = torch.randint(0, 256, (16, 65), generator=gen)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload(
        name="tiny",
        description="MLP 64-64-1, micro-batch 32 (overhead-bound)",
        build_model=lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)),
        make_batches=_mlp_batches,
        loss_fn=mlp_loss,
        lr=1e-3,
        pool=64,
    ),
    "transformer": Workload(
        name="transformer",
        description="2-layer transformer d=128, seq 64, batch 16 (compute-bound)",
        build_model=TinyTransformer,
        make_batches=_lm_batches,
        loss_fn=lm_loss,
        lr=3e-4,
        pool=16,
    ),
    # The bigger model of "how the cost grows": ~8x the transformer's parameters, still about a
    # minute for raw + steplib on 2 cores with the plan in bench_overhead.
    "transformer-big": Workload(
        name="transformer-big",
        description="4-layer transformer d=256, seq 64, batch 16 (compute-bound, bigger)",
        build_model=lambda: TinyTransformer(d=256, heads=8, layers=4),
        make_batches=_lm_batches,
        loss_fn=lm_loss,
        lr=3e-4,
        pool=16,
    ),
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One experiment, as every contender builds it.

    Attributes:
        workload: what is trained.
        device: where (the model, the optimizer state and the data pool live there).
        accumulation: micro-batches per optimizer update.
        max_norm: clip_grad_norm_ limit.
        warmup: warmup updates of the LR schedule.
        total_steps: the schedule's length (updates); the run never goes past it.
        seed: seeds the template weights and the data.
        template: the initial model every contender deep-copies.
        batches: the pool of micro-batches, on ``device``.
    """

    workload: Workload
    device: torch.device
    accumulation: int
    max_norm: float
    warmup: int
    total_steps: int
    seed: int
    template: nn.Module
    batches: Sequence[Batch]

    @classmethod
    def create(
        cls,
        workload: Workload,
        device: torch.device,
        *,
        total_steps: int,
        accumulation: int = 4,
        max_norm: float = 1.0,
        warmup: int = 10,
        seed: int = 0,
    ) -> Setup:
        torch.manual_seed(seed)
        template = workload.build_model().to(device)
        gen = torch.Generator().manual_seed(seed + 1)
        batches = [
            tuple(t.to(device) for t in b) for b in workload.make_batches(workload.pool, gen)
        ]
        return cls(
            workload=workload,
            device=device,
            accumulation=accumulation,
            max_norm=max_norm,
            warmup=warmup,
            total_steps=max(total_steps, warmup + 1),
            seed=seed,
            template=template,
            batches=batches,  # type: ignore[arg-type]
        )

    @property
    def loss_fn(self) -> LossFn:
        return self.workload.loss_fn

    def make_model(self) -> nn.Module:
        """A fresh copy of the initial weights (its own parameters, nothing shared)."""
        return copy.deepcopy(self.template)

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        # torch's defaults (foreach/fused chosen by torch) for every contender: the recipe is
        # "what a user gets", and the same choice keeps the weights bit-identical.
        return torch.optim.AdamW(params, lr=self.workload.lr, weight_decay=0.01)

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        schedule = warmup_cosine(warmup=self.warmup, total=self.total_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    def sync(self) -> None:
        """Wait for queued device work (a no-op on CPU); called once per timed chunk."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def recipe(self) -> dict[str, Any]:
        """The recipe as plain data, for the JSON."""
        return {
            "accumulation": self.accumulation,
            "clip_grad_norm": self.max_norm,
            "optimizer": f"AdamW(lr={self.workload.lr}, weight_decay=0.01, torch defaults)",
            "scheduler": (
                f"LambdaLR(steplib.warmup_cosine(warmup={self.warmup}, total={self.total_steps}))"
            ),
            "precision": "fp32",
            "seed": self.seed,
            "data_pool_micro_batches": len(self.batches),
            "parameters": sum(p.numel() for p in self.template.parameters()),
        }

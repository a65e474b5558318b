"""``torch.optim.swa_utils.update_bn`` under DDP (2 gloo ranks): each rank recomputes the
average's batch-norm statistics from its own share of the loader, so the ranks end with
different statistics and rank 0's (the one that saves and exports) are those of half the data.
The recipe of docs/migration/README.md ("Stochastic Weight Averaging", under DDP) all-reduces
them, weighted by the batches each rank saw: every rank then holds the statistics of one
``update_bn`` pass over all the ranks' batches.

Measured here (the ``Net`` of tests/test_swa_recipe.py's kind, 64 samples, 8 a batch, 4 batches
a rank): rank 0's first ``running_mean`` 0.22 and ``running_var`` 0.81 away from one pass over
the same 8 batches (rank 0 and rank 1 0.45 and 1.6 apart), ``num_batches_tracked`` 4 for 8, and
the average's outputs on the data up to 0.31 away (of outputs up to 1.7); after the recipe,
within 2.4e-7. ``SyncBatchNorm``, the other way, runs on GPUs only (gloo on CPU: ``ValueError``).
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn
from torch.utils.data import TensorDataset

from steplib.data import resumable_loader
from steplib.testing import run_ranks
from tests.test_swa_recipe import Net

DOCS = Path(__file__).resolve().parents[1] / "docs" / "migration" / "README.md"


def all_reduce_bn_statistics(model: nn.Module) -> None:  # the docs' recipe, as written there
    """After update_bn on each rank's share of the data: every rank's batch-norm statistics
    become those of one update_bn pass over all the ranks' batches."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            own = dict(module.named_buffers(recurse=False))
            mean, var, count = own["running_mean"], own["running_var"], own["num_batches_tracked"]
            # update_bn's statistics are averages over batches: weight each rank's by its count
            n = count.to(mean.dtype)
            packed = torch.cat([mean * n, var * n, n.reshape(1)])
            dist.all_reduce(packed)  # one per layer, in the same order on every rank
            total = packed[-1]
            mean.copy_(packed[: mean.numel()] / total)
            var.copy_(packed[mean.numel() : -1] / total)
            count.copy_(total.to(count.dtype))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().layers  # the SWA recipe's network


def _data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 6, generator=gen) * torch.linspace(0.5, 3.0, 64)[:, None] + 1.0


def _statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "batches" in k}


def _on_rank(rank: int, world: int, *, batches: list[int] | None = None) -> dict[str, Any]:
    """``update_bn`` over this rank's share of a sharded loader (or, with ``batches``, that
    many of its batches), its statistics, then the recipe's."""
    x = _data()
    loader = resumable_loader(TensorDataset(x), batch_size=8, seed=3, shard=True)
    mine = [b for (b,) in loader][: None if batches is None else batches[rank]]
    swa = AveragedModel(_net())
    torch.manual_seed(10 + rank)  # update_bn runs in train mode: dropout draws
    update_bn(mine, swa)
    alone = _statistics(swa)
    all_reduce_bn_statistics(swa)
    return {"batches": mine, "alone": alone, "reduced": _statistics(swa)}


def _one_pass(batches: list[torch.Tensor], seeds: list[tuple[int, int]]) -> nn.Module:
    """``update_bn`` in one process over the ranks' batches, each with its rank's dropout."""
    swa = AveragedModel(_net())
    for module in swa.modules():  # what update_bn does: reset, cumulative average
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
            module.momentum = None
    swa.train()
    with torch.no_grad():
        for seed, count in seeds:
            torch.manual_seed(seed)
            for batch in batches[:count]:
                swa(batch)
            batches = batches[count:]
    return swa


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=0, atol=1e-6) for k in a)


def test_update_bn_on_each_rank_leaves_each_its_own_statistics_and_the_recipe_joins_them() -> None:
    zero, one = run_ranks(_on_rank, world=2)
    seeds = [(10, len(zero["batches"])), (11, len(one["batches"]))]
    reference = _statistics(_one_pass(zero["batches"] + one["batches"], seeds))
    assert reference["module.1.num_batches_tracked"] == 8
    # Each rank alone: its own statistics, half the batches, far from the pass over all.
    apart = (zero["alone"]["module.1.running_var"] - one["alone"]["module.1.running_var"]).abs()
    assert float(apart.max()) > 0.5
    assert zero["alone"]["module.1.num_batches_tracked"] == 4
    assert not _close(zero["alone"], reference)
    # The recipe: the same on every rank, and the pass over all the ranks' batches.
    assert all(torch.equal(zero["reduced"][k], one["reduced"][k]) for k in reference)
    assert _close(zero["reduced"], reference)


def test_the_recipe_weights_each_rank_by_the_batches_it_saw() -> None:
    # Ranks with 4 and 1 batches (an uneven last share): a plain mean of the two ranks'
    # statistics gives the one batch as much weight as the four.
    zero, one = run_ranks(lambda rank, world: _on_rank(rank, world, batches=[4, 1]), world=2)
    seeds = [(10, 4), (11, 1)]
    reference = _statistics(_one_pass(zero["batches"] + one["batches"], seeds))
    assert reference["module.1.num_batches_tracked"] == 5
    assert _close(zero["reduced"], reference) and _close(one["reduced"], reference)
    plain = (zero["alone"]["module.1.running_mean"] + one["alone"]["module.1.running_mean"]) / 2
    assert not torch.allclose(plain, reference["module.1.running_mean"], atol=1e-3)


def test_the_docs_give_this_recipe() -> None:
    source = textwrap.dedent(inspect.getsource(all_reduce_bn_statistics))
    source = source.replace("  # the docs' recipe, as written there", "")
    in_list = textwrap.indent(source, "  ")  # a code block inside a bullet
    assert in_list in DOCS.read_text(), "docs/migration/README.md: the recipe differs from this"

"""Tensor parallelism: apply_tp on a 2-rank CPU mesh (gloo) trains like one process on the
whole model (float64, within 1e-6), with clip over the DTensor gradients and, for a sharded
vocabulary, a loss computed on the shards without gathering the logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, TrainState, accumulate, clip, make_train_step
from steplib.distributed.tensor_parallel import apply_tp, parallel_cross_entropy
from steplib.testing import run_ranks

VOCAB = 12
STEPS = 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


class Block(nn.Module):
    """A tiny language-model block: embedding, pre-norm MLP with a residual, vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h)


def _block() -> nn.Module:
    torch.manual_seed(0)
    return Block().double()


def _mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(6, 8, generator=gen, dtype=torch.float64),
            torch.randn(6, 4, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (3, 5), generator=gen)
        target = torch.randint(0, VOCAB, (3, 5), generator=gen)
        target[torch.rand(3, 5, generator=gen) < 0.3] = -100  # padding: not counted
        batches.append((ids, target))
    return batches


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids, target = batch
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"), (
        target != -100
    ).sum()


def _parallel_token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids, target = batch
    return parallel_cross_entropy(model(ids), target), (target != -100).sum()


def _reference(model: nn.Module, batches: list[Any], loss_fn: Any) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        out = loss_fn(model, batch)
        loss = out[0] / out[1] if isinstance(out, tuple) else out
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {"params": [p.detach() for p in model.parameters()], "norm": norm, "loss": loss}


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def _assert_equal(result: dict[str, Any], ref: dict[str, Any]) -> None:
    for got, want in zip(result["params"], ref["params"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(result["norm"], ref["norm"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(result["loss"].double(), ref["loss"].detach(), atol=1e-6, rtol=1e-6)


def _mlp_tp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (world,))
    model = apply_tp(_mlp(), {"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh=mesh)
    weight = dict(model.named_parameters())["0.weight"]
    local_rows = weight.to_local().shape[0]  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    step = clip(make_train_step(_mse), max_norm=0.5)
    for batch in _mlp_batches():  # every TP rank gets the same batch
        state, out = step(state, batch)
    return {
        "params": _full(model),
        "norm": out.grad_norm,
        "loss": out.loss,
        "local_rows": local_rows,
    }


def test_tp_colwise_rowwise_mlp_with_clip_equals_one_process() -> None:
    results = run_ranks(_mlp_tp)
    ref = _reference(_mlp(), _mlp_batches(), _mse)
    for result in results:
        assert result["local_rows"] == 8  # really sharded: half of the 16 rows per rank
        _assert_equal(result, ref)


def _block_tp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-sharded embedding
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }
    model = apply_tp(_block(), plan, mesh=mesh, loss_parallel="head")
    kinds = {name: isinstance(p, DTensor) for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    # Token-weighted, over 2 micro-batches per update: the counts are summed across them.
    step = accumulate(clip(make_train_step(_parallel_token_loss), max_norm=0.5), 2)
    for batch in _token_batches():
        ids, target = batch
        for half in (slice(0, 2), slice(2, 3)):
            state, out = step(state, (ids[half], target[half]))
    # The loss itself gathers no logits: only all-reduces (max and sums) cross the ranks.
    logits = model(_token_batches()[0][0])
    with CommDebugMode() as comms:
        parallel_cross_entropy(logits, _token_batches()[0][1]).backward()
    gathered = [str(op) for op in comms.get_comm_counts() if "gather" in str(op)]
    return {
        "params": _full(model),
        "norm": out.grad_norm,
        "loss": out.loss,
        "all_dtensor": all(kinds.values()),
        "logits_shard": str(logits.placements),
        "gathered": gathered,
    }


def test_tp_block_with_loss_parallel_equals_one_process() -> None:
    results = run_ranks(_block_tp)
    ref = _reference(_block(), _token_batches(), _token_loss)
    for result in results:
        assert result["all_dtensor"]  # the LayerNorm left out of the plan is replicated
        assert result["logits_shard"] == "(Shard(dim=2),)"
        assert result["gathered"] == []
        _assert_equal(result, ref)


def _bad_plans(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (world,))
    attempts = [
        lambda: apply_tp(_block(), {"mlp.up": ColwiseParallel()}, mesh=mesh),
        lambda: apply_tp(_block(), {"up": "colwise"}, mesh=mesh),
        lambda: apply_tp(_block(), {"up": ColwiseParallel()}, mesh=mesh, loss_parallel="lm"),
        lambda: apply_tp(_block(), {"up": ColwiseParallel()}, mesh=mesh, loss_parallel="norm"),
        lambda: apply_tp(_block(), {"head": RowwiseParallel()}, mesh=mesh, loss_parallel="head"),
        lambda: parallel_cross_entropy(torch.zeros(2, VOCAB), torch.zeros(2, dtype=torch.long)),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_tp_bad_plans_are_refused_at_build_time_with_the_names() -> None:
    unknown, not_style, no_head, not_linear, twice, plain = run_ranks(_bad_plans)[0]
    assert "'mlp.up'" in unknown and "'mlp'" in unknown
    assert "['embed', 'norm', 'up', 'down', 'head']" in unknown  # what exists
    assert "not a ParallelStyle" in not_style and "ColwiseParallel()" in not_style
    assert "'lm'" in no_head and "'head'" in no_head
    assert "LayerNorm" in not_linear and "nn.Linear" in not_linear
    assert "Remove 'head' from the plan" in twice
    assert "loss_parallel=" in plain and "Tensor" in plain


def test_tp_mesh_must_be_one_dimensional() -> None:
    with pytest.raises(ConfigError, match="1-D mesh"):
        apply_tp(_mlp(), {}, mesh="cpu")


def _flops_of_tp_and_fsdp(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from steplib.distributed import apply_fsdp
    from steplib.handlers.throughput import flops_per_batch

    batch = _mlp_batches()[0]
    mesh = init_device_mesh("cpu", (world,))
    tp = apply_tp(_mlp(), {"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh=mesh)
    found = []
    for model in (tp, apply_fsdp(_mlp())):
        try:
            flops_per_batch(model, batch, loss_fn=_mse)
        except ConfigError as err:
            found.append(str(err))
    return found


def test_flops_per_batch_refuses_a_sharded_model_whose_mfu_it_would_overstate() -> None:
    # A tensor-parallel model's FLOPs were counted whole on each rank, where each computes a
    # share: mfu was overstated by the degree (2x here), in silence. (FSDP2's failed on the
    # meta device with a message about .item().)
    for found in run_ranks(_flops_of_tp_and_fsdp):
        assert len(found) == 2 and all("before apply_fsdp / apply_tp" in f for f in found)

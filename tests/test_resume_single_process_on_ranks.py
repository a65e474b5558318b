"""A single-process checkpoint loaded on every rank of a DDP run (session 26, ckptleft item 1).

Such a checkpoint holds the generators of the one process that saved it. Restored on every
rank, they made every rank draw the same dropout masks and noise from then on, where a fresh
run seeded as steplib seeds (``seed_everything(0, rank_offset=True)``) draws other ones on
each rank. A checkpoint's generators are now restored in their own process alone (this rank
of as many ranks); every other rank goes on from its own seeded generators, and the first of
them warns, as a sharded checkpoint on another number of ranks does.

Two cases, on 2 gloo ranks:

* a checkpoint of a 1-process run (``checkpoint_every``), loaded on both ranks into the DDP
  model's module (``load(url, state.replace(model=model.module))``, as docs/checkpoints.md
  has a single-process checkpoint of a DDP model saved): neither rank restores it;
* a checkpoint that rank 0 alone saved of a 2-rank DDP run (``save(state.replace(model=
  model.module))`` on rank 0, docs/checkpoints.md): rank 0 restores its own generators,
  rank 1 keeps its own.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from steplib import TrainState, ddp_wrap, make_train_step, run
from steplib.checkpoint import checkpoint_every, latest, load, save
from steplib.distributed import apply_ddp
from steplib.errors import CheckpointWarning
from steplib.seeding import seed_everything
from steplib.testing import run_ranks

UPDATES = 2  # trained after each load


def _build(*, ddp: bool) -> tuple[TrainState, Any, list[torch.Tensor]]:
    torch.manual_seed(0)  # the same initial weights in every process
    net: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    if ddp:
        net = apply_ddp(net)
    state = TrainState.create(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    draws: list[torch.Tensor] = []

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        draws.append(torch.rand(4))  # what dropout draws next, from the same generator
        return model(batch).pow(2).mean()

    step = make_train_step(loss_fn)
    return state, ddp_wrap(step) if ddp else step, draws


def _batches() -> list[torch.Tensor]:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return list(torch.randn(UPDATES, 2, 4, generator=torch.Generator().manual_seed(1 + rank)))


def _train(state: TrainState, step: Any, draws: list[torch.Tensor]) -> tuple[TrainState, Any]:
    state = run(step, state, _batches(), max_steps=state.step + UPDATES)
    return state, [d.tolist() for d in draws]


def _load_into_module(url: str, state: TrainState) -> tuple[TrainState, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        loaded = load(url, state.replace(model=state.model.module))
    said = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    return loaded.replace(model=state.model), said


def _on_two_ranks(rank: int, world: int, *, single: str, alone: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    state, step, draws = _build(ddp=True)
    seed_everything(0, rank_offset=True)
    state, out["fresh"] = _train(state, step, draws)
    if rank == 0:  # rank 0 alone writes a single-process checkpoint of the DDP run
        save(state.replace(model=state.model.module), alone)
    draws.clear()
    state, out["after_alone_save"] = _train(state, step, draws)
    torch.distributed.barrier()

    for name, url in (("single", single), ("alone", alone)):
        state, step, draws = _build(ddp=True)
        seed_everything(0, rank_offset=True)
        state, out[f"{name}_warned"] = _load_into_module(str(latest(url)), state)
        out[name] = _train(state, step, draws)[1]
    del state, step  # free the DDP model before the process group goes
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("single-on-ranks")
    seed_everything(0)
    state, step, _ = _build(ddp=False)
    run(step, state, _batches(), events=[checkpoint_every(str(root / "single"), every=UPDATES)])
    fn = functools.partial(_on_two_ranks, single=str(root / "single"), alone=str(root / "alone"))
    return run_ranks(fn, world=2, timeout=90)


def test_a_single_process_checkpoint_on_two_ranks_leaves_each_rank_its_own_generators(
    ranks: list[dict[str, Any]],
) -> None:
    first, second = ranks
    assert first["fresh"] != second["fresh"]  # seeded as steplib seeds: each rank its own
    # Before: both ranks restored the saving process's generators and drew alike.
    assert first["single"] != second["single"]
    for rank in ranks:  # each rank goes on from its own seeded generators, as a fresh run
        assert rank["single"] == rank["fresh"]
    assert len(first["single_warned"]) == 1 and not second["single_warned"]
    assert "rank 0 of 1 alone, and is loaded on 2 ranks" in first["single_warned"][0]
    assert "none is restored" in first["single_warned"][0]


def test_rank_0s_checkpoint_on_two_ranks_restores_rank_0s_generators_alone(
    ranks: list[dict[str, Any]],
) -> None:
    first, second = ranks
    assert first["alone"] == first["after_alone_save"]  # its own: where it was at the save
    assert second["alone"] == second["fresh"]  # not rank 0's: its own seeded generators
    assert first["alone"] != second["alone"]
    assert not first["alone_warned"] and len(second["alone_warned"]) == 1
    assert "rank 0's own alone is restored" in second["alone_warned"][0]

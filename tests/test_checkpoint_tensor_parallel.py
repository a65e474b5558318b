"""Checkpoints of tensor-parallel states (``apply_tp`` alone, and FSDP2 x TP on a 2-D mesh),
gloo, CPU: each rank's shards go through DCP, so a load gives every rank its own shards back
(bit for bit, with the optimizer state and the counters), on the same number of ranks and
resharded onto another (2 TP ranks -> 1, 4 ranks of a 2x2 mesh -> 2 of a 1x2 mesh, and into
a plain module).

Each multi-rank scenario runs once (a module fixture) and the tests read its results.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, Step, TrainState, accumulate, clip, fsdp_wrap, make_train_step
from steplib.checkpoint import load, save
from steplib.distributed.tensor_parallel import apply_tp
from steplib.testing import run_ranks
from tests.checkpoint_helpers import assert_same
from tests.sharded_runs import contents, full

# A load on another number of ranks warns that no rank gets its saved generators back
# (tests/test_resume_other_world_size.py tests the warning); these tests are about the rest.
_RNG_NOT_RESTORED = "ignore:load. checkpoint .* is loaded on:steplib.errors.CheckpointWarning"
pytestmark = pytest.mark.filterwarnings(_RNG_NOT_RESTORED)

UPDATES = 2


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A copy: the TP output is a view (of a DTensor's local tensor), which FSDP2 warns about
        # when its root module returns one.
        return self.down(torch.tanh(self.up(x))).clone()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Mlp()


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _build(mesh_shape: tuple[int, ...], *, seed: int) -> tuple[TrainState, Step, list[Any]]:
    """TP over ``(tp,)``, or FSDP2 x TP over ``(dp, tp)``; AdamW with a schedule; the batches
    of this rank's data-parallel group (the TP ranks of one group share their batches)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    step = clip(make_train_step(_mse), max_norm=1.0)
    if len(mesh_shape) == 1:
        mesh = init_device_mesh("cpu", mesh_shape)
        model = apply_tp(_model(seed), plan, mesh=mesh)
        dp_rank = 0
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        model = apply_tp(_model(seed), plan, mesh=mesh["tp"])
        fully_shard(model, mesh=mesh["dp"])
        step = fsdp_wrap(step)
        dp_rank = mesh["dp"].get_local_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState.create(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
    )
    gen = torch.Generator().manual_seed(10 + dp_rank)
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))] * UPDATES
    return state, step, batches


def _saved_and_loaded(rank: int, world: int, *, root: str, shape: tuple[int, ...]) -> Any:
    """Train, save, then load into a fresh state (other initial weights) on the same mesh."""
    state, step, batches = _build(shape, seed=0)
    for batch in batches:
        state, _ = step(state, batch)
    url = save(state, root, step=step)
    saved = {"local": contents(state), "full": full(state)}
    del state
    state, step, _ = _build(shape, seed=7)
    torch.manual_seed(999)  # the RNG is restored too, on the same ranks
    state = load(url, state, step=step)
    loaded = {"local": contents(state), "full": full(state)}
    del state, step
    return {
        "url": url,
        "saved": saved,
        "loaded": loaded,
        "refused": _refusals(shape, root) if len(shape) == 1 else [],
    }


def _refusals(shape: tuple[int, ...], root: str) -> list[str]:
    """What cannot be saved: inside an open accumulation window (the gradients are DTensors of
    this run's mesh), and without a process group (the shards cannot be written together)."""
    state, step, batches = _build(shape, seed=0)
    state, _ = accumulate(step, 2)(state, batches[0])
    messages = []
    for attempt in ("window", "no group"):
        if attempt == "no group":
            dist.destroy_process_group()
            state = state.replace(window=state.window._replace(size=0))
        try:
            save(state, f"{root}/refused")
        except ConfigError as err:
            messages.append(str(err))
    return messages


def _resharded(rank: int, world: int, *, url: str, shape: tuple[int, ...]) -> Any:
    state, step, _ = _build(shape, seed=7)
    state = load(url, state, step=step)
    found = full(state)
    found["counters"] = contents(state)["counters"]
    del state, step
    return found


def _assert_loaded_as_saved(result: dict[str, Any]) -> None:
    saved, loaded = result["saved"], result["loaded"]
    for key in ("params", "optimizer", "lr", "scheduler", "counters", "rng"):
        assert_same(loaded["local"][key], saved["local"][key], key)
    assert_same(loaded["full"], saved["full"], "whole tensors")


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("tp"))
    return run_ranks(functools.partial(_saved_and_loaded, root=root, shape=(2,)), timeout=60)


def test_tp_checkpoint_gives_every_rank_its_own_shards_back(tp: list[dict[str, Any]]) -> None:
    rank0, rank1 = tp
    assert rank0["url"] == rank1["url"]
    # Really sharded: the ranks hold different halves, so a mix-up would show.
    assert not torch.equal(
        rank0["saved"]["local"]["params"][0], rank1["saved"]["local"]["params"][0]
    )
    for result in tp:
        _assert_loaded_as_saved(result)
        assert result["loaded"]["local"]["counters"] == [UPDATES, UPDATES, 0, 0]


def test_tp_saves_that_cannot_work_are_refused_with_the_fix(tp: list[dict[str, Any]]) -> None:
    for result in tp:
        window, no_group = result["refused"]
        assert "open accumulation window" in window and "tensor-parallel" in window
        assert "Save between windows" in window
        assert "DTensor parameters" in no_group and "no process group" in no_group
        assert "before dist.destroy_process_group()" in no_group


def test_a_2_rank_tp_checkpoint_loads_into_1_rank(tp: list[dict[str, Any]]) -> None:
    url = tp[0]["url"]
    (found,) = run_ranks(functools.partial(_resharded, url=url, shape=(1,)), world=1, timeout=60)
    assert found.pop("counters") == [UPDATES, UPDATES, 0, 0]
    assert_same(found, tp[0]["saved"]["full"], "2 TP ranks -> 1")


def test_a_2_rank_tp_checkpoint_loads_into_a_plain_module(tp: list[dict[str, Any]]) -> None:
    model = _model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    state = load(tp[0]["url"], state, step=clip(make_train_step(_mse), max_norm=1.0))
    assert (state.step, state.micro_step) == (UPDATES, UPDATES)
    assert_same(full(state), tp[0]["saved"]["full"], "2 TP ranks -> plain module")


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("fsdp-tp"))
    run = functools.partial(_saved_and_loaded, root=root, shape=(2, 2))
    return run_ranks(run, world=4, timeout=90)


def test_fsdp_tp_checkpoint_on_a_2d_mesh_gives_every_rank_its_own_shards_back(
    fsdp_tp: list[dict[str, Any]],
) -> None:
    assert len({result["url"] for result in fsdp_tp}) == 1
    # Four different shards of the first weight (dp x tp): a mix-up would show.
    firsts = [result["saved"]["local"]["params"][0] for result in fsdp_tp]
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
    for result in fsdp_tp:
        _assert_loaded_as_saved(result)


def test_a_4_rank_fsdp_tp_checkpoint_loads_into_2_ranks(fsdp_tp: list[dict[str, Any]]) -> None:
    url = fsdp_tp[0]["url"]
    run = functools.partial(_resharded, url=url, shape=(1, 2))
    for found in run_ranks(run, world=2, timeout=60):
        assert found.pop("counters") == [UPDATES, UPDATES, 0, 0]
        assert_same(found, fsdp_tp[0]["saved"]["full"], "2x2 mesh -> 1x2 mesh")

"""A GAN whose two models are each under DDP (``model={"G": apply_ddp(g), "D": apply_ddp(d)}``)
resumes bit for bit on 2 gloo ranks with per-rank data and dropout: it is saved as a sharded
checkpoint (every rank writes its RNG and data position, rank 0 alone commits), never as one
plain checkpoint that every rank writes to the same name (the last writer's RNG and data won,
and the ranks' commits raced). Saved mid-window and at a window boundary: the boundary once
differed in the last bits (D's reducer, armed by G's loss running through D, all-reduced D's
no_sync micro-batches in the uninterrupted run; the resumed run's fresh reducer did not)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from steplib import ConfigError, TrainState, accumulate, ddp_wrap, make_train_step
from steplib.checkpoint import list_checkpoints, load, save
from steplib.data import resumable_loader
from steplib.testing import run_ranks
from tests.test_several_optimizers import d_loss, g_loss

BATCHES = 6  # in all; windows of 2 batches


def _build(rank: int) -> tuple[TrainState, Any, Any, Any, nn.Module, nn.Module]:
    from steplib.distributed import apply_ddp

    torch.manual_seed(0)
    g: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2))
    d: nn.Module = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))
    g, d = apply_ddp(g), apply_ddp(d)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-2, betas=(0.5, 0.9))
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    d_step = ddp_wrap(accumulate(make_train_step(d_loss, optimizer="D"), 2))
    g_step = ddp_wrap(accumulate(make_train_step(g_loss, optimizer="G"), 2))
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    data = TensorDataset(torch.randn(24, 2, generator=gen) + 1, torch.randn(24, 4, generator=gen))
    loader = resumable_loader(data, batch_size=4, seed=rank, shard=False)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    return state, d_step, g_step, loader, g, d


def _train(state: TrainState, d_step: Any, g_step: Any, batches: Any, n: int) -> tuple[Any, list]:
    losses = []
    for _, batch in zip(range(n), batches, strict=False):
        state, out_d = d_step(state, batch)
        state, out_g = g_step(state, batch)
        losses.append((float(out_d.loss), float(out_g.loss)))
    return state, losses


def _run(rank: int, world: int, *, root: str, save_after: int) -> dict[str, Any]:
    state, d_step, g_step, loader, g, d = _build(rank)
    batches = iter(loader)
    state, _ = _train(state, d_step, g_step, batches, save_after)
    url = save(state, root, data=loader, step=g_step)
    state, rest = _train(state, d_step, g_step, batches, BATCHES - save_after)
    want = [p.detach().clone() for p in (*g.parameters(), *d.parameters())]
    del state, d_step, g_step, g, d  # free the reducers before building the next ones

    torch.manual_seed(12345)  # scrambled: the generators must come from the checkpoint
    state, d_step, g_step, loader, g, d = _build(rank)
    state = load(url, state, data=loader, step=g_step)
    state, resumed = _train(state, d_step, g_step, iter(loader), BATCHES - save_after)
    got = [p.detach().clone() for p in (*g.parameters(), *d.parameters())]
    del state, d_step, g_step, g, d
    return {"url": url, "want": rest, "got": resumed, "same": list(map(torch.equal, got, want))}


@pytest.mark.parametrize("save_after", [3, 4], ids=["mid_window", "window_boundary"])
def test_a_gan_under_ddp_resumes_bit_for_bit_on_two_ranks(tmp_path: Path, save_after: int) -> None:
    run_one = functools.partial(_run, root=str(tmp_path), save_after=save_after)
    results = run_ranks(run_one, timeout=120)
    for result in results:
        assert result["got"] == result["want"]  # every loss of every rank, bit for bit
        assert all(result["same"])  # every parameter of both models, bit for bit
    assert results[0]["want"] != results[1]["want"]  # the ranks did see other data
    assert results[0]["url"] == results[1]["url"]  # one checkpoint, committed once
    (saved,) = list_checkpoints(str(tmp_path))
    assert saved.step == save_after // 2


def _save_with_d_mid_window(rank: int, world: int, *, root: str) -> str:
    state, d_step, _, loader, g, d = _build(rank)
    g_step = ddp_wrap(make_train_step(g_loss, optimizer="G"))  # G updates on every batch
    state, _ = _train(state, d_step, g_step, iter(loader), 3)  # D's second window: half done
    assert state.window.size == 0 and state["D"].window.size == 1
    url = save(state, root, data=loader, step={"D": d_step, "G": g_step})
    del state, d_step, g_step, g, d
    return url


def test_a_checkpoint_with_an_open_window_of_the_second_optimizer_is_refused_on_one_rank(
    tmp_path: Path,
) -> None:
    # The state's counters are G's, whose window is closed; D's holds each rank's own gradients,
    # which fit no other number of ranks. Before the fix only G's window was looked at, and one
    # process loaded rank 0's half window of D as if it were the whole run's.
    url = run_ranks(functools.partial(_save_with_d_mid_window, root=str(tmp_path)), timeout=120)[0]
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2))
    d = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizers = {"G": torch.optim.Adam(g.parameters()), "D": torch.optim.Adam(d.parameters())}
    state = TrainState.create(model={"G": g, "D": d}, optimizer=optimizers)
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(ConfigError, match=r"inside an accumulation window by 2 DDP ranks"):
        load(url, state)
    assert all(map(torch.equal, before, state.model.parameters()))  # nothing changed
    assert all(p.grad is None for p in state.model.parameters())

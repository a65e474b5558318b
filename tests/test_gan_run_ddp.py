"""A GAN through ``run`` on 2 gloo ranks (issue 28): both steps under ``ddp_wrap``, each model
under DDP, run in order on each batch with periodic checkpoints; stopped mid-epoch and resumed
with ``resume_from``, every rank ends where the uninterrupted run ends (every loss of both
steps and every parameter bit for bit), and the ranks hold the same parameters (DDP
averaged)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from steplib import (
    Events,
    Stop,
    TrainState,
    accumulate,
    checkpoint_every,
    ddp_wrap,
    make_train_step,
    resume_from,
    run,
)
from steplib.checkpoint import list_checkpoints
from steplib.data import resumable_loader
from steplib.testing import run_ranks
from tests.test_several_optimizers import d_loss, g_loss

EPOCHS, STOP_AT = 2, 4  # 3 updates per epoch; stopped at update 4, mid-epoch 2


def _build(rank: int) -> tuple[TrainState, dict[str, Any], Any, list[nn.Module]]:
    from steplib.distributed import apply_ddp

    torch.manual_seed(0)
    g: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2))
    d: nn.Module = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))
    g, d = apply_ddp(g), apply_ddp(d)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-2, betas=(0.5, 0.9))
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    steps = {
        "D": ddp_wrap(accumulate(make_train_step(d_loss, optimizer="D"), 2)),
        "G": ddp_wrap(accumulate(make_train_step(g_loss, optimizer="G"), 2)),
    }
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    data = TensorDataset(torch.randn(24, 2, generator=gen) + 1, torch.randn(24, 4, generator=gen))
    loader = resumable_loader(data, batch_size=4, seed=rank, shard=False)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    return state, steps, loader, [g, d]


def _recorder(losses: dict[int, tuple[float, float]]) -> Any:
    def record(event: Any) -> None:
        losses[event.step] = (float(event.outputs["D"].loss), float(event.outputs["G"].loss))

    return record


def _params(models: list[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]


def _run(rank: int, world: int, *, root: str) -> dict[str, Any]:
    state, steps, loader, models = _build(rank)
    full: dict[int, tuple[float, float]] = {}
    run(steps, state, loader, events=Events().on("step_end", _recorder(full)), max_epochs=EPOCHS)
    want = _params(models)
    del state, steps, models  # free the reducers before building the next ones

    state, steps, loader, models = _build(rank)
    ckpt = checkpoint_every(root, every=2, at_end=False)
    events = Events(ckpt).on("step_end", lambda e: Stop("interrupted"), once=STOP_AT)
    first = run(steps, state, loader, events=events, max_epochs=EPOCHS)
    assert (first.step, first.epoch) == (STOP_AT, 1)
    del state, first, steps, models

    torch.manual_seed(12345)  # scrambled: the generators must come from the checkpoint
    state, steps, loader, models = _build(rank)
    resumed: dict[int, tuple[float, float]] = {}
    events = Events(resume_from(ckpt), ckpt).on("step_end", _recorder(resumed))
    last = run(steps, state, loader, events=events, max_epochs=EPOCHS)
    got = _params(models)
    counters = (last.step, last["D"].step, last.epoch)
    del state, last, steps, models
    return {
        "full": full,
        "resumed": resumed,
        "same": [torch.equal(a, b) for a, b in zip(got, want, strict=True)],
        "params": want,
        "counters": counters,
    }


def test_a_gan_through_run_under_ddp_resumes_mid_epoch_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(functools.partial(_run, root=str(tmp_path)), timeout=180)
    for result in results:
        assert sorted(result["full"]) == list(range(1, 3 * EPOCHS + 1))
        # Every later loss of both steps (global: summed over the ranks), bit for bit.
        assert result["resumed"] == {s: result["full"][s] for s in range(STOP_AT + 1, 7)}
        # Every parameter bit for bit, though the run resumes at a window boundary (where
        # the resumed D's fresh DDP reducer once all-reduced less than the uninterrupted one).
        assert all(result["same"])
        assert result["counters"] == (3 * EPOCHS, 3 * EPOCHS, EPOCHS)
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))  # DDP averaged
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 4, 6]

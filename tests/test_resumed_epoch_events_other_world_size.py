"""A run saved on 2 ranks (gloo, ``resumable_loader(shard=True)``) and resumed in 1 process
without a process group (docs/resume_on_another_world_size.md) emits the rest of the
uninterrupted 1-process run's events: each step event's ``batch_index`` counted from its
epoch's start in the new world size's batches (``ResumableLoader.resumed_at``: the samples the
2 ranks consumed together, over the new global batch), no second ``epoch_start`` for the epoch
it continues, and the samples of that run, batch by batch. (A ``resumed_at`` counted in
the saving ranks' batches of 2 gave indices 6, 7, 8 for batches 3, 4, 5 of epoch 0.)

24 samples; 2 ranks x 2 per batch, or 1 process x 4: 6 updates per epoch either way, 3 epochs.
The 2-rank run stops (and has saved, every update) inside epoch 0, at its last update (every
batch yielded, the epoch counted by the stopped run), and inside epoch 1.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from steplib import Events, Stop, TrainState, ddp_wrap, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks

# A load on another number of ranks warns that no rank gets its saved generators back
# (tests/test_resume_other_world_size.py tests the warning); these tests are about the rest.
_RNG_NOT_RESTORED = "ignore:load. checkpoint .* is loaded on:steplib.errors.CheckpointWarning"
pytestmark = pytest.mark.filterwarnings(_RNG_NOT_RESTORED)

SAMPLES, GLOBAL_BATCH, EPOCHS = 24, 4, 3


def _run(rank: int, world: int, *, url: str, stop_at: int | None, resume: bool) -> Any:
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(2, 1)
    model = apply_ddp(model) if torch.distributed.is_initialized() else model
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[list[int]] = []

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        ids, x = batch
        seen.append(ids.tolist())
        return F.mse_loss(m(x), x[:, :1])

    data = TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 2))
    loader = resumable_loader(data, batch_size=GLOBAL_BATCH // world, seed=3, shard=True)
    events, recorded = Events(), []
    for name in ("epoch_start", "step_end", "epoch_end"):
        events.on(name, lambda e: recorded.append((e.name, e.epoch, e.batch_index)))
    if resume:
        events.on("fit_start", resume_from(url, data=loader))
    if stop_at is not None:
        events.add(checkpoint_every(url, every=1, data=loader))
        events.on("step_end", lambda e: Stop("pause") if e.step == stop_at else None)
    step = make_train_step(loss_fn)
    step = ddp_wrap(step) if torch.distributed.is_initialized() else step
    state = run(step, state, loader, events=events, max_epochs=EPOCHS)
    result = {"events": recorded, "seen": seen, "step": state.step, "epoch": state.epoch}
    del state, step, model  # free the DDP model before the process group goes
    return result


@pytest.mark.parametrize("stop_at", [3, 6, 8])
def test_a_run_resumed_on_fewer_ranks_has_the_batch_indices_and_epochs_of_an_uninterrupted_one(
    tmp_path: Path, stop_at: int
) -> None:
    url = str(tmp_path / "ckpt")
    want = _run(0, 1, url=url, stop_at=None, resume=False)  # this process: no process group
    two = run_ranks(functools.partial(_run, url=url, stop_at=stop_at, resume=False), world=2)
    resumed = _run(0, 1, url=url, stop_at=None, resume=True)

    assert two[0]["events"] == two[1]["events"]
    assert two[0]["events"] + resumed["events"] == want["events"]
    assert ("step_end", 1, 1) in want["events"]
    assert want["events"].count(("epoch_start", 1, None)) == 1
    # The 2 ranks' batches together are the 1-process run's, and the resumed run goes on.
    together = [sorted(a + b) for a, b in zip(two[0]["seen"], two[1]["seen"], strict=True)]
    assert together == [sorted(ids) for ids in want["seen"][:stop_at]]
    assert resumed["seen"] == want["seen"][stop_at:]
    assert (resumed["step"], resumed["epoch"]) == (want["step"], want["epoch"]) == (18, EPOCHS)

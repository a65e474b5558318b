"""``TrainMetrics`` resumed on another number of ranks: the first read after the resume covers
every rank's micro-batches of the interval, as the one-process run on the whole batch does.

Its aux sums are per rank (the loss and target counts a step reports are global already) and
all-reduced at each read. A checkpoint taken between two reads holds the interval's sums; on
another world size every rank loads rank 0's file, so the interval's aux came from rank 0's
share alone (resumed on 1 process: a mean over rank 0's samples before the save and every
sample after it; on more ranks: rank 0's share counted on each of them).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from steplib import Event, Events, TrainState, accumulate, ddp_wrap, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.handlers import TrainMetrics
from steplib.testing import run_ranks

# A load on another number of ranks warns that no rank gets its saved generators back
# (tests/test_resume_other_world_size.py tests the warning); these tests are about the rest.
_RNG_NOT_RESTORED = "ignore:load. checkpoint .* is loaded on:steplib.errors.CheckpointWarning"
pytestmark = pytest.mark.filterwarnings(_RNG_NOT_RESTORED)

GLOBAL_MICRO_BATCH = 8  # 4 per rank on 2 ranks; 2 micro-batches an update, 4 updates an epoch
SAVE_AT, UPDATES = 3, 4  # read every 2 updates: the save holds update 3, read at update 4


class KilledError(Exception):
    """The process dies here, after the save."""


def _loss_fn(model: nn.Module, batch: Any) -> Any:
    x, y = batch
    # An aux value that differs from sample to sample, so each rank's share has its own mean.
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel(), {"x0": x[:, 0].mean()}


def _train(root: Path, *, world: int, kill: bool = False) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(6, 4)
    model = apply_ddp(model) if world > 1 else model
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(_loss_fn), 2)
    step = ddp_wrap(step) if world > 1 else step
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(64, 6, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    )
    loader = resumable_loader(data, batch_size=GLOBAL_MICRO_BATCH // world, seed=0, shard=True)
    train = TrainMetrics()
    ckpt = checkpoint_every(str(root), every=SAVE_AT, at_end=False)
    events = Events(resume_from(ckpt), train, ckpt)
    reads: list[dict[str, Any]] = []
    events.on("step_end", lambda e: reads.append(train.read(e)), every=2)

    def killed(event: Event) -> None:
        raise KilledError

    if kill:
        events.on("step_end", killed, once=SAVE_AT, last=True)
    with contextlib.suppress(KilledError):
        run(step, state, loader, events=events, max_steps=UPDATES)
    del model, state, step, events  # free the DDP reducer before the process group goes
    return reads


def _on_ranks(rank: int, world: int, *, root: Path, kill: bool) -> list[dict[str, Any]]:
    return _train(root, world=world, kill=kill)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One process on the whole micro-batch, uninterrupted."""
    return _train(tmp_path_factory.mktemp("reference"), world=1)


def test_resumed_on_one_process_the_first_read_covers_every_ranks_share(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    run_ranks(functools.partial(_on_ranks, root=tmp_path, kill=True))
    (resumed,) = _train(tmp_path, world=1)  # from update 3, read at update 4
    assert resumed.keys() == reference[1].keys()
    assert resumed["updates"] == 2 and resumed["num_targets"] == reference[1]["num_targets"]
    assert resumed["loss"] == pytest.approx(reference[1]["loss"], rel=1e-6)
    assert resumed["x0"] == pytest.approx(reference[1]["x0"], rel=1e-6)


def test_resumed_on_the_same_ranks_the_reads_are_the_uninterrupted_runs_bit_for_bit(
    tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    uninterrupted = run_ranks(functools.partial(_on_ranks, root=tmp_path / "a", kill=False))
    run_ranks(functools.partial(_on_ranks, root=tmp_path / "b", kill=True))
    resumed = run_ranks(functools.partial(_on_ranks, root=tmp_path / "b", kill=False))
    for rank in (0, 1):
        assert resumed[rank] == uninterrupted[rank][1:]
    assert uninterrupted[0][1]["x0"] == pytest.approx(reference[1]["x0"], rel=1e-6)

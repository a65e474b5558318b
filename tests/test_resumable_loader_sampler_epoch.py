"""A ``ResumableLoader`` over a sampler whose order follows ``set_epoch`` (a
``DistributedSampler``, as in pytorch/examples' ddp-tutorial-series) resumes inside an epoch
with that epoch's order: its position holds the sampler's epoch.

Before, the position held the batches yielded but not the epoch, and ``run`` rightly emits no
``epoch_start`` for the rest of an epoch that a loaded position continues, so the handler
``events.on("epoch_start", lambda e: sampler.set_epoch(e.epoch))`` did not run either: resumed
after 1 of 4 batches of epoch 1, a fresh sampler (epoch 0) gave the rest of epoch 0's order:
3 of the rank's 8 samples of epoch 1 were left out and 3 of the other rank's trained in their
place, with no warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler, TensorDataset

import steplib as sl
from steplib import ConfigError
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import ResumableLoader

DATA = TensorDataset(torch.arange(16.0))  # rank 0 of 2: 8 samples, 4 batches an epoch


def _loader(kind: str) -> tuple[ResumableLoader, DistributedSampler[Any]]:
    sampler: DistributedSampler[Any] = DistributedSampler(DATA, num_replicas=2, rank=0, seed=0)
    gen = torch.Generator().manual_seed(0)
    if kind == "sampler":
        return ResumableLoader(DATA, batch_size=2, sampler=sampler, generator=gen), sampler
    batches = BatchSampler(sampler, batch_size=2, drop_last=False)
    return ResumableLoader(DATA, batch_sampler=batches, generator=gen), sampler


def _run(
    root: Path, kind: str, *, every: int = 5, max_steps: int | None = None, handler: bool = True
) -> list[list[float]]:
    """Train 3 epochs (or to ``max_steps``) from the newest checkpoint in ``root``, with new
    objects, as a restarted process; return the samples of every batch trained."""
    loader, sampler = _loader(kind)
    model = torch.nn.Linear(1, 1)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    seen: list[list[float]] = []

    def loss_fn(net: torch.nn.Module, batch: Any) -> torch.Tensor:
        seen.append(batch[0].tolist())
        return net(batch[0][:, None]).pow(2).mean()

    ckpt = checkpoint_every(str(root), every=every, at_end=False)
    events = sl.Events(resume_from(ckpt), ckpt)
    if handler:  # the tutorial's call; run makes it itself too
        events.on("epoch_start", lambda e: sampler.set_epoch(e.epoch))
    sl.run(
        sl.make_train_step(loss_fn), state, loader, events=events, max_epochs=3, max_steps=max_steps
    )
    return seen


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_a_resume_inside_an_epoch_continues_the_samplers_epoch(tmp_path: Path, kind: str) -> None:
    whole = _run(tmp_path / "whole", kind)
    _run(tmp_path / "stopped", kind, max_steps=7)  # saved at update 5: 1 batch into epoch 1
    assert _run(tmp_path / "stopped", kind) == whole[5:]


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_without_a_set_epoch_handler_run_sets_each_epoch_and_a_resume_continues_it(
    tmp_path: Path, kind: str
) -> None:
    # Before: without the handler every epoch drew epoch 0's order (12 updates, 3 alike).
    whole = _run(tmp_path / "whole", kind, handler=False)
    assert whole == _run(tmp_path / "handled", kind)  # what the tutorial's handler gives
    assert whole[:4] != whole[4:8]
    _run(tmp_path / "stopped", kind, max_steps=7, handler=False)
    assert _run(tmp_path / "stopped", kind, handler=False) == whole[5:]


def test_a_resume_at_an_epochs_end_starts_the_next_epochs_order(tmp_path: Path) -> None:
    # Saved at update 8, the end of epoch 1: the saved epoch is set back, then epoch_start
    # sets the next one, as in the uninterrupted run.
    whole = _run(tmp_path / "whole", "sampler", every=4)
    _run(tmp_path / "stopped", "sampler", every=4, max_steps=10)
    assert _run(tmp_path / "stopped", "sampler", every=4) == whole[8:]


class EpochWithoutAttribute(Sampler[int]):
    """A sampler whose order follows ``set_epoch`` but that does not say its epoch."""

    def __init__(self) -> None:
        self._epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Any:
        return iter(
            torch.randperm(16, generator=torch.Generator().manual_seed(self._epoch)).tolist()
        )

    def __len__(self) -> int:
        return 16


def test_a_sampler_with_set_epoch_but_no_epoch_is_refused_when_the_loader_is_built() -> None:
    with pytest.raises(ConfigError, match=r"EpochWithoutAttribute.*set_epoch.*no int 'epoch'"):
        ResumableLoader(
            DATA, batch_size=2, sampler=EpochWithoutAttribute(), generator=torch.Generator()
        )

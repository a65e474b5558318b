"""A resume whose batches cannot restore their position says so: a plain ``DataLoader`` (or a
list) starts its epoch over, so a checkpoint taken inside an epoch trains on batches again.
Before, the run resumed in silence (the counters said update 3 of 8 in epoch 0; the epoch then
ran 8 more batches). A checkpoint at an epoch end resumes exactly and is not warned about."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import steplib as sl
from steplib.checkpoint import CheckpointWarning
from tests.reference import Unsized

DATA = TensorDataset(torch.randn(32, 2))  # 8 batches of 4


def _run(root: Path, data: Any, max_steps: int | None = None, **cadence: Any) -> sl.TrainState:
    model = torch.nn.Linear(2, 1)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    step = sl.make_train_step(lambda m, b: m(b[0]).pow(2).mean())
    ckpt = sl.checkpoint_every(str(root), at_end=False, **cadence)
    events = [sl.resume_from(ckpt), ckpt]
    return sl.run(step, state, data, events=events, max_steps=max_steps, max_epochs=2)


def test_a_resume_inside_an_epoch_with_a_plain_data_loader_warns(tmp_path: Path) -> None:
    loader = DataLoader(DATA, batch_size=4, shuffle=True)
    _run(tmp_path, loader, max_steps=3, every=3)
    said = r"step-00000003 was saved after 3 batches of epoch 0, .*\(a DataLoader\) has no state"
    with pytest.warns(CheckpointWarning, match=said):
        assert _run(tmp_path, loader, max_steps=4, every=3).step == 4


def test_a_resume_over_unsized_data_without_a_position_warns(tmp_path: Path) -> None:
    # A generator of the data a run makes (a replay memory sampled at random, the DQN port's
    # agent) without state_dict(): its epoch starts over at a resume, which said nothing, as
    # where an epoch of unsized data ends is unknown. 169 updates for the tutorial's 113.
    unsized = Unsized([DATA[i : i + 4] for i in range(0, 32, 4)])
    _run(tmp_path, unsized, max_steps=3, every=3)
    said = r"saved after 3 batches, .*\(a Unsized\) has neither a length nor state_dict\(\)"
    with pytest.warns(CheckpointWarning, match=said):
        assert _run(tmp_path, unsized, max_steps=4, every=3).step == 4


@pytest.mark.parametrize("kind", ["plain, at epoch ends", "resumable, inside an epoch"])
def test_an_exact_resume_does_not_warn(tmp_path: Path, kind: str) -> None:
    plain = kind.startswith("plain")
    loader = DataLoader(DATA, batch_size=4) if plain else sl.resumable_loader(DATA, batch_size=4)
    cadence: dict[str, Any] = {"epochs": 1} if plain else {"every": 3}
    _run(tmp_path, loader, max_steps=None if plain else 3, **cadence)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run(tmp_path, loader, **cadence).step == 16  # the second epoch, whole


@pytest.mark.parametrize("kind", ["list", "DataLoader"])
def test_a_save_due_at_an_epochs_last_update_is_made_at_its_epoch_end(
    tmp_path: Path, kind: str
) -> None:
    """``every=8`` on the 8th of 8 batches: data without a position tells the epoch's last
    update by the loop's count, so the save waits for the epoch_end (after its handlers, the
    epoch counted) and the resume starts the next epoch. Before, it was saved at the step_end,
    in epoch 0: the resume warned, trained epoch 0 again and ended at update 24, not 16."""
    loader = DataLoader(DATA, batch_size=4)
    data = list(loader) if kind == "list" else loader
    _run(tmp_path, data, max_steps=8, every=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run(tmp_path, data, every=8).step == 16

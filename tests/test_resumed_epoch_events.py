"""A run resumed (or continued) inside an epoch emits the rest of the uninterrupted run's events:
no second ``epoch_start`` for the epoch it continues, and each step event's ``batch_index``
counted from the epoch's start. A handler that starts something per epoch (the hidden state of
a language model set to zeros, as pytorch/examples' word_language_model does at each epoch)
then resumes exactly (tests/test_word_language_model_example.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, Events, Stop, TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader

STOP_AT = 4  # inside the second epoch of 3 batches


def _build(shard: bool) -> tuple[TrainState, Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = resumable_loader(torch.randn(6, 2), batch_size=2, seed=3, shard=shard)
    return state, make_train_step(lambda m, b: F.mse_loss(m(b), b[:, :1])), data


def _recorder(seen: list[tuple[str, int, int | None]]) -> Events:
    events = Events()
    for name in ("epoch_start", "step_end", "epoch_end"):
        events.on(name, lambda e: seen.append((e.name, e.epoch, e.batch_index)))
    return events


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("how", ["resume", "second run"])
def test_a_continued_epoch_has_one_epoch_start_and_its_own_batch_indices(
    tmp_path: Path, how: str, shard: bool
) -> None:
    want: list[tuple[str, int, int | None]] = []
    state, step, data = _build(shard)
    run(step, state, data, events=_recorder(want), max_epochs=3)

    got: list[tuple[str, int, int | None]] = []
    state, step, data = _build(shard)
    events = _recorder(got)
    url = str(tmp_path / "ckpt")
    ckpt = checkpoint_every(url, every=1, data=data)
    stops = events.add(ckpt).on("step_end", lambda e: Stop("pause") if e.step == STOP_AT else None)
    state = run(step, state, data, events=stops, max_epochs=3)
    if how == "resume":  # a new process: everything built again, the checkpoint loaded
        state, step, data = _build(shard)
        resume = resume_from(url, data=data)
        run(step, state, data, events=_recorder(got).add(resume), max_epochs=3)
    else:  # the notebook's next cell: the same loader and the state returned
        run(step, state, data, events=_recorder(got), max_epochs=3)

    assert ("step_end", 1, 1) in want and want.count(("epoch_start", 1, None)) == 1
    assert got == want


@pytest.mark.parametrize("handler", ["resume_from", "checkpoint_every"])
def test_a_checkpoint_handler_given_another_loader_than_the_runs_is_refused(
    tmp_path: Path, handler: str
) -> None:
    """A loader built again beside a handler built with the old one (a notebook cell run
    again): the old loader's position would be restored and saved, and the run's epoch would
    start over in silence."""
    url = str(tmp_path / "ckpt")
    state, step, old = _build(False)
    run(step, state, old, events=[checkpoint_every(url, every=1, data=old)], max_steps=STOP_AT)
    state, step, data = _build(False)
    made = (
        resume_from(url, data=old)
        if handler == "resume_from"
        else checkpoint_every(url, every=1, data=old)
    )
    with pytest.raises(ConfigError, match="another ResumableLoader"):
        run(step, state, data, events=[made], max_epochs=3)

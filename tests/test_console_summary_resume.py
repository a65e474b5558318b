"""The console's summary after a run started again with the same logger (a notebook cell run
again after a crash, resumed from a checkpoint) is the summary of the run without the crash:
each record counted once, no value of a step the new run printed again."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from steplib import Event, Events, TrainState, make_train_step, run, skip_nonfinite
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.handlers import ConsoleLogger, Log


class KilledError(Exception):
    pass


def _run(console: ConsoleLogger, directory: Path, *, bad_update: int | None = None) -> None:
    """10 updates, saved every 4, logged every 2; the loss of ``bad_update`` is inf (skipped),
    and the run is killed after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    loader = resumable_loader(TensorDataset(torch.arange(10.0).view(-1, 1)), batch_size=1, seed=0)
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        loss = (model(batch[0]) - 3).pow(2).mean()
        return loss * float("inf") if calls[0] == bad_update else loss

    def kill(event: Event) -> None:
        if event.step == bad_update:
            raise KilledError

    ckpt = checkpoint_every(str(directory), every=4)
    events = Events(resume_from(ckpt), Log(console, every=2), ckpt).on("step_end", kill, last=True)
    run(skip_nonfinite(make_train_step(loss_fn)), state, loader, events=events, max_steps=10)


def _summary(console: ConsoleLogger) -> str:
    assert isinstance(console.file, io.StringIO)
    console.close()
    return console.file.getvalue().splitlines()[-1]


def test_a_run_started_again_with_the_same_console_summarises_each_record_once(
    tmp_path: Path,
) -> None:
    # Killed at update 6 (its loss inf, skipped) and resumed from the save at 4 with the fix:
    # the summary said "after 6 records" (5 were the run's) and "skipped True (step 6)", a
    # skip that the log of the run, whose step 6 trained, does not hold.
    want = ConsoleLogger(file=io.StringIO())
    _run(want, tmp_path / "uninterrupted")
    got = ConsoleLogger(file=io.StringIO())
    with pytest.raises(KilledError):
        _run(got, tmp_path / "resumed", bad_update=6)
    _run(got, tmp_path / "resumed")
    summary = _summary(want)
    assert _summary(got) == summary
    assert summary.startswith("summary after 5 records, at step 10: ") and "skipped" not in summary

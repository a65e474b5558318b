"""Law 9 for a validation set that shuffles with its own generator (``resumable_loader``'s
default, or ``DataLoader(..., shuffle=True, generator=...)``) or from its epoch (a sharded
``resumable_loader(..., shard=True)``, one epoch a pass): after a kill and a resume, the
evaluator's history, best and the update early stopping stops at equal the uninterrupted
run's, whichever of ``resume_from`` and the evaluator is attached first. Before, the resumed
run's sets drew their order from their seeds again (and the resumed run's sanity pass drew
once more), so its later evaluations were over other batches (``limit_batches``) or summed in
another order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from steplib import Event, Events, TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.handlers import EarlyStopping, Evaluator, make_eval_step

_VAL = TensorDataset(torch.randn(40, 1, generator=torch.Generator().manual_seed(1)))
KILL_AT, MAX_STEPS = 6, 14


class KilledError(Exception):
    """The process dies here."""


def _val_set(kind: str) -> Any:
    if kind == "resumable_loader":
        return resumable_loader(_VAL, batch_size=4, seed=1)  # shuffle=True, its default
    if kind == "sharded":  # its order is drawn from seed + epoch, one epoch a pass
        return resumable_loader(_VAL, batch_size=4, seed=1, shard=True)
    return DataLoader(_VAL, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def _train(
    root: Path, kind: str, limit: int | None, *, resume_first: bool, kill_at: int | None = None
) -> Any:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    step = make_train_step(lambda m, b: (m(b[0]) - 1).pow(2).mean())
    loader = resumable_loader(TensorDataset(torch.randn(32, 1)), batch_size=2, seed=0)
    evaluator = Evaluator(
        make_eval_step(lambda m, b: (m(b[0]) - 1).pow(2)),
        _val_set(kind),
        metrics={"loss": torchmetrics.MeanMetric()},
        every=2,
        limit_batches=limit,
        monitor="val_loss",
    )
    stopper = EarlyStopping(evaluator, patience=2)
    ckpt = checkpoint_every(str(root), every=2)
    handlers = [resume_from(ckpt), evaluator] if resume_first else [evaluator, resume_from(ckpt)]
    events = Events(*handlers, stopper)
    ckpt.attach(events)

    def kill(event: Event) -> None:
        raise KilledError

    if kill_at is not None:
        events.on("step_end", kill, once=kill_at, last=True)
    state = run(step, state, loader, events=events, max_steps=MAX_STEPS)
    return state.step, evaluator.history, evaluator.best.state_dict()


@pytest.mark.parametrize("resume_first", [True, False])
@pytest.mark.parametrize("limit", [2, None])
@pytest.mark.parametrize("kind", ["resumable_loader", "sharded", "DataLoader"])
def test_a_resumed_run_evaluates_the_batches_the_uninterrupted_run_did(
    tmp_path: Path, kind: str, limit: int | None, resume_first: bool
) -> None:
    uninterrupted = _train(tmp_path / "a", kind, limit, resume_first=resume_first)
    with pytest.raises(KilledError):
        _train(tmp_path / "b", kind, limit, resume_first=resume_first, kill_at=KILL_AT)
    resumed = _train(tmp_path / "b", kind, limit, resume_first=resume_first)
    assert resumed == uninterrupted  # the stop update, every value bit for bit, the best

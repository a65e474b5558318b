"""Law 9 at an epoch's last update: a save due there (``every=N`` landing on it, or a
preemption signal during it) used to be written before that epoch's ``epoch_end`` handlers ran,
while a resume counts the epoch as ended: the per-epoch scheduler step and the epoch-end
evaluation were lost for good, and every later learning rate, loss and checkpoint differed.

Each epoch is 3 batches in windows of 2 (``accumulate``): 2 updates, the second closing the
epoch; ``every=2`` lands on every epoch's last update. A plain ``StatefulDataLoader`` resumed
inside an epoch says the full epoch's ``len()``: that epoch's last window is flushed after its
pass ended, and a save there resumed the epoch as not ended, without its ``epoch_end``.
A sharded loader (``shard=True``) resumed inside an epoch yields the rest of it in a fresh pass:
the end of that pass was compared with a whole epoch's batches, never reached, and the save
was made before the ``epoch_end`` (the per-epoch step was lost at the next resume).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from steplib import Events, TrainState, accumulate, make_train_step, run
from steplib.checkpoint import checkpoint_every, list_checkpoints, preemption, resume_from
from steplib.data import resumable_loader
from steplib.handlers import Evaluator, Scheduler
from steplib.handlers.eval_step import make_eval_step

EPOCHS = 3
# torchdata's own constructor calls the deprecated torch.set_vital (ResumableLoader hides it).
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class KilledError(Exception):
    """The process dies here: nothing after it reaches the handlers."""


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).pow(2).mean()


def _train(
    root: Path,
    loader: str,
    *,
    kill_at: tuple[str, int] | None = None,
    signal_at: int | None = None,
) -> dict:
    """One process's run into ``root``, everything built fresh, as after a restart."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    x, y = torch.randn(6, 2), torch.randn(6, 1)
    data = TensorDataset(x, y)
    if loader == "resumable_loader":
        batches: Any = resumable_loader(data, batch_size=2, seed=0)
    elif loader == "sharded":
        batches = resumable_loader(data, batch_size=2, seed=0, shard=True)
    else:
        batches = StatefulDataLoader(data, batch_size=2)
    evaluator = Evaluator(
        make_eval_step(lambda m, b: (m(b[0]) - b[1]).pow(2).mean(1)),
        [(x, y)],
        metrics={"loss": torchmetrics.MeanMetric()},
        at_epoch_end=True,
        monitor="val_loss",
        sanity_batches=0,
    )
    scheduler = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    ckpt = checkpoint_every(str(root / "ckpt"), every=2)
    losses: list[tuple[int, float]] = []
    events = Events(resume_from(ckpt), evaluator, scheduler, ckpt)
    events.on("step_end", lambda e: losses.append((e.step, float(e.output.loss))))
    if signal_at is not None:
        events.on("step_end", lambda e: os.kill(os.getpid(), signal.SIGUSR1), once=signal_at)
        events.add(preemption(ckpt, signals=(signal.SIGUSR1,)))
    if kill_at is not None:

        def kill(event: Any) -> None:
            raise KilledError

        events.on(kill_at[0], kill, once=kill_at[1], last=True)  # after the save, as a kill is
    state = run(accumulate(make_train_step(_mse), 2), state, batches, events=events, max_epochs=3)
    return {
        "counters": (state.step, state.micro_step, state.epoch),
        "parameters": [p.detach().clone() for p in model.parameters()],
        "lr": opt.param_groups[0]["lr"],
        "losses": losses,
        "history": evaluator.history,
        "checkpoints": [(c.step, c.epoch, c.metrics) for c in list_checkpoints(str(root / "ckpt"))],
    }


@pytest.fixture(scope="module", params=["resumable_loader", "sharded", "StatefulDataLoader"])
def loader(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, loader: str) -> dict:
    return _train(tmp_path_factory.mktemp("uninterrupted"), loader)


def _assert_continues(want: dict, got: dict) -> None:
    resumed_after = got["losses"][0][0] - 1
    assert got["counters"] == want["counters"] == (2 * EPOCHS, 3 * EPOCHS, EPOCHS)
    assert got["lr"] == want["lr"] == 0.1 * 0.5**EPOCHS  # no per-epoch step lost
    assert all(
        torch.equal(a, b) for a, b in zip(got["parameters"], want["parameters"], strict=True)
    )
    assert got["losses"] == [(s, loss) for s, loss in want["losses"] if s > resumed_after]
    assert got["history"] == want["history"]  # the epoch-end evaluations, all of them
    later = [c for c in got["checkpoints"] if c[0] > resumed_after]
    assert later == [c for c in want["checkpoints"] if c[0] > resumed_after]


# A kill in the epoch_end handlers (a long evaluation), or after them.
@pytest.mark.parametrize("kill_at", [("step_end", 2), ("epoch_end", 1), ("epoch_end", 2)])
def test_a_kill_after_a_save_at_an_epochs_last_update_resumes_its_epoch_end(
    tmp_path: Path, loader: str, uninterrupted: dict, kill_at: tuple[str, int]
) -> None:
    with pytest.raises(KilledError):
        _train(tmp_path, loader, kill_at=kill_at)
    _assert_continues(uninterrupted, _train(tmp_path, loader))


def test_the_checkpoint_at_an_epochs_last_update_holds_its_epoch_end(uninterrupted: dict) -> None:
    # Saved after the epoch-end evaluation: counted as ended, with the update's loss and the
    # evaluation's value (both of that update).
    (step, epoch, metrics), *_ = uninterrupted["checkpoints"]
    assert (step, epoch) == (2, 1)
    assert set(metrics) == {"loss", "val_loss", "best_val_loss"}


@pytest.mark.parametrize("signal_at", [2, 3])
def test_a_preemption_at_an_epochs_last_update_resumes_its_epoch_end(
    tmp_path: Path, loader: str, uninterrupted: dict, signal_at: int
) -> None:
    # At 3, inside an epoch: the resumed pass closes that epoch with update 4, a save due.
    preempted = _train(tmp_path, loader, signal_at=signal_at)
    assert preempted["counters"][0] == signal_at
    resumed = _train(tmp_path, loader)
    assert resumed["losses"][0][0] == signal_at + 1
    _assert_continues(uninterrupted, resumed)


def test_a_run_resumed_twice_continues_the_uninterrupted_one(
    tmp_path: Path, loader: str, uninterrupted: dict
) -> None:
    # Preempted inside epoch 2; resumed, that epoch's last update (a save due) is a plain
    # StatefulDataLoader's flushed window; killed after its epoch_end; resumed again.
    _train(tmp_path, loader, signal_at=3)
    with pytest.raises(KilledError):
        _train(tmp_path, loader, kill_at=("epoch_end", 2))
    resumed = _train(tmp_path, loader)
    assert resumed["losses"][0][0] == 5
    _assert_continues(uninterrupted, resumed)

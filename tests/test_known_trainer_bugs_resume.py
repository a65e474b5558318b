"""Silent bugs other trainers shipped around checkpoints and resume, one test per class, each
citing the thread where users met it (the others are in ``test_known_trainer_bugs.py``).

Each run is killed after a save (as a process dies: nothing after it reaches a handler), then
built again from scratch and resumed with ``resume_from``; it must equal the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    EMA,
    EarlyStopping,
    Evaluator,
    Events,
    TrainState,
    accumulate,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
)
from steplib.checkpoint import best_checkpoint, list_checkpoints, load_weights
from steplib.data import resumable_loader
from steplib.handlers import Scheduler, evaluate
from tests.reference import tiny_model


class KilledError(Exception):
    """The process dies here."""


def _kill(event: Any) -> None:
    raise KilledError


def _run_or_killed(step: Any, state: TrainState, data: Any, events: Events, **limits: Any) -> Any:
    try:
        return run(step, state, data, events=events, **limits)
    except KilledError:
        return None


# A one-weight model whose weight counts the updates (SGD, lr 1, gradient -1), and a
# validation value read by that count: which update scored what is known.
VALUES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5, 10: 1.5, 12: 0.5, 14: 0.4, 16: 0.3}


def _counter() -> TrainState:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))


COUNT = make_train_step(lambda m, b: b[0].sum() * 0 - m.weight.sum())


def _value(model: nn.Module, batch: Any) -> torch.Tensor:
    return torch.full((1,), VALUES.get(round(next(model.parameters()).item()), 9.0))


@dataclasses.dataclass
class Stopped:
    step: int
    best: tuple[float | None, int | None]


def _early_stopped(root: Path, *, kill_at: int | None = None) -> Stopped:
    evaluator = Evaluator(
        make_eval_step(_value),
        [torch.zeros(1)],
        metrics={"loss": MeanMetric()},
        every=2,
        monitor="val_loss",
    )
    stopper = EarlyStopping(evaluator, patience=3)
    ckpt = checkpoint_every(str(root), every=2)
    events = Events(resume_from(ckpt), evaluator, stopper, ckpt)
    if kill_at is not None:
        events.on("step_end", _kill, once=kill_at, last=True)  # after the save
    data = resumable_loader(TensorDataset(torch.zeros(8, 1)), batch_size=1, seed=0)
    state = _run_or_killed(COUNT, _counter(), data, events, max_steps=16)
    step = -1 if state is None else state.step
    return Stopped(step, (stopper.best.value, stopper.best.step))


# https://github.com/Lightning-AI/pytorch-lightning/issues/1463 (patience and best reset on
# resume) and https://github.com/Lightning-AI/pytorch-lightning/issues/1464 (saved a check late)
def test_early_stopping_resumed_stops_where_the_uninterrupted_run_stops(tmp_path: Path) -> None:
    # Uninterrupted: best 1.0 at update 4; 2.0, 2.5, 1.5 at 6, 8, 10: the 3rd check without
    # improvement stops at 10. A resume at 6 that forgot the best would take 2.5 at 8 as its
    # best, improve at 10 and 12, and run to 16.
    whole = _early_stopped(tmp_path / "whole")
    assert whole == Stopped(10, (1.0, 4))
    assert _early_stopped(tmp_path / "killed", kill_at=6).step == -1
    assert _early_stopped(tmp_path / "killed") == whole


# https://github.com/atomistic-machine-learning/schnetpack/issues/239 and
# https://github.com/GestaltCogTeam/BasicTS/issues/312 (a run that had stopped trains again)
def test_a_run_that_early_stopping_ended_does_not_train_again_when_resumed(tmp_path: Path) -> None:
    first = _early_stopped(tmp_path)
    assert first.step == 10
    again = _early_stopped(tmp_path)  # the same script run again on the same directory
    assert again == first  # no update after the stop, the same best
    assert max(c.step for c in list_checkpoints(str(tmp_path))) == 10


# name -> (the scheduler, the rate of each epoch's 3 updates)
SCHEDULES: dict[str, tuple[Any, list[float]]] = {
    "StepLR": (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.1), [1, 0.1, 0.01, 1e-3]),
    # Its milestones are a collections.Counter: every save refused it ("not plain").
    "MultiStepLR": (
        lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [2, 3], 0.1),
        [1, 1, 0.1, 0.01],
    ),
}


def _per_epoch_rates(
    root: Path, schedule: str, *, kill_after: int | None = None
) -> list[tuple[int, float]]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState.create(model=model, optimizer=opt)
    sched = Scheduler(SCHEDULES[schedule][0](opt))
    # Saved every 3 updates, which is every epoch's last update, due before the epoch_end
    # that steps the scheduler (Lightning saved the scheduler unstepped there).
    ckpt = checkpoint_every(str(root), every=3)
    rates: list[tuple[int, float]] = []
    events = Events(resume_from(ckpt), sched, ckpt)
    events.on("step_end", lambda e: rates.append((e.step, float(e.output.lr))))
    if kill_after is not None:  # the process dies once the epoch ended and it saved
        events.on("epoch_end", _kill, once=kill_after, last=True)
    data = resumable_loader(TensorDataset(torch.randn(3, 8), torch.randn(3, 3)), batch_size=1)
    step = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1].flatten()))
    _run_or_killed(step, state, data, events, max_epochs=4)
    return rates


# https://github.com/Lightning-AI/pytorch-lightning/issues/4655 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/1772 (scheduler one epoch behind)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_per_epoch_schedule_is_not_an_epoch_behind_after_a_resume(
    tmp_path: Path, schedule: str
) -> None:
    whole = _per_epoch_rates(tmp_path / "whole", schedule)
    rates = [rate for rate in SCHEDULES[schedule][1] for _ in range(3)]
    assert [lr for _, lr in whole] == pytest.approx(rates)
    killed = _per_epoch_rates(tmp_path / "killed", schedule, kill_after=2)  # at update 6
    resumed = _per_epoch_rates(tmp_path / "killed", schedule)
    assert killed + resumed == whole


def _seen_batches(root: Path, *, kill_at: int | None = None) -> tuple[list[int], list[Any]]:
    torch.manual_seed(0)
    model = tiny_model(0, dropout=0.2)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[int] = []

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        index, x = batch
        seen.extend(int(i) for i in index)
        return model(x).pow(2).mean()

    ckpt = checkpoint_every(str(root), every=2)
    events = Events(resume_from(ckpt), ckpt)
    if kill_at is not None:
        events.on("step_end", _kill, once=kill_at, last=True)
    dataset = TensorDataset(torch.arange(10), torch.randn(10, 8))
    data = resumable_loader(dataset, batch_size=1, seed=3)  # shuffled every epoch
    state = _run_or_killed(
        accumulate(make_train_step(loss_fn), 3), state, data, events, max_steps=8
    )
    return seen, [] if state is None else [p.detach().clone() for p in model.parameters()]


# https://github.com/Lightning-AI/pytorch-lightning/issues/1182 (a resume restarted the epoch)
# and https://github.com/huggingface/transformers/issues/5605 (skipped updates, not batches)
def test_a_resume_inside_an_epoch_with_accumulation_continues_at_the_next_batch(
    tmp_path: Path,
) -> None:
    whole, weights = _seen_batches(tmp_path / "whole")
    assert len(whole) == 20  # 2 epochs of windows 3, 3, 3, 1: 8 updates
    killed, _ = _seen_batches(tmp_path / "killed", kill_at=2)  # 6 batches into epoch 1
    resumed, resumed_weights = _seen_batches(tmp_path / "killed")
    assert killed == whole[:6] and resumed == whole[6:]
    for got, want in zip(resumed_weights, weights, strict=True):
        assert torch.equal(got, want)


def _averaged(root: Path, *, kill_at: int | None = None) -> tuple[list[torch.Tensor], int]:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ema = EMA(model, decay=0.9, warmup=True)  # the decay depends on the updates counted
    ckpt = checkpoint_every(str(root), every=3)
    events = Events(resume_from(ckpt), ema, ckpt)
    if kill_at is not None:
        events.on("step_end", _kill, once=kill_at, last=True)
    gen = torch.Generator().manual_seed(4)
    dataset = TensorDataset(torch.randn(8, 8, generator=gen), torch.randn(8, 3, generator=gen))
    step = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1].flatten()))
    data = resumable_loader(dataset, batch_size=2, seed=1)
    _run_or_killed(step, state, data, events, max_steps=10)
    return [p.detach().clone() for p in ema.module.parameters()], ema.updates


# https://github.com/ai2cm/ace/issues/349 (EMA not in the checkpoint) and
# https://github.com/lightly-ai/lightly-train/pull/892 (its update count reset on resume)
def test_the_ema_and_its_update_count_are_restored_on_resume(tmp_path: Path) -> None:
    whole, updates = _averaged(tmp_path / "whole")
    assert updates == 10
    _averaged(tmp_path / "killed", kill_at=6)
    resumed, resumed_updates = _averaged(tmp_path / "killed")
    assert resumed_updates == updates
    for got, want in zip(resumed, whole, strict=True):
        assert torch.equal(got, want)


# https://github.com/allenai/deep_qa/issues/199 (best checkpoint by another metric than
# early stopping's) and https://github.com/openclimatefix/pvnet/pull/544 (a "best" that
# was a copy of the last)
def test_every_score_a_checkpoint_records_is_its_own_models(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(6)
    val = [(torch.randn(4, 8, generator=gen), torch.randn(12, generator=gen)) for _ in range(2)]
    train = [(torch.randn(4, 8, generator=gen), torch.randn(12, generator=gen)) for _ in range(7)]

    def val_loss(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"value": F.mse_loss(model(batch[0]), batch[1])}

    eval_step = make_eval_step(val_loss)
    evaluator = Evaluator(
        eval_step, val, metrics={"loss": MeanMetric()}, every=2, monitor="val_loss"
    )
    # Saves every 3 updates and at the end (7): only those at 6 coincide with an evaluation.
    ckpt = checkpoint_every(str(tmp_path), every=3, keep_best=2, metric=evaluator)
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
    run(step, state, train, events=[evaluator, ckpt])
    scored = [c for c in list_checkpoints(str(tmp_path)) if "val_loss" in c.metrics]
    assert [c.step for c in scored] == [6]
    for info in scored:  # the recorded score is that of the weights in that checkpoint
        saved = tiny_model(1)
        load_weights(saved, info.url)
        again = evaluate(eval_step, saved, val, metrics={"loss": MeanMetric()})["loss"]
        assert abs(again - info.metrics["val_loss"]) < 1e-6
    assert best_checkpoint(str(tmp_path), evaluator) == scored[0].url

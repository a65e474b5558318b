"""Law 9 for sweeps with the handlers users attach: a sweep killed after an update and resumed
with ``resume_from`` into freshly built objects ends as the uninterrupted sweep ends, bit for bit.

The table and the driver are ``test_resume_combinations.py``'s (imported, not copied); each
entry of :data:`SCENARIOS` builds one realistic sweep: per-copy rates under a warmup-cosine
``LambdaLR`` with a per-copy evaluator and ``SweepEarlyStopping``; ``SuccessiveHalving`` at
epoch ends under a per-epoch scheduler; one diverging copy stopped by
``skip_nonfinite(max_consecutive=)`` under ``accumulate`` and ``clip`` (and a NaN sample that
skips every copy); background checkpoints with ``keep_last`` and a preemption. The kill points
are a sample: every update of the shorter sets, every other one of the longer, and always
each epoch's last update, each evaluated update and the update before a stop decision; then
every epoch end, micro-batches inside accumulation windows, and clean ``Stop``s. It compares
parameters and optimizer state (the active mask and each copy's skips in a row included) bit
for bit, every handler's ``state_dict()``, the log lines, the checkpoints with their metrics,
the update the run stopped at, and the warnings the runs gave (a diverged copy's, once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn

from steplib import (
    Evaluator,
    Event,
    Events,
    TrainMetrics,
    TrainState,
    accumulate,
    clip,
    make_eval_step,
    make_train_step,
    resume_from,
    skip_nonfinite,
    warmup_cosine,
)
from steplib.cadence import Batches
from steplib.checkpoint import preemption
from steplib.data import resumable_loader
from steplib.handlers import GradNormMonitor, Log, LRMonitor, NonFiniteAlarm, Scheduler
from steplib.param_groups import weight_decay_groups
from steplib.sweep import (
    Copies,
    SuccessiveHalving,
    SweepAdamW,
    SweepEarlyStopping,
    SweepSGD,
    per_copy_metric,
    sweep_step,
)
from tests.test_resume_combinations import (
    Built,
    Outcome,
    _checkpoints,
    _data,
    _go,
    _logs,
    _loss,
    _resumed_differences,
)


def _copies(n: int, *, norm: bool = False) -> Copies:
    """``n`` copies of the combinations' model (dropout included: the resumed RNG draws the
    masks the uninterrupted run drew), each from its own seed; with ``norm``, a BatchNorm
    whose running statistics a stopped copy keeps."""

    def one(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        layers = [nn.Linear(4, 8), *([nn.BatchNorm1d(8)] if norm else []), nn.Tanh()]
        return nn.Sequential(*layers, nn.Dropout(0.2), nn.Linear(8, 1))

    return Copies.stack([one(seed) for seed in range(n)])


def _sweep(step: Any, copies: Copies, data: Any) -> Any:
    return sweep_step(step, copies=copies, example_batch=next(iter(data)))


def _loss_and_mae(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The combinations' loss with an aux value (per copy in TrainMetrics' means)."""
    error = model(batch[0]) - batch[1]
    return error.pow(2).mean(), {"mae": error.abs().mean()}


def _evaluator(copies: Copies, **kwargs: Any) -> Evaluator:
    # The combinations' validation set (targets a third of the training ones), per copy.
    val = _data(8, seed=7)
    batches = [
        (val.tensors[0][:4], 0.3 * val.tensors[1][:4]),
        (val.tensors[0][4:], 0.3 * val.tensors[1][4:]),
    ]
    step = make_eval_step(lambda m, b: {"value": (m(b[0]) - b[1]).pow(2).mean(dim=-1)})
    metrics = {"loss": per_copy_metric(torchmetrics.MeanMetric(), copies.n)}
    return Evaluator(step, batches, metrics=metrics, **kwargs)


# --- the scenarios: each builds everything fresh into `root`, as a restarted process does ---


def adamw_schedule_evaluate_stop(root: Path) -> Built:
    """SweepAdamW with per-copy rates + warmup-cosine LambdaLR + a per-copy Evaluator every 2
    into JSONL and CSV + SweepEarlyStopping (copies stop one by one, then the run) + saves at
    every update, keep_last."""
    copies = _copies(4)
    opt = SweepAdamW(copies.parameters(), lr=[0.003, 0.01, 0.03, 0.3], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=3, total=18))
    state = TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    jsonl, table = _logs(root)
    evaluator = _evaluator(copies, every=2, sinks=[jsonl, table])
    stopper = SweepEarlyStopping("val_loss", patience=2, min_delta=0.02)
    ckpt = _checkpoints(root, every=1, keep_last=2)
    events = Events(resume_from(ckpt), evaluator, stopper, Log([jsonl, table], every=1), ckpt)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    step = _sweep(make_train_step(_loss), copies, data)
    handlers = {"evaluator": evaluator, "stopper": stopper}
    return Built(step, state, data, events, handlers, {"max_epochs": 3}, [jsonl, table])


def sgd_halving_per_epoch(root: Path) -> Built:
    """A BatchNorm model (a stopped copy keeps its running statistics) + SweepSGD with
    per-copy rates and momentum + a per-epoch StepLR + an Evaluator every 4
    and at epoch ends + SuccessiveHalving + TrainMetrics into JSONL + saves every 2 updates and
    every epoch."""
    copies = _copies(4, norm=True)
    opt = SweepSGD(copies.parameters(), lr=[0.01, 0.03, 0.1, 0.2], momentum=[0.0, 0.9, 0.5, 0.9])
    state = TrainState.create(model=copies, optimizer=opt)
    jsonl, _ = _logs(root)
    evaluator = _evaluator(copies, every=4, at_epoch_end=True, sinks=jsonl)
    halving = SuccessiveHalving("val_loss", keep=0.5)
    per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
    train = TrainMetrics()
    ckpt = _checkpoints(root, every=2, epochs=1, keep_last=2)
    events = Events(resume_from(ckpt), evaluator, halving, per_epoch, train)
    events.add(Log(jsonl, sources=[train.read], every=2), ckpt)
    data = resumable_loader(_data(20, seed=1), batch_size=4, shuffle=True, seed=3)
    step = _sweep(make_train_step(_loss), copies, data)
    handlers = {"evaluator": evaluator, "per_epoch": per_epoch, "train": train}  # halving: none
    return Built(step, state, data, events, handlers, {"max_epochs": 2}, [jsonl])


def halving_then_early_stopping(root: Path) -> Built:
    """SuccessiveHalving and SweepEarlyStopping together (halve the field, stop the survivor
    when it plateaus), an Evaluator every 3 into JSONL + TrainMetrics: the last evaluation
    halves away a copy that was still improving and stops the survivor by patience, so every
    copy is stopped while one copy's patience has not run out."""
    copies = _copies(4)
    opt = SweepAdamW(copies.parameters(), lr=[0.02, 0.07, 0.5, 0.8])
    state = TrainState.create(model=copies, optimizer=opt)
    jsonl, _ = _logs(root)
    evaluator = _evaluator(copies, every=3, sinks=jsonl)
    halving = SuccessiveHalving("val_loss", keep=0.5)
    stopper = SweepEarlyStopping("val_loss", patience=2, min_delta=0.1)
    train = TrainMetrics()
    ckpt = _checkpoints(root, every=1, keep_last=2)
    events = Events(resume_from(ckpt), evaluator, halving, stopper, train)
    # Written at the stop's update (9): a run resumed at its end does not write the interval
    # that its killed run had not logged before the save (docs/sweeps.md, what is tested).
    events.add(Log(jsonl, sources=[train.read], every=3), ckpt)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    step = _sweep(make_train_step(_loss), copies, data)
    handlers = {"evaluator": evaluator, "stopper": stopper, "train": train}
    return Built(step, state, data, events, handlers, {"max_epochs": 4}, [jsonl])


def diverging_copy_accumulate_clip(root: Path) -> Built:
    """One diverging copy (lr=1e30) stopped by skip_nonfinite(max_consecutive=2) under
    accumulate(3) and clip, a NaN sample that skips one window of every copy an epoch, a
    warmup-cosine LambdaLR (held on the device where no copy updates) + TrainMetrics (an aux),
    GradNormMonitor and LRMonitor into JSONL and CSV + NonFiniteAlarm."""
    copies = _copies(3)
    opt = SweepAdamW(copies.parameters(), lr=[0.01, 1e30, 0.03], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=2, total=12))
    state = TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    wrapped = skip_nonfinite(clip(make_train_step(_loss_and_mae), max_norm=0.5), max_consecutive=2)
    train, norms, alarm = TrainMetrics(), GradNormMonitor(), NonFiniteAlarm(every=4)
    jsonl, table = _logs(root)
    ckpt = _checkpoints(root, every=1, keep_last=3)
    sources = [train.read, norms.read, LRMonitor().read]
    events = Events(resume_from(ckpt), train, norms, alarm)
    events.add(Log([jsonl, table], sources=sources, every=2), ckpt)
    # 7 batches an epoch: windows of 3, 3 and 1; the NaN sample skips one window an epoch.
    data = resumable_loader(_data(28, seed=1, nan_at=5), batch_size=4, shuffle=True, seed=3)
    step = _sweep(accumulate(wrapped, 3), copies, data)
    handlers = {"train": train, "norms": norms, "alarm": alarm}
    return Built(step, state, data, events, handlers, {"max_epochs": 4}, [jsonl, table])


def background_preemption_seeds(root: Path, *, kill_at: int | None = None) -> Built:
    """Seeds over torch.optim.AdamW (the stacked parameters) + accumulate(2) and clip + a
    per-epoch ExponentialLR + an Evaluator at epoch ends + TrainMetrics + background
    checkpoints every 3 updates, keep_last=2 + a preemption (the signal at ``kill_at``)."""
    copies = _copies(3)
    opt = torch.optim.AdamW(copies.parameters(), lr=0.02)
    state = TrainState.create(model=copies, optimizer=opt)
    evaluator = _evaluator(copies, at_epoch_end=True)
    per_epoch = Scheduler(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8))
    train = TrainMetrics()
    jsonl, _ = _logs(root)
    ckpt = _checkpoints(root, every=3, keep_last=2, background=True)
    events = Events(resume_from(ckpt), evaluator, per_epoch, train)
    events.add(Log(jsonl, sources=[train.read], every=2), ckpt, preemption(ckpt))
    if kill_at is not None:  # as a scheduler would: the signal, a save, a clean stop

        def signal_now(event: Event) -> None:
            os.kill(os.getpid(), signal.SIGUSR1)

        events.on("step_end", signal_now, once=kill_at)
    data = resumable_loader(_data(20, seed=1), batch_size=4, shuffle=True, seed=3)
    step = _sweep(clip(accumulate(make_train_step(_loss), 2), max_norm=1.0), copies, data)
    handlers = {"evaluator": evaluator, "per_epoch": per_epoch, "train": train}
    return Built(step, state, data, events, handlers, {"max_epochs": 3}, [jsonl])


def groups_one_cycle_batches(root: Path) -> Built:
    """SweepAdamW over weight_decay_groups (per-copy decay and rates) +
    OneCycleLR as a factor of each copy's peak + accumulate(2), 7 batches an epoch, with
    cadences in Batches(n): an Evaluator and saves on an epoch's last (shorter) window, and
    SweepEarlyStopping."""
    copies = _copies(3)
    groups = weight_decay_groups(copies, [0.0, 0.01, 0.1])
    opt = SweepAdamW(groups, lr=[0.003, 0.03, 0.1])
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1.0, total_steps=16, cycle_momentum=False
    )
    state = TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    jsonl, table = _logs(root)
    evaluator = _evaluator(copies, every=Batches(3), sinks=[jsonl, table])
    stopper = SweepEarlyStopping("val_loss", patience=3)
    train = TrainMetrics()
    ckpt = _checkpoints(root, every=Batches(4), keep_last=2)
    events = Events(resume_from(ckpt), evaluator, stopper, train)
    events.add(Log([jsonl, table], sources=[train.read], every=Batches(5)), ckpt)
    data = resumable_loader(_data(28, seed=1), batch_size=4, shuffle=True, seed=3)
    step = _sweep(accumulate(make_train_step(_loss), 2), copies, data)
    handlers = {"evaluator": evaluator, "stopper": stopper, "train": train}
    return Built(step, state, data, events, handlers, {"max_epochs": 4}, [jsonl, table])


SCENARIOS: dict[str, Callable[..., Built]] = {
    "adamw_schedule_evaluate_stop": adamw_schedule_evaluate_stop,
    "sgd_halving_per_epoch": sgd_halving_per_epoch,
    "halving_then_early_stopping": halving_then_early_stopping,
    "diverging_copy_accumulate_clip": diverging_copy_accumulate_clip,
    "background_preemption_seeds": background_preemption_seeds,
    "groups_one_cycle_batches": groups_one_cycle_batches,
}


# --- the driver: test_resume_combinations.py's, with the warnings the runs give recorded ---


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The messages of the warnings given inside (each one, however often)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in caught)


def _kills(want: Outcome, evaluated: list[int], *, every: int) -> list[tuple[str, int]]:
    """Every ``every``-th update and each evaluated update, the last update and the one before
    (a stop decision's, when one ended the run), every epoch end, a micro-batch in every 5th
    window's batches, a clean Stop at every 5th update, and a preemption at every 4th."""
    updates = set(range(1, want.step, every)) | {k for k in evaluated if k < want.step}
    updates |= {want.step - 1, want.step} - {0}
    kills = [("step_end", k) for k in sorted(updates)]
    kills += [("epoch_end", e) for e in range(1, want.epoch)]
    kills += [("micro_step_end", m) for m in range(2, want.micro_step, 5)]
    kills += [("stop", k) for k in range(2, want.step, 5)]
    return kills


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_sweep_killed_anywhere_resumes_to_the_uninterrupted_sweep(
    name: str, tmp_path: Path
) -> None:
    build = SCENARIOS[name]
    with _warnings() as warned:
        want = _go(build, tmp_path / "whole")
    assert want is not None
    history = want.handlers.get("evaluator", {}).get("history", [])
    kills = _kills(want, [at for at, _ in history], every=1 if want.step <= 12 else 2)
    if name == "background_preemption_seeds":
        kills += [("preempt", k) for k in range(1, want.step, 4)]
    failures: dict[tuple[str, int], list[str]] = {}
    for kill in kills:
        preempts = kill[0] == "preempt"
        with _warnings() as again:
            found = _resumed_differences(build, tmp_path, want, kill, preempts=preempts)
        if again != warned:  # a copy's stop, warned of once: by the killed run or the resumed
            found = [*found, f"warnings {again} != {warned}"]
        if found:
            failures[kill] = found
    assert not failures, failures

"""torch's Stochastic Weight Averaging recipe (``torch.optim.swa_utils``: the loop of
``AveragedModel``'s docstring) written as its plain loop and with steplib gives the same
parameters, the same averaged model and the same batch-norm statistics after ``update_bn``,
bit for bit, also killed and resumed before ``swa_start``, at it, after it and after the last
epoch (before ``update_bn``):

* a ``CosineAnnealingLR`` stepped after each epoch up to ``swa_start``, then ``SWALR``
  (annealed to ``swa_lr`` over ``anneal_epochs``) after each later epoch;
* ``AveragedModel.update_parameters(model)`` after each epoch past ``swa_start``;
* ``update_bn(loader, swa_model)`` at the end, over the shuffled loader once more (a pass
  whose dropout masks come from torch's global generator).

In steplib the schedulers and the average live in one handler of the user's own (``SWA``
below): its ``state_dict`` / ``load_state_dict`` make checkpoints save and restore it without
being named; ``update_bn`` runs after ``run`` returns, as in the plain loop. The recipe and
what differs in Lightning's callback: docs/migration/README.md, "Stochastic Weight Averaging".
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, SequentialLR
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    Evaluator,
    Events,
    TrainState,
    make_eval_step,
    make_train_step,
    run,
    seed_everything,
)
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.events import Event, Handler, Stop
from tests.checkpoint_helpers import assert_same

EPOCHS, SWA_START, BATCH, SAMPLES, UPDATES = 8, 4, 8, 40, 5  # UPDATES per epoch
LR, SWA_LR, ANNEAL_EPOCHS = 0.1, 0.05, 2


class Net(nn.Module):
    """An MLP with batch norm, and dropout before the second batch norm (so that
    ``update_bn``'s statistics depend on the generator's state too)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _setup() -> tuple[TensorDataset, Net, torch.optim.Optimizer]:
    seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 6, generator=gen), torch.randint(3, (SAMPLES,), generator=gen)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    return TensorDataset(x, y), model, optimizer


def _schedulers(
    optimizer: torch.optim.Optimizer, per_update: bool = False
) -> tuple[CosineAnnealingLR, SWALR]:
    """Both built before training, as in the docstring's loop; with ``per_update`` the first
    one counts updates up to ``swa_start``'s end (Lightning's ``interval="step"``)."""
    steps = (SWA_START + 1) * UPDATES if per_update else EPOCHS
    scheduler = CosineAnnealingLR(optimizer, T_max=steps)
    swa_scheduler = SWALR(optimizer, swa_lr=SWA_LR, anneal_epochs=ANNEAL_EPOCHS)
    return scheduler, swa_scheduler


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@functools.cache  # the tests compare with it, never change it
def _plain(per_update: bool = False) -> dict[str, Any]:
    """``AveragedModel``'s docstring loop (the loader: steplib's shuffled one, for the order);
    with ``per_update``, the first scheduler stepped after each update up to ``swa_start``'s
    end instead of after each epoch."""
    dataset, model, optimizer = _setup()
    loader = resumable_loader(dataset, batch_size=BATCH, seed=3)
    swa_model = AveragedModel(model)
    scheduler, swa_scheduler = _schedulers(optimizer, per_update)
    for i in range(EPOCHS):
        for input, target in loader:
            optimizer.zero_grad()
            loss_fn(model, (input, target)).backward()
            optimizer.step()
            if per_update and i <= SWA_START:
                scheduler.step()
        if i > SWA_START:
            swa_model.update_parameters(model)
            swa_scheduler.step()
        elif not per_update:
            scheduler.step()
    update_bn(loader, swa_model)
    return {"model": model, "swa_model": swa_model, "lr": optimizer.param_groups[0]["lr"]}


class SWA(Handler):
    """The docstring's epoch end as a handler: average and ``SWALR`` after each epoch past
    ``swa_start``, the first scheduler before. Saved with each checkpoint (``state_dict``)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        scheduler: Any,
        swa_scheduler: SWALR,
        swa_start: int,
        per_update: bool = False,
    ) -> None:
        self.model, self.swa_model = model, AveragedModel(model)
        self.scheduler, self.swa_scheduler, self.swa_start = scheduler, swa_scheduler, swa_start
        self.per_update = per_update

    def on_step_end(self, event: Event) -> None:
        if self.per_update and event.epoch <= self.swa_start:  # inside epoch event.epoch
            self.scheduler.step()

    def on_epoch_end(self, event: Event) -> None:
        if event.epoch - 1 > self.swa_start:  # event.epoch counts the epochs completed
            self.swa_model.update_parameters(self.model)
            self.swa_scheduler.step()
        elif not self.per_update:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "swa_model": self.swa_model.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "swa_scheduler": self.swa_scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.swa_model.load_state_dict(state["swa_model"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.swa_scheduler.load_state_dict(state["swa_scheduler"])


def _evaluators(model: nn.Module, swa_model: nn.Module) -> list[Evaluator]:
    """The model every 3 updates, the average at each epoch's end (its batch-norm statistics
    are the model's, copied by update_parameters, until update_bn)."""
    gen = torch.Generator().manual_seed(1)
    val = [(torch.randn(8, 6, generator=gen), torch.randint(3, (8,), generator=gen))]
    step = make_eval_step(lambda m, b: {"value": loss_fn(m, b)})
    return [
        Evaluator(step, val, metrics={"loss": MeanMetric()}, every=3, model=model),
        Evaluator(
            step,
            val,
            metrics={"loss": MeanMetric()},
            at_epoch_end=True,
            model=swa_model,
            prefix="swa_val_",
        ),
    ]


def _steplib(
    url: str | None = None,
    stop_at: int | None = None,
    evaluate: bool = False,
    per_update: bool = False,
) -> dict[str, Any]:
    dataset, model, optimizer = _setup()
    data = resumable_loader(dataset, batch_size=BATCH, seed=3)
    scheduler, swa_scheduler = _schedulers(optimizer, per_update)
    swa = SWA(
        model,
        scheduler=scheduler,
        swa_scheduler=swa_scheduler,
        swa_start=SWA_START,
        per_update=per_update,
    )
    events = Events(swa)
    if evaluate:  # after swa: the average evaluated is that of the epoch just ended
        events.add(*_evaluators(model, swa.swa_model))
    if url is not None:
        ckpt = checkpoint_every(url, every=1, at_epoch_end=True)
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
    trained: list[int] = []
    events.on("step_end", lambda e: trained.append(e.step))
    state = TrainState.create(model=model, optimizer=optimizer)
    state = run(make_train_step(loss_fn), state, data, events=events, max_epochs=EPOCHS)
    if state.epoch == EPOCHS:  # a preempted run stops before the end: no update_bn yet
        update_bn(data, swa.swa_model)
    lr = optimizer.param_groups[0]["lr"]
    return {"model": model, "swa_model": swa.swa_model, "lr": lr, "trained": trained}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_same(got["model"].state_dict(), want["model"].state_dict())
    # the average, its n_averaged and the batch-norm statistics update_bn computed
    assert_same(got["swa_model"].state_dict(), want["swa_model"].state_dict())
    assert got["lr"] == want["lr"]


@pytest.mark.parametrize(("evaluate", "per_update"), [(False, False), (True, False), (False, True)])
def test_torchs_swa_loop_with_steplib_equals_it_bit_for_bit(
    evaluate: bool, per_update: bool
) -> None:
    """``evaluate``: the model and its average evaluated during training change nothing;
    ``per_update``: the first scheduler stepped after each update, by the same handler."""
    want = _plain(per_update)
    assert int(want["swa_model"].n_averaged) == EPOCHS - SWA_START - 1
    _same(_steplib(evaluate=evaluate, per_update=per_update), want)


@pytest.mark.parametrize(
    ("stop_at", "evaluate", "per_update"),
    [
        (12, False, False),
        (25, False, False),
        (28, False, False),
        (28, True, False),
        (30, False, False),
        (35, False, False),
        (40, False, False),
        (40, True, False),
        (12, False, True),
        (25, False, True),
    ],
)  # mid-epoch before swa_start; the last update of epoch swa_start (its epoch end steps the
# cosine for the last time); inside the first averaged epoch; its last update (the first
# average and SWALR step); inside the annealing; the last update (before update_bn); with the
# model and its average evaluated too (the evaluators' state saved and restored); with the
# first scheduler stepped per update (mid-epoch: the handler's state between two epoch ends)
def test_torchs_swa_loop_resumed_equals_it_uninterrupted(
    tmp_path: Path, stop_at: int, evaluate: bool, per_update: bool
) -> None:
    url = str(tmp_path / "ckpt")
    run_to = _steplib(url, stop_at=stop_at, evaluate=evaluate, per_update=per_update)
    assert run_to["trained"][-1] == stop_at
    resumed = _steplib(url, evaluate=evaluate, per_update=per_update)
    assert resumed["trained"][:1] == ([stop_at + 1] if stop_at < EPOCHS * UPDATES else [])
    _same(resumed, _plain(per_update))


def test_a_sequential_lr_of_the_two_schedulers_anneals_one_epoch_late() -> None:
    """What the recipe's page says: at its milestone SequentialLR gives SWALR a step that does
    not count, so the rates of the two epochs after the switch lag the loop's by one epoch."""

    def rates(sequential: bool) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
        scheduler, swa_scheduler = _schedulers(optimizer)
        both = SequentialLR(optimizer, [scheduler, swa_scheduler], milestones=[SWA_START + 2])
        lrs = []
        for i in range(EPOCHS):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()  # no gradient: nothing changes (torch warns of a step before it)
            if sequential:
                both.step()
            else:
                (swa_scheduler if i > SWA_START else scheduler).step()
        return lrs

    loop, sequential = rates(False), rates(True)
    assert sequential[: SWA_START + 2] == loop[: SWA_START + 2]
    assert sequential[SWA_START + 2 : SWA_START + 4] == loop[SWA_START + 1 : SWA_START + 3]
    assert [round(lr, 4) for lr in sequential[SWA_START + 2 :]] == [0.0309, 0.0404]
    assert [round(lr, 4) for lr in loop[SWA_START + 2 :]] == [0.0404, 0.05]


class FitEndSWA(SWA):
    """``update_bn`` at ``fit_end`` (Lightning's place), unless ``last_only`` and the run
    ended before its last epoch."""

    def __init__(self, *args: Any, data: Any, last_only: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data, self.last_only = data, last_only

    def on_fit_end(self, event: Event) -> None:
        if not self.last_only or event.epoch == EPOCHS:
            update_bn(self.data, self.swa_model)


@pytest.mark.parametrize("last_only", [False, True])
def test_update_bn_at_a_preempted_runs_fit_end_changes_what_its_last_save_holds(
    tmp_path: Path, last_only: bool
) -> None:
    """What the recipe's page says: checkpoint_every's save at the end comes after the other
    fit_end handlers, so a pass over the loader there (its position, its dropout draws) is in
    the preempted run's last save, and the resumed run trains on other batches."""

    def fit(stop_at: int | None = None) -> dict[str, Any]:
        dataset, model, optimizer = _setup()
        data = resumable_loader(dataset, batch_size=BATCH, seed=3)
        scheduler, swa_scheduler = _schedulers(optimizer)
        swa = FitEndSWA(
            model,
            scheduler=scheduler,
            swa_scheduler=swa_scheduler,
            swa_start=SWA_START,
            data=data,
            last_only=last_only,
        )
        ckpt = checkpoint_every(str(tmp_path), every=3)  # 28: saved at fit_end (at_end=True)
        events = Events(resume_from(ckpt), swa, ckpt)
        if stop_at is not None:
            events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
        state = TrainState.create(model=model, optimizer=optimizer)
        run(make_train_step(loss_fn), state, data, events=events, max_epochs=EPOCHS)
        return {"model": model, "swa_model": swa.swa_model, "lr": optimizer.param_groups[0]["lr"]}

    fit(stop_at=28)
    got, want = fit(), _plain()
    if last_only:
        _same(got, want)
    else:
        mine, theirs = got["swa_model"].named_parameters(), want["swa_model"].parameters()
        apart = max(
            float((a - b).abs().max().detach()) for (_, a), b in zip(mine, theirs, strict=True)
        )
        assert apart > 0.01  # 0.055 (its batch-norm statistics 1.29)

"""``steplib.handlers.Scheduler``: a scheduler stepped per epoch or after each evaluation,
saved and resumed without being named; what cannot work is refused with the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    ConstantLR,
    LambdaLR,
    LinearLR,
    ReduceLROnPlateau,
    SequentialLR,
    StepLR,
)
from torchmetrics import MeanMetric

from steplib import ConfigError, Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.handlers import EarlyStopping, Scheduler

VALUES = [3.0, 2.0, 2.5, 2.4, 2.6, 1.0, 1.5, 1.4]
STEP = make_train_step(lambda m, b: m(b).pow(2).mean())


def _build(values: list[float]) -> tuple[TrainState, Evaluator, Scheduler]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    feed = iter(values)
    evaluator = Evaluator(
        make_eval_step(lambda m, b: torch.tensor(next(feed))),
        [0],
        metrics={"mean": MeanMetric()},
        every=1,
        monitor="val_mean",
        sanity_batches=0,
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    state = TrainState.create(model=model, optimizer=opt)
    return state, evaluator, Scheduler(plateau, metric=evaluator)


def _reference_lrs() -> list[float]:
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    lrs = []
    for value in VALUES:
        plateau.step(value)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_a_plateau_scheduler_is_fed_the_evaluators_value_after_each_evaluation() -> None:
    state, evaluator, plateau = _build(VALUES)
    lrs: list[float] = []
    events = Events(evaluator, plateau).on(
        "validation_end", lambda e: lrs.append(e.state.optimizer.param_groups[0]["lr"])
    )
    run(STEP, state, [torch.ones(3, 2)] * len(VALUES), events=events)
    assert lrs == _reference_lrs()
    assert lrs[-1] < 1.0  # it did reduce


# The batches are a list, started over on purpose (resume_from warns that they are).
@pytest.mark.filterwarnings("ignore:resume_from.*no state_dict:steplib.errors.CheckpointWarning")
def test_a_plateau_scheduler_resumes_exactly_without_being_named(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    state, evaluator, plateau = _build(VALUES[:5])
    keep = checkpoint_every(directory, every=5)
    run(STEP, state, [torch.ones(3, 2)] * 5, events=Events(keep, evaluator, plateau))

    state, evaluator, plateau = _build(VALUES[5:])
    events = Events(resume_from(directory), evaluator, plateau)
    lrs: list[float] = []
    events.on("validation_end", lambda e: lrs.append(e.state.optimizer.param_groups[0]["lr"]))
    run(STEP, state, [torch.ones(3, 2)] * len(VALUES), events=events, max_steps=len(VALUES))
    assert lrs == _reference_lrs()[5:]


def test_what_cannot_work_is_refused_with_the_fix() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(ConfigError, match=r"without metric=.*metric=evaluator"):
        Scheduler(plateau)
    with pytest.raises(ConfigError, match=r"takes no value.*Leave metric out"):
        Scheduler(step_lr, metric="val_loss")
    with pytest.raises(ConfigError, match=r"not an LR scheduler.*StepLR"):
        Scheduler(opt)
    state = TrainState.create(model=model, optimizer=opt, scheduler=step_lr)
    with pytest.raises(ConfigError, match=r"stepped.*twice|step it again"):
        run(STEP, state, [torch.ones(3, 2)], events=[Scheduler(step_lr)])


def test_a_plateau_scheduler_or_early_stopping_given_an_unattached_evaluator_is_refused() -> None:
    # The evaluator left out of the run never evaluated: the plateau scheduler never stepped
    # and early stopping never checked, in silence.
    state, evaluator, plateau = _build(VALUES)
    with pytest.raises(ConfigError, match=r"Scheduler was given an Evaluator that is not attached"):
        run(STEP, state, [torch.ones(2, 2)] * 4, events=[plateau])
    stopper = EarlyStopping(evaluator, patience=1)
    with pytest.raises(ConfigError, match=r"EarlyStopping was given an Evaluator that is not"):
        run(STEP, state, [torch.ones(2, 2)] * 4, events=[stopper])


@pytest.mark.parametrize("other_first", [True, False])
def test_a_plateau_scheduler_given_an_evaluator_is_fed_its_values_alone(other_first: bool) -> None:
    # A second evaluator (of an EMA copy, say): its validation_end fed the plateau too, after
    # or before the watched one's, so it stepped twice per evaluation. (Two evaluators that
    # write one name are refused: test_evaluation.py.)
    state, evaluator, plateau = _build(VALUES)
    other = Evaluator(
        make_eval_step(lambda m, b: torch.tensor(0.5)),
        [0],
        metrics={"mean": MeanMetric()},
        every=1,
        sanity_batches=0,
        prefix="ema_val_",
    )
    lrs: list[float] = []
    watched = [other, evaluator] if other_first else [evaluator, other]
    events = Events(*watched, plateau).on(
        "validation_end", lambda e: lrs.append(e.state.optimizer.param_groups[0]["lr"])
    )
    run(STEP, state, [torch.ones(3, 2)] * len(VALUES), events=events)
    assert len(other.history) == len(VALUES)
    assert lrs[1::2] == _reference_lrs()  # the lr after each of the watched evaluations


def test_a_scheduler_cell_run_again_on_one_events_is_refused_with_the_fix() -> None:
    # The cell `events.add(Scheduler(StepLR(opt, 1, 0.5)))` run twice on an Events built in an
    # earlier cell: both handlers halved the rate at each epoch end (0.0625 after 2 epochs
    # where the schedule gives 0.25), in silence.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    events = Events()
    for _ in range(2):
        events.add(Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)))
    data = [torch.ones(1, 2)] * 3
    state = TrainState.create(model=model, optimizer=opt)
    with pytest.raises(ConfigError, match=r"step the same optimizer at each epoch end"):
        run(STEP, state, data, events=events, max_epochs=2)
    assert opt.param_groups[0]["lr"] == 1.0  # refused at fit_start, before any update

    # The fixes it names: one handler per optimizer and cadence (Events built in the cell) ...
    fresh = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = run(STEP, state, data, events=Events(Scheduler(fresh)), max_epochs=2)
    assert opt.param_groups[0]["lr"] == 0.25
    # ... and two schedules on purpose, chained in one handler.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    chained = torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5),
        ]
    )
    state = TrainState.create(model=model, optimizer=opt)
    run(STEP, state, data, events=Events(Scheduler(chained)), max_epochs=2)
    assert opt.param_groups[0]["lr"] == 0.0625


def _accuracy_run(plateau_mode: Literal["min", "max"], *, by_name: bool) -> list[float]:
    # An accuracy that improves at every evaluation, ranked "max" by its evaluator.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    feed = iter([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    evaluator = Evaluator(
        make_eval_step(lambda m, b: torch.tensor(next(feed))),
        [0],
        metrics={"acc": MeanMetric()},
        every=1,
        monitor="val_acc",
        mode="max",
        sanity_batches=0,
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode=plateau_mode, factor=0.5, patience=1
    )
    scheduler = Scheduler(plateau, metric="val_acc" if by_name else evaluator)
    lrs: list[float] = []
    events = Events(evaluator, scheduler).on(
        "validation_end", lambda e: lrs.append(e.state.optimizer.param_groups[0]["lr"])
    )
    run(STEP, TrainState.create(model=model, optimizer=opt), [torch.ones(3, 2)] * 6, events=events)
    return lrs


@pytest.mark.parametrize("by_name", [False, True])
def test_a_plateau_scheduler_in_another_mode_than_its_evaluator_is_refused(by_name: bool) -> None:
    # ReduceLROnPlateau's own mode is "min" by default: fed an accuracy that its evaluator
    # ranks "max" and that rose at each of 6 evaluations, it halved the rate twice (1.0 to
    # 0.25), in silence, where the hand-written loop's ReduceLROnPlateau(mode="max") keeps 1.0.
    lrs = _accuracy_run("max", by_name=by_name)
    assert lrs == [1.0] * 6
    match = (
        r"mode 'min' .*monitors it ranks it in mode 'max'.*ReduceLROnPlateau\(optimizer, mode='max'"
    )
    with pytest.raises(ConfigError, match=match):
        _accuracy_run("min", by_name=by_name)  # at build time, or at fit_start by name


def test_a_plateau_scheduler_given_a_name_is_fed_by_the_evaluator_that_records_it() -> None:
    # A validation and a test evaluator, the plateau given the validation value's name: the
    # test evaluator's first evaluation (which records test_mean alone) was refused with
    # "the evaluation recorded test_mean", though the name is right.
    state, evaluator, _ = _build(VALUES)
    test = Evaluator(
        make_eval_step(lambda m, b: torch.tensor(0.5)),
        [0],
        metrics={"mean": MeanMetric()},
        every=2,
        sanity_batches=0,
        prefix="test_",
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer, factor=0.5, patience=1)
    lrs: list[float] = []
    events = Events(test, evaluator, Scheduler(plateau, metric="val_mean"))
    events.on("step_end", lambda e: lrs.append(e.state.optimizer.param_groups[0]["lr"]))
    run(STEP, state, [torch.ones(3, 2)] * len(VALUES), events=events)
    assert len(test.history) == len(VALUES) // 2
    assert lrs == _reference_lrs()

    # A name that no evaluator records is still refused, once each has evaluated.
    state, evaluator, _ = _build(VALUES)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer)
    with pytest.raises(ConfigError, match=r"metric='val_typo'.*recorded val_mean"):
        run(
            STEP,
            state,
            [torch.ones(3, 2)] * 2,
            events=[evaluator, Scheduler(plateau, metric="val_typo")],
        )


def _never_improving() -> Evaluator:
    """An evaluator after every update whose value (1.0) never improves: a plateau with
    patience 0 halves the rate at each evaluation after the first."""
    return Evaluator(
        make_eval_step(lambda m, b: torch.tensor(1.0)),
        [0],
        metrics={"mean": MeanMetric()},
        every=1,
        monitor="val_mean",
        sanity_batches=0,
    )


def test_a_schedule_that_sets_the_rate_beside_another_of_the_same_optimizer_is_refused() -> None:
    # The state's per-update LambdaLR sets the rate from its base at each update: a plateau
    # (patience 0, a value that never improves) halved it after each evaluation and the next
    # update put it back: 6 updates ran at 1, 1, 0.5, 0.5, 0.5, 0.5 where the plateau alone
    # gives 1, 1, 0.5, 0.25, 0.125, 0.0625.
    # torch's own way, in silence; a per-epoch StepLR beside it was erased the same way.
    def rates(per_update: Any, handler: Any, *, epochs: int = 1) -> list[float]:
        lrs: list[float] = []
        state = TrainState.create(model=model, optimizer=opt, scheduler=per_update)
        evaluator = _never_improving()
        metric = evaluator if isinstance(handler, ReduceLROnPlateau) else None
        events = Events(evaluator, Scheduler(handler, metric=metric))
        events.on("step_end", lambda e: lrs.append(e.output.lr.item()))
        run(STEP, state, [torch.ones(3, 2)] * 3, events=events, max_epochs=epochs)
        return lrs

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    lam = LambdaLR(opt, lambda n: 1.0)
    plateau = ReduceLROnPlateau(opt, factor=0.5, patience=0)
    with pytest.raises(ConfigError, match=r"the LambdaLR sets it from its base rate.*LinearLR"):
        rates(lam, plateau)
    with pytest.raises(ConfigError, match=r"Scheduler\(StepLR\) and the state's per-update Lambda"):
        rates(lam, StepLR(opt, step_size=1, gamma=0.5), epochs=2)
    assert opt.param_groups[0]["lr"] == 1.0  # the probe put the rate back

    # The fix it names: a warmup that scales the current rate, under which the plateau's
    # reductions hold, as in the hand-written loop.
    warmup = LinearLR(opt, start_factor=0.5, total_iters=2)
    plateau = ReduceLROnPlateau(opt, factor=0.5, patience=0)
    got = rates(warmup, plateau, epochs=2)
    ref_opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    ref_warmup = LinearLR(ref_opt, start_factor=0.5, total_iters=2)
    ref_plateau = ReduceLROnPlateau(ref_opt, factor=0.5, patience=0)
    expected = []
    for _ in range(6):
        expected.append(ref_opt.param_groups[0]["lr"])  # the update's rate
        ref_opt.step()
        ref_warmup.step()
        ref_plateau.step(1.0)  # the evaluation after the update
    assert got == pytest.approx(expected)
    assert got[-1] < 0.1


def test_a_per_epoch_schedule_that_sets_the_rate_beside_a_plateau_handler_is_refused() -> None:
    # Two handlers of one optimizer: a per-epoch LambdaLR (a constant factor) put the rate back
    # at each epoch end, where the plateau (patience 0, a value that never improves) had
    # halved it: updates 4 to 6 ran at 1, 0.5, 0.25 where the plateau alone gives 0.25,
    # 0.125, 0.0625; in silence.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    evaluator = _never_improving()
    per_epoch = Scheduler(LambdaLR(opt, lambda epoch: 1.0))
    plateau = Scheduler(ReduceLROnPlateau(opt, factor=0.5, patience=0), metric=evaluator)
    state = TrainState.create(model=model, optimizer=opt)
    with pytest.raises(ConfigError, match=r"another Scheduler's LambdaLR change the same"):
        run(
            STEP,
            state,
            [torch.ones(3, 2)] * 3,
            events=[evaluator, plateau, per_epoch],
            max_epochs=2,
        )
    assert opt.param_groups[0]["lr"] == 1.0


@pytest.mark.parametrize(
    "build",
    [
        # A warmup from 0, then a constant rate: the warmup's updates erased the reductions.
        lambda opt: SequentialLR(
            opt,
            [LambdaLR(opt, lambda n: n / 4), ConstantLR(opt, factor=1.0, total_iters=0)],
            milestones=[4],
        ),
        # A LinearLR warmup (which scales), then a LambdaLR decay (which sets).
        lambda opt: SequentialLR(
            opt,
            [LinearLR(opt, start_factor=0.5, total_iters=2), LambdaLR(opt, lambda n: 0.9**n)],
            milestones=[2],
        ),
        lambda opt: ChainedScheduler([LambdaLR(opt, lambda n: 1.0), StepLR(opt, step_size=9)]),
        # Alone too: at rate 0 when the run starts, where a halved rate is 0 as well.
        lambda opt: LambdaLR(opt, lambda n: n / 4),
    ],
    ids=["sequential_warmup_from_0", "sequential_then_lambda", "chained", "warmup_from_0"],
)
def test_a_composite_schedule_holding_one_that_sets_the_rate_is_refused_beside_a_plateau(
    build: Any,
) -> None:
    # SequentialLR and ChainedScheduler answer no probe of their own (torch's get_lr raises
    # NotImplementedError), so a LambdaLR inside one was let through: the state's per-update
    # SequentialLR([LambdaLR warmup from 0, ConstantLR]) set n/4 again at each warmup update,
    # erasing the plateau's halvings (patience 0, a value that never improves), in silence:
    # 6 updates ran at 0, 0.25, 0.25, 0.375, 0.5, 0.25 (the warmup alone: 0, 0.25, 0.5, 0.75,
    # 1, 1): update 5 ran at 0.5 after 4 halvings.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState.create(model=model, optimizer=opt, scheduler=build(opt))
    evaluator = _never_improving()
    plateau = Scheduler(ReduceLROnPlateau(opt, factor=0.5, patience=0), metric=evaluator)
    rates = [group["lr"] for group in opt.param_groups]
    with pytest.raises(
        ConfigError, match=r"the ((SequentialLR|ChainedScheduler)'s )?LambdaLR sets"
    ):
        run(STEP, state, [torch.ones(3, 2)] * 3, events=[evaluator, plateau], max_epochs=2)
    assert [group["lr"] for group in opt.param_groups] == rates  # the probe put them back


def test_swalr_beside_a_per_update_schedule_is_refused_at_the_start_as_at_a_resume(
    tmp_path: Path,
) -> None:
    # SWALR scales the current rate while it anneals and sets swa_lr once annealed. The probe
    # asked it at its current step: the run was let through at its start, and its resume after
    # the annealing was refused (ConfigError at fit_start, epochs of training later). The run
    # let through lost the per-update ExponentialLR's decay at each epoch end once annealed:
    # updates 4 to 9 ran at 0.05, 0.045, 0.0405, 0.05, 0.045, 0.0405 (each epoch started over
    # at swa_lr, where the decay goes on to 0.0365, 0.0328, 0.0295), in silence.
    def fit(epochs: int) -> list[float]:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        swa = Scheduler(torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=1))
        state = TrainState.create(model=model, optimizer=opt, scheduler=decay)
        ckpt = checkpoint_every(str(tmp_path), at_epoch_end=True)
        lrs: list[float] = []
        events = Events(resume_from(ckpt), swa, ckpt)
        events.on("step_end", lambda e: lrs.append(e.output.lr.item()))
        run(STEP, state, [torch.ones(3, 2)] * 3, events=events, max_epochs=epochs)
        return lrs

    with pytest.raises(ConfigError, match=r"the SWALR sets it .*ExponentialLR"):
        fit(3)
    assert not list(tmp_path.iterdir())  # refused before the first update

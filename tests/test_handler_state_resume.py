"""Law 9 for the handlers: after a kill and a resume with freshly built handlers and nothing
named (no ``extras=``, no ``data=``), every handler's state, every later checkpoint's recorded
metrics, the data order and the update early stopping stops at equal the uninterrupted run's.

The run is built so that each handler's state decides something visible: the weight ``w`` of
a one-parameter model is the update count (SGD, lr 1, gradient -1), and the validation value
is read from :data:`VALUES` by ``w``. Uninterrupted, the best is 1.0 at update 4 and early
stopping (patience 3) stops at update 10; a resume that forgot them would take the first
value after the kill (2.5 at update 8) as the best and stop at 16.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.optim.lr_scheduler import ExponentialLR, StepLR
from torch.utils.data import TensorDataset

from steplib import Event, Events, TrainState, clip, make_train_step, run, skip_nonfinite
from steplib.checkpoint import (
    CheckpointWarning,
    checkpoint_every,
    list_checkpoints,
    resume_from,
    save,
)
from steplib.data import resumable_loader
from steplib.errors import ConfigError, NonFiniteError
from steplib.handlers import (
    EMA,
    EarlyStopping,
    Evaluator,
    GradNormMonitor,
    NonFiniteAlarm,
    TrainMetrics,
    export_best,
)
from steplib.handlers.eval_step import make_eval_step
from steplib.handlers.scheduling import Scheduler
from steplib.sweep import SweepEarlyStopping

VALUES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5, 10: 1.5, 12: 1.6, 14: 1.7, 16: 1.8, 18: 1.9, 20: 2.0}
EVERY, KILL_AT, MAX_STEPS, STOPS_AT = 2, 6, 20, 10


class KilledError(Exception):
    """The process dies here: no fit_end, nothing after the kill reaches the handlers."""


class LossTotal:
    """A user's own handler with state: the updates seen and the sum of their losses."""

    def __init__(self) -> None:
        self.updates, self.total = 0, 0.0

    def attach(self, events: Events) -> Events:
        return events.on("step_end", self)

    def __call__(self, event: Event) -> None:
        self.updates += 1
        self.total += float(event.output.loss)

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updates, self.total = state["updates"], state["total"]


@dataclasses.dataclass
class Run:
    state: TrainState
    evaluator: Evaluator
    stopper: EarlyStopping
    exporter: Any
    train: TrainMetrics
    ema: EMA
    mine: LossTotal
    losses: list[tuple[int, float]]  # (update, loss) of every update of this process
    records: list[tuple[int, dict[str, Any]]]  # TrainMetrics read every 4 updates
    directory: Path


def _weight(model: nn.Module) -> torch.Tensor:
    return next(model.parameters())


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return batch[0].sum() - _weight(model).sum()  # the gradient of w is -1: w counts updates


def _value(model: nn.Module, batch: Any) -> torch.Tensor:
    return torch.full((1,), VALUES.get(round(_weight(model).item()), 9.0))


def _train(root: Path, *, kill_at: int | None = None, names_nothing: bool = False) -> Run:
    """One process's run into ``root``: everything built fresh, as after a restart."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    step = make_train_step(_loss)
    loader = resumable_loader(TensorDataset(torch.arange(8.0)), batch_size=1, seed=0)
    evaluator = Evaluator(
        make_eval_step(_value),
        [torch.zeros(1)],
        metrics={"loss": torchmetrics.MeanMetric()},
        every=EVERY,
        monitor="val_loss",
    )
    stopper = EarlyStopping(evaluator, patience=3)
    exporter = export_best(str(root / "best.pt"), monitor="val_loss")
    train, ema, mine = TrainMetrics(), EMA(model, decay=0.5), LossTotal()
    losses: list[tuple[int, float]] = []
    records: list[tuple[int, dict[str, Any]]] = []
    ckpt = checkpoint_every(str(root / "ckpt"), every=EVERY)
    if names_nothing:
        events = Events(resume_from(ckpt), evaluator, stopper)
    else:  # the form of the earlier docs, which runs on steplib before handler states too
        events = Events().on("fit_start", resume_from(str(root / "ckpt")))
        events.add(evaluator, stopper)
    events.on("step_end", exporter, every=EVERY)
    events.add(train, ema, mine)
    events.on("step_end", lambda e: losses.append((e.step, float(e.output.loss))))
    events.on("step_end", lambda e: records.append((e.step, train.read(e))), every=4)
    ckpt.attach(events)

    def kill(event: Event) -> None:
        raise KilledError

    if kill_at is not None:
        events.on("step_end", kill, once=kill_at, last=True)  # after the save, as a kill is
    state = run(step, state, loader, events=events, max_steps=MAX_STEPS)
    return Run(
        state, evaluator, stopper, exporter, train, ema, mine, losses, records, root / "ckpt"
    )


def _resumed(root: Path, *, names_nothing: bool = False) -> Run:
    with pytest.raises(KilledError):
        _train(root, kill_at=KILL_AT, names_nothing=names_nothing)
    return _train(root, names_nothing=names_nothing)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    uninterrupted = _train(tmp_path_factory.mktemp("uninterrupted"))
    return uninterrupted, _resumed(tmp_path_factory.mktemp("resumed"))


def _checkpoints(directory: Path) -> list[tuple[int, dict[str, float]]]:
    return [(c.step, dict(c.metrics)) for c in list_checkpoints(str(directory))]


def test_the_uninterrupted_run_is_the_one_described() -> None:
    # Guards the test's premise, not steplib: a best of 1.0 at 4, a stop at 10.
    stopper = EarlyStopping("val_loss", patience=3)
    stops = [s for s in sorted(VALUES) if stopper.update(VALUES[s], step=s) is not None]
    assert (stopper.best.value, stopper.best.step, stops[0]) == (1.0, 4, STOPS_AT)


def test_evaluator_best_and_history_survive_a_kill(runs: tuple[Run, Run]) -> None:
    want, got = runs
    assert (got.evaluator.best.value, got.evaluator.best.step) == (1.0, 4)
    assert got.evaluator.history == want.evaluator.history
    assert got.evaluator.state_dict() == want.evaluator.state_dict()
    assert got.state.extras == want.state.extras  # best_val_loss: 1.0, not 1.5


def test_every_later_checkpoint_records_the_uninterrupted_metrics(runs: tuple[Run, Run]) -> None:
    want, got = runs
    assert _checkpoints(got.directory) == _checkpoints(want.directory)
    assert [step for step, _ in _checkpoints(got.directory)] == [2, 4, 6, 8, 10]


def test_early_stopping_keeps_its_patience_and_stops_at_the_same_update(
    runs: tuple[Run, Run],
) -> None:
    want, got = runs
    assert want.state.step == STOPS_AT
    assert got.state.step == STOPS_AT
    assert got.stopper.state_dict() == want.stopper.state_dict()


def test_a_run_resumed_after_its_early_stop_stops_at_once(tmp_path: Path) -> None:
    # A finished job run again (a scheduler's requeue): before, it trained on until the next
    # evaluation, and its last checkpoint was no longer the model early stopping had kept.
    assert _train(tmp_path).state.step == STOPS_AT
    again = _train(tmp_path)
    assert again.state.step == STOPS_AT and again.losses == []


def test_export_best_keeps_its_best_and_exports_only_a_new_best(runs: tuple[Run, Run]) -> None:
    want, got = runs
    assert got.exporter.state_dict() == want.exporter.state_dict()
    exported = torch.load(got.exporter.url, weights_only=True)
    assert exported["weight"].item() == 4.0  # the best model's, not the first after the kill


def test_train_metrics_first_record_after_a_resume_covers_the_same_updates(
    runs: tuple[Run, Run],
) -> None:
    want, got = runs
    assert got.records == [r for r in want.records if r[0] > KILL_AT]
    assert got.records[0][1]["updates"] == 4
    assert got.train.state_dict() == want.train.state_dict()


def test_ema_is_saved_and_restored_without_being_named(runs: tuple[Run, Run]) -> None:
    want, got = runs
    assert torch.equal(_weight(got.ema.module), _weight(want.ema.module))
    assert got.ema.updates == want.ema.updates


def test_a_users_own_handler_with_state_dict_is_saved_and_restored(runs: tuple[Run, Run]) -> None:
    want, got = runs
    assert got.mine.state_dict() == want.mine.state_dict()


def test_the_data_position_of_the_loader_run_draws_from_is_saved_without_naming_it(
    runs: tuple[Run, Run],
) -> None:
    want, got = runs
    assert got.losses == [(s, loss) for s, loss in want.losses if s > KILL_AT]
    assert got.state.epoch == want.state.epoch


def test_resume_from_the_checkpointer_names_nothing_twice(
    runs: tuple[Run, Run], tmp_path: Path
) -> None:
    want, _ = runs
    got = _resumed(tmp_path, names_nothing=True)
    assert got.evaluator.state_dict() == want.evaluator.state_dict()
    assert got.stopper.state_dict() == want.stopper.state_dict()
    assert _checkpoints(got.directory) == _checkpoints(want.directory)
    assert got.losses == [(s, loss) for s, loss in want.losses if s > KILL_AT]


def _stopper_run(directory: Path, *handlers: Any) -> TrainState:
    model = nn.Linear(1, 1, bias=False)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    events = Events().on("fit_start", resume_from(str(directory)))
    for handler in handlers:
        events.on("step_end", handler, every=100)
    checkpoint_every(str(directory), every=2).attach(events)
    return run(make_train_step(_loss), state, [(torch.zeros(1),)] * 2, events=events)


def test_a_saved_handler_with_no_counterpart_attached_is_refused(tmp_path: Path) -> None:
    _stopper_run(tmp_path, EarlyStopping("val_loss"))
    with pytest.raises(ConfigError, match=r"not attached now: EarlyStopping\[0\].*same ones"):
        _stopper_run(tmp_path)


def test_an_attached_handler_the_checkpoint_does_not_hold_is_refused(tmp_path: Path) -> None:
    _stopper_run(tmp_path, EarlyStopping("val_loss"))
    with pytest.raises(ConfigError, match=r"not in the checkpoint: EarlyStopping\[1\]"):
        _stopper_run(tmp_path, EarlyStopping("val_loss"), EarlyStopping("val_loss"))


def _evaluator(prefix: str) -> Evaluator:
    step = make_eval_step(lambda model, batch: {"value": model(batch[0]).pow(2).mean()})
    data = [(torch.ones(2, 1),)]
    metrics = {"loss": torchmetrics.MeanMetric()}
    return Evaluator(step, data, metrics=metrics, every=1, prefix=prefix, monitor=f"{prefix}loss")


def test_evaluators_attached_in_another_order_are_refused_not_crossed(tmp_path: Path) -> None:
    # Matched by their order, swapped evaluators took each other's best and history in silence.
    def attempt(*prefixes: str) -> TrainState:
        model = nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainState.create(model=model, optimizer=opt)
        events = Events(resume_from(str(tmp_path)), *map(_evaluator, prefixes))
        checkpoint_every(str(tmp_path), epochs=1).attach(events)
        return run(make_train_step(_loss), state, [(torch.zeros(1),)] * 2, events=events)

    attempt("val_", "test_")
    with pytest.raises(ConfigError, match=r"Evaluator .*'test_'.* was given the state .*'val_'"):
        attempt("test_", "val_")
    assert attempt("val_", "test_").step == 4  # the same order resumes


def test_handlers_of_one_class_attached_in_another_order_are_refused_not_crossed(
    tmp_path: Path,
) -> None:
    # Matched by class and order, swapped stoppers took each other's best and patience: the
    # val_accuracy one carried on from a best loss, the val_loss one from a best accuracy.
    def stoppers(*monitors: str) -> list[EarlyStopping]:
        return [EarlyStopping(m, mode="max" if "acc" in m else "min") for m in monitors]

    _stopper_run(tmp_path, *stoppers("val_loss", "val_accuracy"))
    refused = r"EarlyStopping built with monitor='val_accuracy', mode='max' was given the state"
    with pytest.raises(ConfigError, match=refused):
        _stopper_run(tmp_path, *stoppers("val_accuracy", "val_loss"))
    # Saved at the epoch's end (the list's last batch), so the resume is exact: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _stopper_run(tmp_path, *stoppers("val_loss", "val_accuracy")).step == 4


def _plateau(metric: str) -> Scheduler:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    return Scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), metric=metric)


def _per_epoch(kind: type) -> Scheduler:
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    return Scheduler(kind(optimizer, **{"step_size": 1} if kind is StepLR else {"gamma": 0.5}))


BUILT_OTHERWISE = {
    "early stopping, another value": (
        lambda: EarlyStopping("val_loss"),
        lambda: EarlyStopping("val_accuracy", mode="max"),
    ),
    "export_best, another mode": (
        lambda: export_best("memory://built/model.pt", monitor="val_loss"),
        lambda: export_best("memory://built/model.pt", monitor="val_loss", mode="max"),
    ),
    "a plateau fed another value": (lambda: _plateau("val_loss"), lambda: _plateau("val_ppl")),
    "another kind of scheduler": (lambda: _per_epoch(StepLR), lambda: _per_epoch(ExponentialLR)),
    "sweep early stopping": (
        lambda: SweepEarlyStopping("val_loss"),
        lambda: SweepEarlyStopping("val_loss", mode="max"),
    ),
    "an EMA of another decay": (
        lambda: EMA(nn.Linear(1, 1), decay=0.9),
        lambda: EMA(nn.Linear(1, 1), decay=0.99),
    ),
}


@pytest.mark.parametrize("built", BUILT_OTHERWISE.values(), ids=BUILT_OTHERWISE)
def test_a_handler_refuses_the_state_of_one_built_otherwise(built: tuple[Any, Any]) -> None:
    # torch's schedulers load any state into any scheduler (a StepLR's into an ExponentialLR
    # gives it a step_size); a stopper went on from a best of another value, in silence.
    saving, other = built
    saved = saving().state_dict()
    saving().load_state_dict(saved)  # its own kind loads
    with pytest.raises(ConfigError, match=r"was given the state of one built with"):
        other().load_state_dict(saved)


def test_a_checkpoint_from_before_handler_states_loads_with_a_warning(tmp_path: Path) -> None:
    model = nn.Linear(1, 1, bias=False)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    save(state.replace(step=2), str(tmp_path))  # by hand: no handler states, as before
    with pytest.warns(CheckpointWarning, match=r"EarlyStopping\[0\] start from the state"):
        resumed = _stopper_run(tmp_path, EarlyStopping("val_loss"))
    assert resumed.step == 4


def test_named_extras_still_load_and_are_not_saved_twice(tmp_path: Path) -> None:
    model = nn.Linear(1, 1, bias=False)
    ema = EMA(model, decay=0.5)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    ckpt = checkpoint_every(str(tmp_path), every=2, extras={"ema": ema})
    run(make_train_step(_loss), state, [(torch.zeros(1),)] * 2, events=Events(ema, ckpt))
    tree = torch.load(tmp_path / "step-00000002" / "train_state.pt", weights_only=True)
    assert sorted(tree["objects"]) == ["ema", "handlers"]
    assert tree["objects"]["handlers"] == {}
    fresh = EMA(model, decay=0.5)
    ckpt = checkpoint_every(str(tmp_path), every=2, extras={"ema": fresh})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The batches are a list, started over on purpose (resume_from says so).
        warnings.filterwarnings("ignore", "resume_from: .* no state_dict", CheckpointWarning)
        run(
            make_train_step(_loss),
            state,
            [(torch.zeros(1),)] * 2,
            events=Events(resume_from(ckpt), fresh, ckpt),
        )
    assert fresh.updates == 4


def test_the_name_handlers_is_kept_for_the_attached_handlers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'handlers'.*another name"):
        resume_from(str(tmp_path), extras={"handlers": EMA(nn.Linear(1, 1))})(
            Event("fit_start", None, events=Events())
        )


def _grad_norm_reads(root: Path, *, kill_at: int | None = None) -> list[tuple[int, Any]]:
    """GradNormMonitor read every 4 updates of a clipped step, checkpoints every 2."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = clip(make_train_step(lambda m, b: m(b[0]).pow(2).sum()), max_norm=100.0)
    gen = torch.Generator().manual_seed(1)
    loader = resumable_loader(TensorDataset(torch.randn(8, 2, generator=gen)), batch_size=1)
    monitor, reads = GradNormMonitor(), []
    ckpt = checkpoint_every(str(root), every=2)
    events = Events(resume_from(ckpt), monitor, ckpt)
    events.on("step_end", lambda e: reads.append((e.step, monitor.read(e))), every=4)

    def kill(event: Event) -> None:
        raise KilledError

    if kill_at is not None:
        events.on("step_end", kill, once=kill_at, last=True)  # after the save, as a kill is
    run(step, state, loader, events=events, max_steps=8)
    return reads


def test_grad_norm_monitor_first_read_after_a_resume_covers_the_same_updates(
    tmp_path: Path,
) -> None:
    want = _grad_norm_reads(tmp_path / "whole")
    with pytest.raises(KilledError):
        _grad_norm_reads(tmp_path / "resumed", kill_at=6)
    got = _grad_norm_reads(tmp_path / "resumed")  # its first read covers updates 5 to 8
    assert got == [r for r in want if r[0] > 6] and len(got) == 1


def _alarm_run(root: Path, *, kill_at: int | None = None) -> str:
    """A NaN skipped at an early update, flags read every 4 updates, checkpoints every 2."""
    model = nn.Linear(1, 1, bias=False)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # log(0) * 0 is NaN: the batch holding 0 gives a NaN loss, which skip_nonfinite skips.
    step = skip_nonfinite(make_train_step(lambda m, b: (m(b[0]) * b[0].log()).sum()))
    loader = resumable_loader(TensorDataset(torch.tensor([[0.0]] + [[1.0]] * 7)), batch_size=1)
    ckpt = checkpoint_every(str(root), every=2)
    events = Events(resume_from(ckpt), NonFiniteAlarm(every=4, include_skipped=True), ckpt)

    def kill(event: Event) -> None:
        raise KilledError

    if kill_at is not None:
        events.on("step_end", kill, once=kill_at, last=True)  # after the save, as a kill is
    with pytest.raises(NonFiniteError, match="non-finite loss") as raised:
        run(step, state, loader, events=events, max_steps=8)
    return str(raised.value)


def test_non_finite_alarm_flags_before_a_kill_still_raise_after_the_resume(
    tmp_path: Path,
) -> None:
    # Uninterrupted, the NaN of update 1 or 2 is read at update 4. Killed at 3 after the save
    # at 2, the resumed run lost the flags: it trained on to the end without the alarm.
    want = _alarm_run(tmp_path / "whole")
    with pytest.raises(KilledError):
        _alarm_run(tmp_path / "resumed", kill_at=3)
    assert _alarm_run(tmp_path / "resumed") == want

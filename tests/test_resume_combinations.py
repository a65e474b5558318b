"""Law 9 for handlers used together: a run killed after any update and resumed with
``resume_from`` into freshly built objects ends as the uninterrupted run ends, bit for bit.

Each handler is tested alone elsewhere (``test_handler_state_resume.py``,
``test_law9_exact_resume.py``); users combine them. Each entry of :data:`SCENARIOS` builds one
realistic set of handlers over a small seeded model and a shuffling ``resumable_loader``; the
test runs it uninterrupted, then for every update ``k`` (the kill lands after update ``k``'s
handlers: on an epoch's last update, just after an evaluation, the update before early
stopping fires, inside an accumulation window's batches), after every epoch's end handlers,
and with a clean ``Stop`` at every 4th update, kills it, builds everything again and resumes.
It compares the parameters and optimizer state bit for bit, every handler's
``state_dict()``, the log files' lines (less their time stamps), the checkpoints left in the
directory with their recorded metrics, and the update the run stopped at.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import os
import signal
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset

from steplib import (
    EMA,
    CSVLogger,
    EarlyStopping,
    Evaluator,
    Event,
    Events,
    JsonlLogger,
    Stop,
    TrainMetrics,
    TrainState,
    accumulate,
    checkpoint_every,
    clip,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
    skip_nonfinite,
)
from steplib.cadence import Batches
from steplib.checkpoint import list_checkpoints, preemption
from steplib.data import resumable_loader
from steplib.handlers import (
    GradNormMonitor,
    Log,
    LRMonitor,
    NonFiniteAlarm,
    Scheduler,
    export_best,
)


class KilledError(Exception):
    """The process dies here: nothing after the kill reaches a handler's step_end."""


@dataclasses.dataclass
class Built:
    """One process's freshly built run: what ``run`` takes, and what to compare after."""

    step: Any
    state: TrainState
    data: Any
    events: Events
    handlers: dict[str, Any]  # every handler with a state_dict, by a name for messages
    limits: dict[str, Any]
    closers: list[Any] = dataclasses.field(default_factory=list)
    exported: list[Path] = dataclasses.field(default_factory=list)
    preempts: bool = False  # killed by a preemption, whose save is one more checkpoint


@dataclasses.dataclass
class Outcome:
    step: int
    epoch: int
    micro_step: int
    params: dict[str, torch.Tensor]
    optimizers: Any
    handlers: dict[str, Any]
    logs: dict[str, list[Any]]
    checkpoints: list[tuple[str, int, dict[str, float]]]
    exported: dict[str, Any]
    # The state's other counters (skipped updates, in total and in a row) and its scheduler's
    # state (a LambdaLR over a sweep optimizer holds where no copy updated).
    counters: Any


def _data(n: int, *, seed: int, nan_at: int | None = None) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]]) + 0.1 * torch.randn(n, 1, generator=gen)
    if nan_at is not None:
        x[nan_at] = float("nan")
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def _evaluator(**kwargs: Any) -> Evaluator:
    # Targets a third of the training ones: the validation loss improves, then worsens as training
    # fits the training data, so that a best, a plateau and an early stop all happen.
    val = _data(8, seed=7)
    batches = [
        (val.tensors[0][:4], 0.3 * val.tensors[1][:4]),
        (val.tensors[0][4:], 0.3 * val.tensors[1][4:]),
    ]
    step = make_eval_step(lambda m, b: {"value": (m(b[0]) - b[1]).pow(2).mean(dim=1)})
    metrics = {"loss": torchmetrics.MeanMetric()}
    return Evaluator(step, batches, metrics=metrics, monitor="val_loss", **kwargs)


def _logs(root: Path) -> tuple[JsonlLogger, CSVLogger]:
    return JsonlLogger(str(root / "log.jsonl")), CSVLogger(str(root / "log.csv"))


def _checkpoints(root: Path, **settings: Any) -> Any:
    # durable=False: no fsync (a tenth of a second a save here); resuming is what is tested.
    return checkpoint_every(str(root / "ckpt"), durable=False, **settings)


# --- the scenarios: each builds everything fresh into `root`, as a restarted process does ---


def evaluate_keep_best_stop(root: Path) -> Built:
    """Evaluator every 2 + checkpoint_every(keep_best=, metric=evaluator) + EarlyStopping."""
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    jsonl, table = _logs(root)
    evaluator = _evaluator(every=2, sinks=[jsonl, table])  # one file for both: a common setup
    stopper = EarlyStopping(evaluator, patience=2)
    ckpt = _checkpoints(root, every=1, keep_best=2, keep_last=1, metric=evaluator)
    events = Events(resume_from(ckpt), evaluator, stopper, Log([jsonl, table], every=1), ckpt)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    handlers = {"evaluator": evaluator, "stopper": stopper}
    return Built(
        make_train_step(_loss), state, data, events, handlers, {"max_epochs": 6}, [jsonl, table]
    )


def schedulers_plateau_ema(root: Path) -> Built:
    """StepLR per epoch + ReduceLROnPlateau on the evaluator's value + EMA (evaluated)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    ema = EMA(model, decay=0.8)
    jsonl, _ = _logs(root)
    evaluator = _evaluator(every=3, model=ema.module, sinks=jsonl)
    per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    on_plateau = Scheduler(plateau, metric=evaluator)
    train = TrainMetrics()
    ckpt = _checkpoints(root, every=2, keep_last=2)
    events = Events(resume_from(ckpt), ema, evaluator, per_epoch, on_plateau, train)
    events.add(Log(jsonl, sources=[train.read], every=2), ckpt)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    handlers = {"ema": ema, "evaluator": evaluator, "per_epoch": per_epoch}
    handlers |= {"on_plateau": on_plateau, "train": train}
    return Built(make_train_step(_loss), state, data, events, handlers, {"max_epochs": 3}, [jsonl])


def accumulate_clip_nonfinite_logs(root: Path) -> Built:
    """accumulate(3) + clip + skip_nonfinite (a NaN sample) + TrainMetrics, GradNormMonitor and
    LRMonitor into JSONL and CSV + NonFiniteAlarm + an EMA with warmup (skips leave it)."""
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    step = accumulate(skip_nonfinite(clip(make_train_step(_loss), max_norm=0.5)), 3)
    train, norms, ema = TrainMetrics(), GradNormMonitor(), EMA(model, decay=0.9, warmup=True)
    alarm = NonFiniteAlarm(every=4)  # skipped updates are no alarm: it only holds its flags
    jsonl, table = _logs(root)
    ckpt = _checkpoints(root, every=1, keep_last=3)
    sources = [train.read, norms.read, LRMonitor().read]
    events = Events(resume_from(ckpt), train, norms, ema, alarm)
    events.add(Log([jsonl, table], sources=sources, every=2), ckpt)
    # 7 batches an epoch: windows of 3, 3 and 1; the NaN sample skips one window an epoch.
    data = resumable_loader(_data(28, seed=1, nan_at=5), batch_size=4, shuffle=True, seed=3)
    handlers = {"train": train, "norms": norms, "ema": ema, "alarm": alarm}
    return Built(step, state, data, events, handlers, {"max_epochs": 4}, [jsonl, table])


def background_preemption_export(root: Path, *, kill_at: int | None = None) -> Built:
    """Background checkpoints + preemption (the signal at ``kill_at``, on an epoch's last
    update too: saved after its epoch_end handlers) + export_best + a per-epoch scheduler."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    state = TrainState.create(model=model, optimizer=opt)
    evaluator = _evaluator(every=4, at_epoch_end=True)
    exporter = export_best(str(root / "best.pt"), monitor="val_loss")
    per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    ckpt = _checkpoints(root, every=3, keep_last=2, background=True)
    preempted = preemption(ckpt)
    events = Events(resume_from(ckpt), evaluator, per_epoch)
    events.on("validation_end", exporter)
    events.add(ckpt, preempted)
    if kill_at is not None:  # as a scheduler would: the signal, a save, a clean stop

        def signal_now(event: Event) -> None:
            os.kill(os.getpid(), signal.SIGUSR1)

        events.on("step_end", signal_now, once=kill_at)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    handlers = {"evaluator": evaluator, "exporter": exporter, "per_epoch": per_epoch}
    limits = {"max_steps": 15}
    return Built(
        make_train_step(_loss), state, data, events, handlers, limits, [], [root / "best.pt"], True
    )


def _gan_loss(name: str) -> Callable[[nn.ModuleDict, Any], torch.Tensor]:
    def d_loss(model: nn.ModuleDict, batch: Any) -> torch.Tensor:
        real, noise = batch
        fake = model["G"](noise).detach()
        d = model["D"]
        return (
            torch.nn.functional.softplus(-d(real)).mean()
            + torch.nn.functional.softplus(d(fake)).mean()
        )

    def g_loss(model: nn.ModuleDict, batch: Any) -> torch.Tensor:
        return torch.nn.functional.softplus(-model["D"](model["G"](batch[1]))).mean()

    return d_loss if name == "D" else g_loss


def _generated(model: nn.Module, noise: torch.Tensor) -> dict[str, torch.Tensor]:
    assert isinstance(model, nn.ModuleDict)  # the state's models by name
    return {"value": model["G"](noise).pow(2).mean(dim=1)}


def gan_evaluated_keep_best(root: Path) -> Built:
    """A GAN: D then G on each batch (Adam each, D accumulating 2), G evaluated, keep_best."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    d = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "G": torch.optim.Adam(g.parameters(), lr=0.01),
        "D": torch.optim.Adam(d.parameters(), lr=0.01),
    }
    state = TrainState.create(model={"G": g, "D": d}, optimizer=optimizers)
    steps = {
        "D": accumulate(make_train_step(_gan_loss("D"), optimizer="D"), 2),
        "G": clip(make_train_step(_gan_loss("G"), optimizer="G"), max_norm=1.0),
    }
    noise = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    evaluator = Evaluator(
        make_eval_step(_generated),
        [noise[:4], noise[4:]],
        metrics={"loss": torchmetrics.MeanMetric()},
        every=2,
        monitor="val_loss",
    )
    train = TrainMetrics()
    jsonl, _ = _logs(root)
    ckpt = _checkpoints(root, every=1, keep_best=1, keep_last=1, metric=evaluator)
    events = Events(resume_from(ckpt), evaluator, train, Log(jsonl, sources=[train.read], every=3))
    events.add(ckpt)
    real = _data(20, seed=1).tensors[0]
    data = resumable_loader(
        TensorDataset(real, torch.randn(20, 4, generator=torch.Generator().manual_seed(2))),
        batch_size=4,
        shuffle=True,
        seed=3,
    )
    handlers = {"evaluator": evaluator, "train": train}
    return Built(steps, state, data, events, handlers, {"max_epochs": 3}, [jsonl])


def batches_cadence_accumulated(root: Path) -> Built:
    """Cadences in Batches(n) over accumulate(2), 7 batches an epoch (a window of 1 ends it):
    saves and evaluations on an epoch's last update, a per-epoch scheduler, EMA, logs."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    step = accumulate(make_train_step(_loss), 2)
    ema = EMA(model, decay=0.8)
    jsonl, table = _logs(root)
    evaluator = _evaluator(every=Batches(3), sinks=[jsonl, table])
    stopper = EarlyStopping(evaluator, patience=3)
    per_epoch = Scheduler(torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8))
    train = TrainMetrics()
    ckpt = _checkpoints(root, every=Batches(4), keep_last=2, keep_best=1, metric=evaluator)
    events = Events(resume_from(ckpt), ema, evaluator, stopper, per_epoch, train)
    events.add(Log([jsonl, table], sources=[train.read], every=Batches(5)), ckpt)
    data = resumable_loader(_data(28, seed=1), batch_size=4, shuffle=True, seed=3)
    handlers = {"ema": ema, "evaluator": evaluator, "stopper": stopper, "per_epoch": per_epoch}
    handlers["train"] = train
    return Built(step, state, data, events, handlers, {"max_epochs": 4}, [jsonl, table])


def two_sets_max_mode_ema_export(root: Path) -> Built:
    """Two validation sets of the EMA model, an accuracy-like value (mode max) for keep_best
    and export_best of the EMA, early stopping on the other set's loss, at epoch ends too."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    ema = EMA(model, decay=0.7)
    val, ood = _data(8, seed=7), _data(8, seed=8)
    sets = {"val": [(val.tensors[0], 0.3 * val.tensors[1])], "ood": [tuple(ood.tensors)]}
    step = make_eval_step(lambda m, b: {"value": -(m(b[0]) - b[1]).pow(2).mean(dim=1)})
    evaluator = Evaluator(
        step,
        sets,
        metrics={"score": torchmetrics.MeanMetric()},
        every=4,
        at_epoch_end=True,
        monitor="val_score",
        mode="max",
        model=ema.module,
    )
    stopper = EarlyStopping("ood_score", mode="max", patience=4)
    exporter = export_best(str(root / "best.pt"), monitor="val_score", mode="max", model=ema.module)
    per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    ckpt = _checkpoints(root, every=3, epochs=1, keep_best=1, keep_last=2, metric=evaluator)
    events = Events(resume_from(ckpt), ema, evaluator, per_epoch)
    events.on("validation_end", stopper)
    events.on("validation_end", exporter)
    events.add(ckpt)
    data = resumable_loader(_data(20, seed=1), batch_size=4, shuffle=True, seed=3)
    handlers = {"ema": ema, "evaluator": evaluator, "stopper": stopper, "exporter": exporter}
    handlers["per_epoch"] = per_epoch
    limits = {"max_epochs": 4}
    return Built(
        make_train_step(_loss), state, data, events, handlers, limits, [], [root / "best.pt"]
    )


SCENARIOS: dict[str, Callable[..., Built]] = {
    "evaluate_keep_best_stop": evaluate_keep_best_stop,
    "schedulers_plateau_ema": schedulers_plateau_ema,
    "accumulate_clip_nonfinite_logs": accumulate_clip_nonfinite_logs,
    "background_preemption_export": background_preemption_export,
    "gan_evaluated_keep_best": gan_evaluated_keep_best,
    "batches_cadence_accumulated": batches_cadence_accumulated,
    "two_sets_max_mode_ema_export": two_sets_max_mode_ema_export,
}


# --- the driver ---


def _kill(event: Event) -> None:
    raise KilledError


def _tensors(value: Any) -> Any:
    """``value`` with tensors as (dtype, shape, list): comparable with ``==``, bit for bit."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        bits = t.view(torch.int32) if t.dtype == torch.float32 and t.dim() else t
        return ("tensor", str(t.dtype), tuple(t.shape), bits.tolist())
    if isinstance(value, Mapping):
        return {k: _tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_tensors(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"  # equal to itself: a skipped update's NaN loss, logged in both runs
    return value


def _log_lines(path: Path) -> list[Any]:
    if not path.exists():
        return []
    if path.suffix == ".jsonl":
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        return [_tensors({k: v for k, v in line.items() if k != "time"}) for line in lines]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    return [{k: v for k, v in row.items() if k != "time"} for row in rows]


def _stop(event: Event) -> Stop:
    return Stop("stopped by the test")  # a clean stop: fit_end runs, a final save at_end


def _go(
    build: Callable[..., Built], root: Path, *, kill: tuple[str, int] | None = None
) -> Outcome | None:
    """Run ``build``'s run in ``root``; ``None`` when ``kill = (event, n)`` ended it: an
    exception after the handlers of that event's ``n``-th (``"step_end"``, ``"epoch_end"``,
    ``"micro_step_end"``), a ``Stop`` at update ``n`` (``"stop"``), or the scenario's own way,
    a preemption (``"preempt"``)."""
    own_kill = "kill_at" in inspect.signature(build).parameters
    killed_at = kill[1] if kill is not None and kill[0] == "preempt" else None
    built = build(root, kill_at=killed_at) if own_kill else build(root)
    if kill is not None and kill[0] == "stop":
        built.events.on("step_end", _stop, once=kill[1])
    elif kill is not None and kill[0] != "preempt":
        built.events.on(kill[0], _kill, once=kill[1], last=True)  # after the save there
    try:
        state = run(built.step, built.state, built.data, events=built.events, **built.limits)
    except KilledError:
        return None
    finally:
        for closer in built.closers:
            closer.close()
    if kill is not None:
        assert state.step == kill[1], f"stopped at update {state.step}, not {kill}"
        return None
    optimizers = state.optimizer
    return Outcome(
        state.step,
        state.epoch,
        state.micro_step,
        {k: v.detach().clone() for k, v in state.model.state_dict().items()},
        _tensors(
            {k: o.state_dict() for k, o in optimizers.items()}
            if isinstance(optimizers, Mapping)
            else optimizers.state_dict()
        ),
        {name: _tensors(h.state_dict()) for name, h in built.handlers.items()},
        {p.name: _log_lines(p) for p in sorted(root.glob("log.*"))},
        [(c.name, c.step, _tensors(dict(c.metrics))) for c in list_checkpoints(str(root / "ckpt"))],
        {p.name: _tensors(torch.load(p, weights_only=True)) for p in built.exported},
        _tensors(
            {
                "skipped_updates": state.skipped_updates,
                "consecutive_skips": state.consecutive_skips,
                "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
            }
        ),
    )


def _differences(want: Outcome, got: Outcome) -> list[str]:
    found = []
    at, wanted = (got.step, got.epoch, got.micro_step), (want.step, want.epoch, want.micro_step)
    if at != wanted:
        found.append(f"stopped at (step, epoch, micro_step) {at}, not {wanted}")
    for name, tensor in want.params.items():
        if not torch.equal(tensor, got.params[name]):
            found.append(f"parameter {name}")
    if got.optimizers != want.optimizers:
        found.append("optimizer state")
    for name, saved in want.handlers.items():
        if got.handlers[name] != saved:
            found.append(f"{name}.state_dict(): {got.handlers[name]} != {saved}")
    for name, lines in want.logs.items():
        if got.logs.get(name) != lines:
            found.append(f"log {name}: {got.logs.get(name)} != {lines}")
    if got.checkpoints != want.checkpoints:
        found.append(f"checkpoints {got.checkpoints} != {want.checkpoints}")
    if got.exported != want.exported:
        found.append("exported model")
    if got.counters != want.counters:
        found.append(f"counters and scheduler {got.counters} != {want.counters}")
    return found


def _with_preemption_save(want: Outcome, got: Outcome, k: int) -> Outcome:
    """``want`` with the checkpoint a preemption at ``k`` added, and keep_last applied."""
    added = [c for c in got.checkpoints if c[1] == k]
    kept = sorted(want.checkpoints + added, key=lambda c: c[1])[-len(want.checkpoints) :]
    return dataclasses.replace(want, checkpoints=kept)


def _resumed_differences(
    build: Callable[..., Built],
    tmp_path: Path,
    want: Outcome,
    kill: tuple[str, int],
    *,
    preempts: bool = False,
) -> list[str]:
    """Kill ``build``'s run as ``kill`` says (see :func:`_go`), run it again in the same
    directory (a restarted process resumes), and return how it ended otherwise than ``want``."""
    k = kill[1]
    root = tmp_path / f"killed-{kill[0]}-{k}"
    assert _go(build, root, kill=kill) is None
    with warnings.catch_warnings():
        if not list_checkpoints(str(root / "ckpt")):  # killed before the first save:
            # the run starts over, and says so of the killed run's records it replaces.
            warnings.filterwarnings("ignore", r".*replaces the \d+ record", UserWarning)
        got = _go(build, root)
    assert got is not None
    expected = _with_preemption_save(want, got, k) if preempts else want
    if kill[0] == "stop":  # its fit_end logged the interval so far and saved at k: by
        # design a record and a checkpoint more (docs/handlers.md); the rest is the same.
        expected = dataclasses.replace(want, logs=got.logs, checkpoints=got.checkpoints)
    return _differences(expected, got)


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_kill_after_any_update_resumes_to_the_uninterrupted_run(
    name: str, tmp_path: Path
) -> None:
    build = SCENARIOS[name]
    want = _go(build, tmp_path / "whole")
    assert want is not None
    preempts = build(tmp_path / "unused").preempts
    failures = {}
    # After every update (a preemption's signal there), and after every epoch's end handlers.
    kills = [("preempt" if preempts else "step_end", k) for k in range(1, want.step)]
    kills += [] if preempts else [("epoch_end", e) for e in range(1, want.epoch)]
    # Inside accumulation windows (every 5th batch), the exception after a micro-batch.
    kills += [] if preempts else [("micro_step_end", m) for m in range(2, want.micro_step, 5)]
    # And a clean stop (a Stop at update k, every 4th): fit_end runs, and saves at k.
    kills += [] if preempts else [("stop", k) for k in range(1, want.step, 4)]
    for kill in kills:
        if found := _resumed_differences(build, tmp_path, want, kill, preempts=preempts):
            failures[kill] = found
    assert not failures, failures


def test_a_save_at_fit_end_records_its_updates_loss_as_any_other_save(tmp_path: Path) -> None:
    # A run that ends off its cadence (max_steps, an early stop, a Stop) saves at fit_end; that
    # checkpoint recorded no loss ({} here), so keep_best=, metric="loss" could not rank it.
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    ckpt = _checkpoints(tmp_path, every=3)
    data = resumable_loader(_data(24, seed=1), batch_size=4, shuffle=True, seed=3)
    run(make_train_step(_loss), state, data, events=[ckpt], max_steps=4)
    recorded = {c.step: sorted(c.metrics) for c in list_checkpoints(str(tmp_path / "ckpt"))}
    assert recorded == {3: ["loss"], 4: ["loss"]}

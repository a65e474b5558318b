"""Control handlers: early stopping stops at the right step, the time budget and the stop file
work, the NaN alarm names the step and batch, the monitors report what the step measured."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    Event,
    Events,
    NewState,
    TrainState,
    accumulate,
    clip,
    make_train_step,
    run,
    skip_nonfinite,
)
from steplib.handlers import (
    BestValue,
    EarlyStopping,
    Evaluator,
    GradNormMonitor,
    LRMonitor,
    NonFiniteAlarm,
    NonFiniteError,
    StopFile,
    TimeLimit,
    make_eval_step,
)
from steplib.handlers.logging import Log, Sink, event_record
from steplib.handlers.watched_value import one_number


def _setup(n: int = 12, *, nan_at: int | None = None, lr: float = 0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    state = TrainState.create(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        x = torch.randn(4, 4, generator=gen)
        if i == nan_at:
            x[1, 2] = float("nan")
        batches.append((x, torch.randint(0, 3, (4,), generator=gen)))
    return state, batches


def _loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def _feed(values: list[float]):
    """A stand-in evaluator: each call puts the next value in extras as val_loss."""
    it = iter(values)

    def handler(event: Event) -> NewState:
        extras = {**event.state.extras, "val_loss": next(it)}
        return NewState(event.state.replace(extras=types.MappingProxyType(extras)))

    return handler


def test_early_stopping_stops_when_patience_runs_out() -> None:
    state, batches = _setup(20)
    # Checks at 2, 4, ...: best 4.0 at step 4; 4.5, 4.2, 4.1 are the 1st, 2nd and 3rd checks
    # without improvement: patience=3 stops at the 3rd (step 10), as Lightning, Keras, Ignite and
    # the HF Trainer do.
    stopper = EarlyStopping("val_loss", patience=3)
    events = Events().on("step_end", _feed([5.0, 4.0, 4.5, 4.2, 4.1, 1.0]), every=2)
    events.on("step_end", stopper, every=2)
    final = run(make_train_step(_loss_fn), state, batches, events=events)
    assert final.step == 10
    assert (stopper.best.value, stopper.best.step, stopper.wait) == (4.0, 4, 3)


@pytest.mark.parametrize("patience", [1, 2, 3, 5])
def test_early_stopping_patience_counts_as_lightning_and_keras_do(patience) -> None:
    # Lightning's and Keras's rule (wait_count >= patience after a check without improvement),
    # written out as the oracle: the stop comes at the patience-th check, not one later.
    stopper = EarlyStopping("val_loss", patience=patience)
    values = [1.0] + [2.0] * 10
    stops = [(i, stop) for i, v in enumerate(values) if (stop := stopper.update(v, step=i))]
    assert stops[0][0] == patience
    assert f"for {patience} checks" in stops[0][1].reason


def test_early_stopping_min_delta_and_max_mode() -> None:
    stopper = EarlyStopping("acc", mode="max", patience=1, min_delta=0.05)
    assert stopper.update(0.50, step=1) is None
    assert stopper.update(0.60, step=2) is None  # +0.10: an improvement
    stop = stopper.update(0.64, step=3)  # +0.04 <= min_delta: not one
    assert stop is not None and "acc has not improved by more than 0.05" in stop.reason
    assert "best 0.6 at step 2" in stop.reason


def test_early_stopping_with_the_evaluator_on_a_model_that_does_not_learn() -> None:
    state, batches = _setup(12, lr=0.0)  # lr 0: the validation loss never improves
    evaluator = Evaluator(
        make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")),
        batches[:2],
        metrics={"loss": MeanMetric()},
        every=2,
    )
    events = evaluator.attach(Events())
    events.on("step_end", EarlyStopping("val_loss", patience=2), every=2)
    final = run(make_train_step(_loss_fn), state, batches, events=events)
    assert final.step == 6  # best at 2; no improvement at 4 and 6: the 2nd stops


def test_early_stopping_state_round_trips() -> None:
    stopper = EarlyStopping("val_loss", patience=3)
    stopper.update(1.0, step=1)
    stopper.update(2.0, step=2)
    other = EarlyStopping("val_loss", patience=3)
    other.load_state_dict(stopper.state_dict())
    assert (other.best.value, other.best.step, other.wait) == (1.0, 1, 1)


def test_unknown_monitored_name_lists_the_available_ones() -> None:
    state, batches = _setup(4)
    events = Events().on("step_end", _feed([1.0] * 4), every=2)
    events.on("step_end", EarlyStopping("val_acc"), every=2)
    with pytest.raises(ConfigError, match=r"no 'val_acc' in state\.extras") as info:
        run(make_train_step(_loss_fn), state, batches, events=events)
    assert "the numbers there are: val_loss" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "median"}, "mode"),
        ({"mode": "MIN"}, "mode"),
        ({"patience": -1}, "patience"),
        ({"patience": 0}, "patience=1 stops at the first one"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": float("nan")}, "min_delta"),
    ],
)
def test_bad_early_stopping_settings_are_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        EarlyStopping("val_loss", **kwargs)


def test_best_value_ignores_nan_and_follows_the_mode() -> None:
    best = BestValue(mode="max")
    assert [best.update(v, step=i) for i, v in enumerate([0.1, float("nan"), 0.3, 0.2])] == [
        True,
        False,
        True,
        False,
    ]
    assert (best.value, best.step) == (0.3, 2)


@pytest.mark.parametrize("values", [[0.5, 0.4], (0.5,), torch.tensor([0.5, 0.4])])
def test_best_value_given_a_sweeps_values_refuses_them_with_the_fix(values) -> None:
    # A sweep's evaluation records one value per copy (a list): BestValue.update (and
    # EarlyStopping.update, through it) raised a bare "TypeError: must be real number, not
    # list" (a tensor of 2: "ValueError: only one element tensors ..."), naming neither.
    best = BestValue(mode="min")
    with pytest.raises(ConfigError, match=r"keeps the best of one number.*one per copy"):
        best.update(values, step=1)
    with pytest.raises(ConfigError, match=r"bests\[i\]\.update\(values\[i\]"):
        EarlyStopping("val_loss").update(values, step=1)
    assert (best.value, best.step) == (None, None)
    one: Any = torch.tensor([0.5])  # one number, in a tensor: as before
    assert best.update(one, step=2)
    # The value a handler reads from state.extras: the same test of "several" (a tensor of 2
    # reached .item(), a bare RuntimeError).
    with pytest.raises(ConfigError, match=r"'val_loss' is a list of \d .*SweepEarlyStopping"):
        one_number("EarlyStopping", "val_loss", values)


def test_time_limit_stops_before_the_budget_is_crossed() -> None:
    state, batches = _setup(20)
    now = [0.0]
    limit = TimeLimit(5.5, clock=lambda: now[0])
    events = Events().on("step_end", lambda e: now.__setitem__(0, float(e.step)))  # 1 s/update
    seen: list[int] = []
    limit.attach(events)
    events.on("fit_end", lambda e: seen.append(e.step))
    final = run(make_train_step(_loss_fn), state, batches, events=events)
    # After update 5, 5 s are used and one more would end at 6 s > 5.5 s.
    assert final.step == 5 and seen == [5]


@pytest.mark.parametrize("limit_first", [True, False], ids=["limit-first", "resume-first"])
def test_time_limit_of_a_resumed_run_times_its_own_updates(tmp_path: Path, limit_first) -> None:
    # 10 s per update, a budget of 35 s: the resumed run stops after its 3rd update (30 s
    # used, one more would end at 40 s). Counted from update 0, not from the resumed one, the
    # limit took 30 s / 103 updates for one update's time and ran a 4th, past the budget.
    from steplib.checkpoint import checkpoint_every, resume_from
    from steplib.data import resumable_loader

    now = [0.0]

    def go(max_steps: int, seconds: float) -> tuple[int, float]:
        state, _ = _setup()
        batches = resumable_loader(
            list(zip(torch.randn(480, 4), torch.arange(480) % 3, strict=True)), batch_size=4
        )
        now[0] = 0.0
        ckpt = checkpoint_every(str(tmp_path), every=100)
        limit = TimeLimit(seconds, clock=lambda: now[0])
        handlers = [limit, resume_from(ckpt)] if limit_first else [resume_from(ckpt), limit]
        events = Events().on("step_end", lambda e: now.__setitem__(0, now[0] + 10.0))
        events.add(*handlers, ckpt)
        final = run(make_train_step(_loss_fn), state, batches, events=events, max_steps=max_steps)
        return final.step, now[0]

    assert go(100, 1e9) == (100, 1000.0)
    assert go(120, 35.0) == (103, 30.0)


def test_time_limit_with_the_real_clock_stops_a_long_run() -> None:
    state, batches = _setup(2000)
    final = run(make_train_step(_loss_fn), state, batches, events=TimeLimit(0.2).attach(Events()))
    assert 1 <= final.step < 2000


def test_stop_file_stops_the_run_and_is_removed(tmp_path: Path) -> None:
    state, batches = _setup(20)
    flag = tmp_path / "STOP"
    events = Events().on("step_end", lambda e: flag.touch() if e.step == 7 else None)
    StopFile(str(flag), every=2).attach(events)
    final = run(make_train_step(_loss_fn), state, batches, events=events)
    assert final.step == 8  # created at 7, seen at the next check
    assert not flag.exists()


def test_nan_alarm_names_the_step_and_batch_of_a_non_final_micro_batch() -> None:
    state, batches = _setup(12, nan_at=4)  # accumulate 2: batch 4 belongs to update 3
    steps: list[int] = []
    events = Events().on("step_end", lambda e: steps.append(e.step))
    NonFiniteAlarm(every=2).attach(events)
    with pytest.raises(NonFiniteError) as info:
        run(accumulate(make_train_step(_loss_fn), 2), state, batches, events=events)
    message = str(info.value)
    assert "non-finite loss" in message
    assert "at step 3 (epoch 0, batch index 4, micro-step 5)" in message
    assert steps[-1] == 4  # found at the next read (every 2 updates), not per step


def test_nan_alarm_on_the_final_micro_batch_and_as_a_stop() -> None:
    state, batches = _setup(12, nan_at=5)
    alarm = NonFiniteAlarm(every=5, action="stop")
    final = run(
        accumulate(make_train_step(_loss_fn), 2), state, batches, events=alarm.attach(Events())
    )
    assert final.step == 5  # update 3 held the NaN; read and stopped at 5


def test_nan_alarm_names_a_non_finite_gradient_norm() -> None:
    state, batches = _setup(4)
    # The third batch carries c = 0: sqrt(0 * b + 0) is a finite 0 whose gradient is NaN.
    batches = [(x, y, 0.0 if i == 2 else 1.0) for i, (x, y) in enumerate(batches)]

    def loss_fn(model, batch):
        x, y, c = batch
        loss = F.cross_entropy(model(x), y, reduction="sum")
        return loss + torch.sqrt(model.bias[0] * 0 + c), y.numel()

    step = clip(make_train_step(loss_fn), max_norm=1.0)
    events = NonFiniteAlarm(every=1).attach(Events())
    with pytest.raises(
        NonFiniteError, match=r"gradient norm .* at step 3 \(epoch 0, batch index 2"
    ):
        run(step, state, batches, events=events)


def test_nan_alarm_ignores_skipped_updates_unless_asked() -> None:
    for include, raises in ((False, False), (True, True)):
        state, batches = _setup(6, nan_at=2)
        step = skip_nonfinite(make_train_step(_loss_fn))
        events = NonFiniteAlarm(every=3, include_skipped=include).attach(Events())
        if raises:
            with pytest.raises(NonFiniteError, match="batch index 2"):
                run(step, state, batches, events=events)
        else:
            assert run(step, state, batches, events=events).skipped_updates == 1


def test_grad_norm_monitor_reports_mean_and_max_of_the_measured_norms() -> None:
    state, batches = _setup(6)
    norms: list[float] = []
    monitor = GradNormMonitor()
    events = Events().on("step_end", lambda e: norms.append(float(e.output.grad_norm)))
    monitor.attach(events)
    run(clip(make_train_step(_loss_fn), max_norm=0.5), state, batches, events=events)
    values = monitor.read(None)
    assert values["grad_norm_mean"] == pytest.approx(sum(norms) / 6, rel=1e-6)
    assert values["grad_norm_max"] == pytest.approx(max(norms))


def test_grad_norm_monitor_without_a_measuring_step_says_how_to_measure() -> None:
    state, batches = _setup(2)
    with pytest.raises(ConfigError, match=r"clip\(step, max_norm=1.0\) or skip_nonfinite"):
        run(make_train_step(_loss_fn), state, batches, events=GradNormMonitor().attach(Events()))


def test_grad_norm_monitor_loads_a_checkpoint_of_the_earlier_format() -> None:
    monitor = GradNormMonitor()
    sums = {"sum": torch.tensor(3.0), "max": torch.tensor(2.0), "count": torch.tensor(2.0)}
    monitor.load_state_dict(sums)  # before the sums were kept per step
    assert monitor.read(None) == {"grad_norm_mean": 1.5, "grad_norm_max": 2.0}


def test_lr_monitor_reads_the_scheduled_rate() -> None:
    state, batches = _setup(3)
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0 / (1 + s))
    state = TrainState.create(model=state.model, optimizer=state.optimizer, scheduler=sched)
    seen: list[dict] = []
    events = Events().on("step_end", lambda e: seen.append(LRMonitor().read(e)))
    run(make_train_step(_loss_fn), state, batches, events=events)
    assert [d["next_lr"] for d in seen] == pytest.approx([0.05, 0.1 / 3, 0.025])


@pytest.mark.parametrize(
    "make",
    [
        lambda: TimeLimit(0),
        lambda: TimeLimit(10, every=0),
        lambda: StopFile(""),
        lambda: StopFile("STOP", every=-2),
        lambda: NonFiniteAlarm(every=0),
        lambda: NonFiniteAlarm(action="warn"),
        lambda: EarlyStopping(""),
    ],
)
def test_bad_control_settings_are_config_errors(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_lr_monitor_names_the_next_updates_rate_apart_from_the_rate_an_update_used() -> None:
    # LRMonitor wrote the rate after the scheduler's step (the next update's) as `lr`, the
    # name of the rate the update used (the step's record, TrainMetrics'): a warmup's curve
    # one update early (update 1 at 0.05, where it trained at 0.1), and beside the step's
    # record the Log refused the two sources.
    state, batches = _setup(3)
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0 / (1 + s))
    state = TrainState.create(model=state.model, optimizer=state.optimizer, scheduler=sched)
    records: list[dict] = []

    class Records(Sink):
        def write(self, record: dict) -> None:
            records.append(record)

        def close(self) -> None:
            pass

    log = Log(Records(), sources=[event_record, LRMonitor().read], every=1)
    run(make_train_step(_loss_fn), state, batches, events=[log])
    assert [r["lr"] for r in records] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert [r["next_lr"] for r in records] == pytest.approx([0.05, 0.1 / 3, 0.025])

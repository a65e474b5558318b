"""A sweep under ``run`` with the handlers: per-copy losses in logs and the progress bar, an
evaluator with per-copy metrics, per-copy early stopping and successive halving (a mask in the
update, no host read in the step), checkpoints and exact resume."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

import steplib as sl
from steplib.checkpoint import load, save
from steplib.errors import NonFiniteError
from steplib.handlers import LivePlot, Log, LRMonitor, NonFiniteAlarm, Scheduler, export_best
from steplib.sweep import (
    Copies,
    SuccessiveHalving,
    SweepAdamW,
    SweepEarlyStopping,
    SweepSGD,
    active_copies,
    per_copy_metric,
    stop_copies,
    sweep_step,
)
from steplib.testing import assert_no_host_sync
from tests.reference import RecordingSink, make_batches, tiny_model

N = 4
LRS = [1e-3, 3e-3, 1e-2, 3e-1]


def data(n: int = 24, seed: int = 5) -> list[Any]:
    return [(x, y) for x, y, _ in make_batches(n, seed=seed)]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def build(n: int = N) -> tuple[Copies, sl.TrainState, Any]:
    copies = Copies.stack([tiny_model(i) for i in range(n)])
    opt = SweepAdamW(copies.parameters(), lr=(LRS * n)[:n], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sl.warmup_cosine(warmup=3, total=40))
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    step = sweep_step(sl.clip(sl.make_train_step(loss_fn), max_norm=1.0), copies=copies,
                      example_batch=data()[0])  # fmt: skip
    return copies, state, step


def evaluator(
    copies: Copies, every: int = 4, monitor: str | None = None, sinks: Any = ()
) -> sl.Evaluator:
    eval_step = sl.make_eval_step(lambda m, b: m(b[0]) - b[1].expand(m.n, *b[1].shape))
    metrics = {"loss": per_copy_metric(torchmetrics.MeanSquaredError(), copies.n)}
    return sl.Evaluator(
        lambda s, b: (eval_step(s, b), torch.zeros(copies.n, *b[1].shape)),
        data(6, seed=9),
        metrics=metrics,
        every=every,
        monitor=monitor,
        sinks=sinks,
    )


def test_a_sweep_step_reads_nothing_on_the_host() -> None:
    copies, state, _ = build()
    wrapped = sl.accumulate(sl.skip_nonfinite(sl.clip(sl.make_train_step(loss_fn), max_norm=1)), 2)
    step = sweep_step(wrapped, copies=copies, example_batch=data()[0])
    state = assert_no_host_sync(step, state, data(4))
    assert state.step == 2


def test_run_logs_one_loss_per_copy_and_the_progress_bar_shows_the_range(tmp_path: Path) -> None:
    _, state, step = build()
    log, bar_file = tmp_path / "log.jsonl", io.StringIO()
    bar = sl.ProgressBar(every=2, file=bar_file)
    logger = Log(sl.JsonlLogger(str(log)), every=2)
    sl.run(step, state, data(8), events=[logger, bar])
    records = [orjson.loads(line) for line in log.read_text().splitlines()]
    assert [len(r["loss"]) for r in records] == [N] * 4
    assert len(records[-1]["lr"]) == N and len(records[-1]["grad_norm"]) == N
    assert "skipped" not in records[-1]
    assert len(bar.stats["loss"]) == N and "(best #" in bar_file.getvalue()


def test_the_progress_bar_shows_the_range_of_the_copies_that_trained() -> None:
    # With copy 0 stopped (its mean NaN), the bar showed "loss=1.1853-nan": max() keeps a NaN
    # that comes first; stopped last, the same copies showed a number.
    _, state, step = build()
    stop_copies(state.optimizer, [0])
    bar_file = io.StringIO()
    bar = sl.ProgressBar(every=2, file=bar_file)
    sl.run(step, state, data(4), events=[bar])
    losses = bar.stats["loss"]
    assert math.isnan(losses[0]) and not any(map(math.isnan, losses[1:]))
    shown = f"loss={min(losses[1:]):.4f}-{max(losses[1:]):.4f} (best #"
    assert shown in bar_file.getvalue().splitlines()[-1]
    # LivePlot's line outside a notebook, the same range ("... 1.185-nan over 4 copies").
    _, state, step = build()
    stop_copies(state.optimizer, [0])
    plot_file = io.StringIO()
    sl.run(step, state, data(4), events=[LivePlot(every=2, mode="text", file=plot_file)])
    last = plot_file.getvalue().splitlines()[-1]
    assert "nan" not in last and "over 4 copies" in last


def test_evaluator_records_per_copy_metrics_and_early_stopping_stops_copies_alone() -> None:
    copies, state, step = build()
    ev = evaluator(copies)
    stopper = SweepEarlyStopping("val_loss", patience=1)
    before: dict[int, torch.Tensor] = {}

    def remember(event: sl.Event) -> None:
        for i in range(N):
            if i not in active_copies(state.optimizer) and i not in before:
                before[i] = copies.stacked.get_parameter("0.weight")[i].detach().clone()

    events = sl.Events(ev, stopper).on("step_end", remember)
    state = sl.run(step, state, data(24), events=events)
    assert all(len(v["val_loss"]) == N for _, v in ev.history)
    stopped = [i for i in range(N) if i not in active_copies(state.optimizer)]
    assert stopped, "the lr=0.3 copy oscillates and stops early"
    for i in stopped:  # a stopped copy is never updated again
        assert torch.equal(before[i], copies.stacked.get_parameter("0.weight")[i])


def test_successive_halving_halves_the_active_copies_at_each_evaluation() -> None:
    copies, state, step = build(8)
    ev = evaluator(copies, every=4)
    seen: list[int] = []
    events = sl.Events(ev, SuccessiveHalving("val_loss", keep=0.5)).on(
        "validation_end", lambda e: seen.append(len(active_copies(e.state.optimizer)))
    )
    state = sl.run(step, state, data(16), events=events)
    assert seen == [4, 2, 1, 1]
    best = active_copies(state.optimizer)[0]
    values = ev.history[0][1]["val_loss"]
    assert best in sorted(range(8), key=lambda i: values[i])[:4]


def test_a_sweep_saved_and_loaded_mid_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    batches = data(20)
    copies, state, step = build()
    losses = []
    for i, batch in enumerate(batches):
        state, out = step(state, batch)
        losses.append(out.loss)
        if i == 9:
            url = save(state, str(tmp_path / "ckpt"), step=step)
    copies2, state2, step2 = build()
    state2 = load(url, state2, step=step2)
    resumed = []
    for batch in batches[10:]:
        state2, out = step2(state2, batch)
        resumed.append(out.loss)
    for a, b in zip(losses[10:], resumed, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        torch.cat([p.flatten() for p in copies.parameters()]),
        torch.cat([p.flatten() for p in copies2.parameters()]),
    )
    opt, opt2 = state.optimizer.state_dict(), state2.optimizer.state_dict()
    for key in opt["state"]:
        for name, value in opt["state"][key].items():
            assert torch.equal(value, opt2["state"][key][name]), name


def test_resume_restores_the_stopped_copies_and_the_stoppers_state(tmp_path: Path) -> None:
    def one_run(kill_at: int | None) -> tuple[Copies, SweepEarlyStopping]:
        copies, state, step = build()
        stopper = SweepEarlyStopping("val_loss", patience=2)
        ckpt = sl.checkpoint_every(str(tmp_path / str(kill_at)), every=4)
        loader = sl.resumable_loader(data(32), batch_size=None, seed=1)
        events = sl.Events(sl.resume_from(ckpt), evaluator(copies), stopper, ckpt)
        sl.run(step, state, loader, events=events, max_steps=kill_at or 32)
        if kill_at is None:
            return copies, stopper
        copies, state, step = build()  # a new process: everything rebuilt
        stopper = SweepEarlyStopping("val_loss", patience=2)
        ckpt = sl.checkpoint_every(str(tmp_path / str(kill_at)), every=4)
        loader = sl.resumable_loader(data(32), batch_size=None, seed=1)
        events = sl.Events(sl.resume_from(ckpt), evaluator(copies), stopper, ckpt)
        sl.run(step, state, loader, events=events, max_steps=32)
        return copies, stopper

    whole, stopper = one_run(None)
    resumed, stopper2 = one_run(12)
    assert max(stopper.wait) >= 2  # some copy was stopped (patience 2)
    assert stopper.state_dict() == stopper2.state_dict()
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_run_resumed_after_every_copy_stopped_stops_at_once_as_the_run_it_continues(
    tmp_path: Path,
) -> None:
    # It went on to its next evaluation: 2 more updates of no copy, one more evaluation and
    # checkpoint, and the schedule moved, at each resume.
    def one_run() -> tuple[sl.TrainState, sl.Evaluator]:
        copies, state, step = build()
        ev = evaluator(copies, every=2)
        stopper = SweepEarlyStopping("val_loss", patience=1, min_delta=10.0)  # never improves
        ckpt = sl.checkpoint_every(str(tmp_path), every=2)
        loader = sl.resumable_loader(data(40), batch_size=None, seed=1)
        events = sl.Events(sl.resume_from(ckpt), ev, stopper, ckpt)
        return sl.run(step, state, loader, events=events, max_steps=40), ev

    whole, ev = one_run()
    assert whole.step == 4 and not active_copies(whole.optimizer)  # stopped at evaluation 2
    resumed, ev2 = one_run()
    assert resumed.step == whole.step
    assert ev2.history == ev.history
    assert resumed.scheduler is not None and whole.scheduler is not None
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]


@pytest.mark.parametrize("lrs", [[1e-2, 1e30], [1e30, 1e-2], [1e-2, 1e-2, 1e-2, 1e30]])
def test_non_finite_alarm_judges_each_copy_by_its_own_skip(lrs: list[float]) -> None:
    # The [N] flags were reduced before the [N] skip mask met the [2] flag pair: with 2
    # copies, copy 1's skipped NaN raised (or copy 0's was called a gradient norm's); with 4,
    # a RuntimeError (shapes 2 and 4) at the first skip.
    def train(wrap: Any) -> list[Any]:
        copies = Copies.stack([tiny_model(i) for i in range(len(lrs))])
        opt = SweepSGD(copies.parameters(), lr=lrs)
        state = sl.TrainState.create(model=copies, optimizer=opt)
        step = sweep_step(wrap(sl.make_train_step(loss_fn)), copies=copies, example_batch=data()[0])
        skipped: list[Any] = []
        events = sl.Events(NonFiniteAlarm(every=1)).on(
            "step_end", lambda e: skipped.append(e.output.skipped.tolist())
        )
        sl.run(step, state, data(4), events=events)
        return skipped

    diverged = lrs.index(1e30)
    skipped = train(sl.skip_nonfinite)  # the diverged copy's updates were not applied: no alarm
    assert [s[diverged] for s in skipped] == [False, True, True, True]
    assert not any(s[i] for s in skipped for i in range(len(lrs)) if i != diverged)
    with pytest.raises(NonFiniteError, match=r"non-finite loss .* at step 2"):
        train(lambda s: s)  # applied: the alarm


def test_the_log_record_says_which_copies_skipped() -> None:
    # It wrote "skipped": true when any copy skipped: which one was lost (the loss, lr and
    # grad_norm of the same record are per copy).
    copies = Copies.stack([tiny_model(i) for i in range(3)])
    opt = SweepSGD(copies.parameters(), lr=[1e-2, 1e30, 1e-2])
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(sl.skip_nonfinite(sl.make_train_step(loss_fn)), copies=copies,
                      example_batch=data()[0])  # fmt: skip
    records = RecordingSink()
    sl.run(step, state, data(3), events=[Log(records, every=1)])
    diverged = [False, True, False]  # copy 1, from its second update on
    assert [r.get("skipped") for r in records.records] == [None, diverged, diverged]


def test_stopping_handlers_refuse_values_that_are_not_per_copy() -> None:
    _, state, step = build()
    ev = sl.Evaluator(
        sl.make_eval_step(lambda m, b: (m(b[0]).mean(0), b[1])),
        data(2),
        metrics={"loss": torchmetrics.MeanSquaredError()},
        every=2,
    )
    with pytest.raises(sl.ConfigError, match="per_copy_metric"):
        sl.run(step, state, data(4), events=sl.Events(ev, SweepEarlyStopping("val_loss")))


@pytest.mark.parametrize("stopper", [SweepEarlyStopping, SuccessiveHalving])
def test_stopping_handlers_refuse_a_torch_optimizer_before_the_first_update(stopper: Any) -> None:
    """A sweep of seeds over torch.optim.AdamW (the fastest, the docs say) with a stopper
    trained until the first evaluation, then raised: now at fit_start, nothing trained."""
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    state = sl.TrainState.create(model=copies, optimizer=torch.optim.AdamW(copies.parameters()))
    step = sweep_step(sl.make_train_step(loss_fn), copies=copies, example_batch=data()[0])
    before = [p.detach().clone() for p in copies.parameters()]
    with pytest.raises(sl.ConfigError, match=f"{stopper.__name__} needs a sweep optimizer"):
        sl.run(step, state, data(4), events=sl.Events(evaluator(copies), stopper("val_loss")))
    assert all(torch.equal(b, p) for b, p in zip(before, copies.parameters(), strict=True))


def test_a_per_copy_metric_for_another_number_of_copies_is_refused_before_any_update() -> None:
    """per_copy_metric(metric, 3) over 4 copies computed the first 3 and dropped the last
    without a word: a best copy chosen from its values could never be the last one."""
    copies, state, step = build()
    before = [p.detach().clone() for p in copies.parameters()]
    eval_step = sl.make_eval_step(lambda m, b: (m(b[0]), b[1].expand(m.n, *b[1].shape)))
    ev = sl.Evaluator(
        eval_step,
        data(2, seed=9),
        metrics={"loss": per_copy_metric(torchmetrics.MeanSquaredError(), N - 1)},
        every=2,
    )
    with pytest.raises(sl.ConfigError, match=r"n=3\) received a tensor of shape \(4, "):
        sl.run(step, state, data(4), events=[ev])
    for b, p in zip(before, copies.parameters(), strict=True):
        assert torch.equal(b, p)  # refused at the sanity evaluation, before the first update
    metric = per_copy_metric(torchmetrics.MeanSquaredError(), N)
    metric.update(torch.ones(N, 5), torch.zeros(N, 5))
    assert metric.compute().tolist() == [1.0] * N


def test_lr_monitor_logs_each_copy_rate_not_the_schedule_factor() -> None:
    """A sweep optimizer's group["lr"] is the schedule's factor (1.0 at the start), no copy's
    rate: LRMonitor logged it as the run's `lr`, over the step's per-copy list."""
    _, state, step = build()
    for batch in data(5):
        state, _ = step(state, batch)
    read = LRMonitor().read(sl.Event("step_end", state=state, step=5))
    factor = sl.warmup_cosine(warmup=3, total=40)(5)
    assert read == {"next_lr": pytest.approx([lr * factor for lr in LRS], rel=1e-12)}


@pytest.mark.parametrize("watcher", ["Evaluator", "EarlyStopping", "export_best"])
def test_a_handler_that_watches_one_number_is_refused_a_sweeps_per_copy_value(watcher: str) -> None:
    copies, state, step = build()
    if watcher == "Evaluator":
        events = sl.Events(evaluator(copies, monitor="val_loss"))
    else:
        events = sl.Events(evaluator(copies))
        handler: Any = (
            sl.EarlyStopping("val_loss", patience=2)
            if watcher == "EarlyStopping"
            else export_best("memory://sweep-refused/model.pt", monitor="val_loss")
        )
        events.on("step_end", handler, every=4)
    with pytest.raises(sl.ConfigError, match=r"'val_loss' is a list of 4 .*SweepEarlyStopping"):
        sl.run(step, state, data(8), events=events)


def test_combine_a_plateau_scheduler_and_keep_best_refuse_a_sweeps_value_naming_it(
    tmp_path: Path,
) -> None:
    # Each failed without a word of why: float() of a list (TypeError) for combine and the
    # Scheduler; keep_best said "found no 'val_loss'" while val_loss was there, a list of 4.
    copies, state, step = build()
    ev = sl.Evaluator(
        sl.make_eval_step(lambda m, b: m(b[0]) - b[1].expand(m.n, *b[1].shape)),
        {"a": data(2, seed=9), "b": data(2, seed=10)},
        metrics={"loss": per_copy_metric(torchmetrics.MeanMetric(), copies.n)},
        every=4,
        combine="loss",
    )
    with pytest.raises(sl.ConfigError, match=r"combine='loss'.* is a list of 4 .*Leave combine"):
        sl.run(step, state, data(8), events=[ev])

    copies, state, step = build()
    state = state.replace(scheduler=None)  # a LambdaLR would erase the plateau's changes
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer)
    events = [evaluator(copies), Scheduler(plateau, metric="val_loss")]
    with pytest.raises(sl.ConfigError, match=r"Scheduler\(metric='val_loss'\) .* list of 4"):
        sl.run(step, state, data(8), events=events)

    copies, state, step = build()
    ckpt = sl.checkpoint_every(str(tmp_path), every=4, keep_best=1, metric="val_loss")
    with pytest.raises(sl.ConfigError, match=r"'val_loss' is a list of 4 .*keep_last alone"):
        sl.run(step, state, data(8), events=[evaluator(copies), ckpt])
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_an_ema_of_a_sweep_is_refused_with_the_fix() -> None:
    # It failed inside its count with "output with shape [] doesn't match the broadcast shape
    # [4]": one EMA counts one model's updates, while a sweep's copies update one by one.
    copies, state, step = build()
    with pytest.raises(sl.ConfigError, match=r"one per copy of a sweep.*copies\.copy\(i\)"):
        sl.run(step, state, data(2), events=[sl.handlers.EMA(copies)])


def test_tensorboard_plots_one_curve_per_copy_of_a_sweeps_values(tmp_path: Path) -> None:
    # Each list was skipped as "not a number": a sweep's TensorBoard held no curve at all.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )

    copies, state, step = build()
    records = RecordingSink()
    with sl.TensorBoardLogger(str(tmp_path / "tb")) as tb:
        ev = evaluator(copies, every=4, sinks=[tb])
        sl.run(step, state, data(8), events=[ev, Log([tb, records], every=2)])
    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    for name in ("loss", "lr", "grad_norm", "val_loss"):
        assert {f"{name}/{i}" for i in range(N)} <= tags, name
    for i in range(N):  # each curve is its copy's own values, at each logged update
        points = reader.Scalars(f"loss/{i}")
        assert [s.step for s in points] == [r["step"] for r in records.records] == [2, 4, 6, 8]
        expected = [r["loss"][i] for r in records.records]
        assert [s.value for s in points] == pytest.approx(expected, rel=1e-6)
        points = reader.Scalars(f"val_loss/{i}")
        assert [s.step for s in points] == [at for at, _ in ev.history] == [4, 8]
        expected = [values["val_loss"][i] for _, values in ev.history]
        assert [s.value for s in points] == pytest.approx(expected, rel=1e-6)

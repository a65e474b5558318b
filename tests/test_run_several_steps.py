"""``run`` drives several steps over one state (issue 28): ``run({"D": d_step, "G": g_step},
state, data)`` equals the two steps called in order in your own loop, bit for bit (with
accumulation, a shorter last window closed at the end of a sized epoch, and an open one flushed
at the end of an unsized one); the handlers see every step's output; a checkpoint fingerprints
every step's composition; bad arguments are refused with the fix."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import (
    ConfigError,
    Event,
    Events,
    ProgressBar,
    TrainState,
    accumulate,
    clip,
    iterate,
    make_train_step,
    run,
    skip_nonfinite,
)
from steplib.checkpoint import checkpoint_every, list_checkpoints, load, save
from steplib.errors import NonFiniteError
from steplib.handlers import GradNormMonitor, LRMonitor, NonFiniteAlarm, TrainMetrics
from steplib.handlers.logging import event_record
from tests.reference import Unsized


def _state() -> TrainState:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    d = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": torch.optim.Adam(g.parameters(), lr=1e-2),
                   "D": torch.optim.SGD(d.parameters(), lr=1e-1, momentum=0.9)},
    )  # fmt: skip


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _d_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    real, noise = batch
    return _bce(model["D"](real), 1.0) + _bce(model["D"](model["G"](noise).detach()), 0.0)


def _g_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _bce(model["D"](model["G"](batch[1])), 1.0)


def _steps(d_clip: float = 1.0) -> dict[str, Any]:
    return {
        "D": clip(accumulate(make_train_step(_d_loss, optimizer="D"), 2), max_norm=d_clip),
        "G": accumulate(make_train_step(_g_loss, optimizer="G"), 3),
    }


def _batches(n: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, generator=g) + 3, torch.randn(8, 4, generator=g)) for _ in range(n)]


def _own_loop(data: list[Any], epochs: int, *, sized: bool) -> tuple[TrainState, list[float]]:
    state, steps, losses = _state(), _steps(), []
    for _ in range(epochs):
        for index, batch in enumerate(data):
            close = sized and index == len(data) - 1
            for step in steps.values():
                state, out = step(state, batch, close_window=close)
                losses.append(out.loss.item())
        for step in steps.values():
            state, _ = step.flush(state)
        state = state.replace(epoch=state.epoch + 1)
    return state, losses


def _assert_same_training(a: TrainState, b: TrainState) -> None:
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[name], tensor), name
    for lane in ("G", "D"):
        mine, theirs = a[lane], b[lane]
        assert (mine.step, mine.micro_step, mine.window.size) == (
            theirs.step,
            theirs.micro_step,
            theirs.window.size,
        )


@pytest.mark.parametrize("sized", [True, False])
def test_several_steps_through_run_equal_the_steps_called_in_order_in_your_own_loop(
    sized: bool,
) -> None:
    data = _batches()
    expected, expected_losses = _own_loop(data, epochs=2, sized=sized)
    losses: list[float] = []
    loop = iterate(_steps(), _state(), data if sized else Unsized(data), max_epochs=2)
    while True:
        try:
            _, outs = next(loop)
        except StopIteration as finished:
            state = finished.value  # the last state, its epoch counted
            break
        losses.extend(out.loss.item() for out in outs.values())  # a flush yields what ran
    if sized:
        assert losses == expected_losses
    assert state.epoch == 2
    # 7 batches: D closes 4 windows per epoch (the last one shorter), G 3 (likewise).
    assert (state["D"].step, state["G"].step) == (8, 6)
    _assert_same_training(expected, state)


def test_events_carry_each_steps_output_and_logs_and_the_bar_show_each_loss() -> None:
    records: list[dict[str, Any]] = []
    seen: list[tuple[int, tuple[str, ...]]] = []

    def log(event: Event) -> None:
        records.append(event_record(event))
        assert event.outputs is not None
        seen.append((event.step, tuple(event.outputs)))
        assert event.output is event.outputs["G"]  # event.output: the last step's

    bar = ProgressBar(every=1, file=io.StringIO())
    events = bar.attach(Events().on("step_end", log))
    state = run(_steps(), _state(), _batches(6), events=events)
    assert [step for step, _ in seen] == [1, 2]  # step_end follows state.step: G's updates
    assert all(names == ("D", "G") for _, names in seen)
    assert {"D/loss", "G/loss", "G/lr", "D/num_targets"} <= records[1].keys()
    assert "D/loss" not in records[0]  # at batch 3 D's window is open: no update of D
    assert "loss" not in records[0] and "loss" not in records[1]
    assert records[-1]["G/loss"] == pytest.approx(bar.stats["G/loss"])
    assert state.step == 2 and state["D"].step == 3


def test_a_non_finite_loss_of_any_step_raises_the_alarm() -> None:
    def nan_d_loss(model: Any, batch: Any) -> torch.Tensor:
        return _d_loss(model, batch) * float("nan")

    steps = {"D": make_train_step(nan_d_loss, optimizer="D"), "G": _steps()["G"]}
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        run(steps, _state(), _batches(3), events=[NonFiniteAlarm(every=1)])


def test_a_checkpoint_fingerprints_every_step_of_the_run(tmp_path: Any) -> None:
    state = run(_steps(), _state(), _batches(4))
    url = save(state, str(tmp_path / "ckpt"), step=_steps())
    assert load(url, _state(), step=_steps()).step == state.step
    with pytest.raises(ConfigError, match=r"D:clip max_norm=1.0 in the checkpoint, 2.0 now"):
        load(url, _state(), step=_steps(d_clip=2.0))
    with pytest.raises(ConfigError, match=r"the checkpoint's step applies steps\(names="):
        load(url, _state(), step=_steps()["G"])  # one step for a checkpoint of two
    with pytest.raises(ConfigError, match=r"G:accumulate"):
        load(url, _state(), step={"D": _steps()["D"], "G": make_train_step(_g_loss, optimizer="G")})
    with pytest.raises(ConfigError, match=r"names=\['D', 'G'\] in the checkpoint"):
        load(url, _state(), step={"G": _steps()["G"], "D": _steps()["D"]})  # another order


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s, d: run({}, s, d), r"name each step"),
        (lambda s, d: run({"D": print}, s, d), r"the step 'D' of type builtin_function"),  # type: ignore[dict-item]
        (lambda s, d: run(_steps()["D"], s, d, feed={"D": print}), r"feed=.*several steps"),
        (lambda s, d: run(_steps(), s, d, feed={"X": print}), r"The steps here: \['D', 'G'\]"),
        (lambda s, d: save(s, "memory://x", step={"D": print}), r"step=\.\.\.\) received"),
    ],
)
def test_bad_several_step_arguments_are_refused_with_the_fix(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(_state(), _batches(2))


@pytest.mark.parametrize("several", [True, False])
def test_steps_that_never_update_the_counted_optimizer_are_refused(several: bool) -> None:
    # The run counts G's updates (G is the state's first optimizer); D's step alone never
    # advanced them: step_end never fired (no evaluation, checkpoint or log every N updates)
    # and max_steps alone would never have stopped the run.
    d_step = _steps()["D"]
    seen: list[int] = []
    events = Events().on("step_end", lambda e: seen.append(e.step))
    with pytest.raises(ValueError, match=r"update \['D'\] but not 'G', the state's first"):
        run({"D": d_step} if several else d_step, _state(), _batches(4), events=events)
    assert seen == []
    # What the message offers: D's own state, whose counters are D's.
    state = _state()
    done = run(d_step, state["D"], _batches(4), events=events)
    assert (seen, state.with_lane(done)["D"].step) == ([1, 2], 2)


def test_a_non_finite_update_of_one_step_raises_the_alarm_though_another_step_skipped() -> None:
    # D applies its NaN update (no skip_nonfinite); G, whose loss runs through D, skips its
    # own. The alarm masked every step's flags with the last step's (G's) skip: D's weights
    # became NaN and no alarm was ever raised.
    steps = {
        "D": make_train_step(_d_loss, optimizer="D"),
        "G": skip_nonfinite(make_train_step(_g_loss, optimizer="G")),
    }
    data = _batches(6)
    data[2] = (torch.full_like(data[2][0], float("nan")), data[2][1])
    with pytest.raises(NonFiniteError, match=r"loss of step 'D' .* at step 3 .*batch index 2"):
        run(steps, _state(), data, events=[NonFiniteAlarm(every=2)])


def test_the_alarm_takes_steps_named_otherwise_than_the_state_has_optimizers() -> None:
    model = nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    done = run({"main": step}, state, [torch.ones(2, 2)] * 3, events=[NonFiniteAlarm(every=1)])
    assert done.step == 3


@pytest.mark.parametrize("names", [("D", "G"), ("critic", "generator")])
def test_the_alarm_judges_each_step_by_the_window_of_the_optimizer_it_updates(
    names: tuple[str, str],
) -> None:
    # D skips its NaN window of batch 0 (no alarm is due), G accumulates 2. Judged by the
    # counted (G's) window, open at batch 0, D's flags waited for G's window to close and were
    # then kept by D's next, unskipped, window: a false alarm for an update that was skipped.
    # Named otherwise than their optimizers ("critic"), the steps were refused; each is now
    # judged by the optimizer it was built with.
    calls = [0]

    def d_loss(model: Any, batch: Any) -> torch.Tensor:
        calls[0] += 1
        return _d_loss(model, batch) * (float("nan") if calls[0] == 1 else 1.0)

    d_step = skip_nonfinite(make_train_step(d_loss, optimizer="D"))
    g_step = accumulate(make_train_step(_g_loss, optimizer="G"), 2)
    steps = dict(zip(names, (d_step, g_step), strict=True))
    done = run(steps, _state(), _batches(4), events=[NonFiniteAlarm(every=1)])
    assert int(done["D"].skipped_updates) == 1  # skipped, and no alarm


class _OwnStep:
    """A step of the user's own: no ``optimizer`` to read."""

    def __call__(self, state: Any, batch: Any, *, close_window: bool = False) -> Any:
        return state, None

    def flush(self, state: Any) -> Any:
        return state, None


def test_the_alarm_refuses_a_step_that_updates_no_optimizer_of_the_state() -> None:
    with pytest.raises(ConfigError, match=r"steps \['mine'\] name none of the state's"):
        run({"mine": _OwnStep()}, _state(), _batches(4), events=[NonFiniteAlarm(every=1)])


def test_the_bar_shows_each_steps_loss_over_its_own_windows() -> None:
    # G (counted) updates every 3 batches, D every 2: D's windows close at batches 2, 4 and 6,
    # between G's updates; at G's update of batch 3, D's call reported one micro-batch, which
    # the bar added and then added again inside D's window loss.
    windows: dict[str, list[tuple[float, float]]] = {"D": [], "G": []}

    def closed(event: Event) -> None:
        assert event.outputs is not None
        for name, out in event.outputs.items():
            if bool(out.did_update):
                windows[name].append((float(out.loss), float(out.num_targets)))

    bar = ProgressBar(every=2, file=io.StringIO())
    events = Events().on("micro_step_end", closed)
    bar.attach(events)
    run(_steps(), _state(), _batches(6), events=events)
    assert [len(windows["D"]), len(windows["G"])] == [3, 2]
    for name in ("D", "G"):
        targets = sum(t for _, t in windows[name])
        loss = sum(loss * t for loss, t in windows[name]) / targets
        assert bar.stats[f"{name}/loss"] == pytest.approx(loss, rel=1e-6)


def test_the_bar_shows_each_steps_lr_under_its_name() -> None:
    # G's Adam at 1e-2 is the counted optimizer; D's SGD at 0.1 ran last. The bar showed D's
    # as the one "lr".
    out = io.StringIO()
    bar = ProgressBar(every=2, file=out)
    run(_steps(), _state(), _batches(6), events=[bar])
    assert "lr" not in bar.stats
    assert (bar.stats["G/lr"], bar.stats["D/lr"]) == (pytest.approx(1e-2), pytest.approx(0.1))
    assert "D lr=0.1, G lr=0.01" in out.getvalue()


def test_train_metrics_report_each_steps_windows_under_its_name() -> None:
    # G (counted) updates on every batch, D (the last step) every 2. Before the fix the record
    # held the last step's loss under the plain name, G's not at all, and an aux value of the
    # calls the counted updates fell on (D's at batches 0 and 2 only, 1 and 3 not).
    windows: dict[str, list[tuple[float, float]]] = {"D": [], "G": []}
    aux: dict[str, list[float]] = {"D": [], "G": []}

    def closed(event: Event) -> None:
        assert event.outputs is not None
        for name, out in event.outputs.items():
            aux[name].append(float(out.aux["mean"]))
            if bool(out.did_update):
                windows[name].append((float(out.loss), float(out.num_targets)))

    def with_aux(loss_fn: Any) -> Any:
        return lambda m, b: (loss_fn(m, b), {"mean": b[1].mean()})

    steps = {
        "G": make_train_step(with_aux(_g_loss), optimizer="G"),
        "D": accumulate(make_train_step(with_aux(_d_loss), optimizer="D"), 2),
    }
    train = TrainMetrics()
    events = Events().on("micro_step_end", closed)
    train.attach(events)
    reads: list[dict[str, Any]] = []
    events.on("step_end", lambda event: reads.append(train.read(event)), every=4)
    run(steps, _state(), _batches(4), events=events)
    assert [len(windows["D"]), len(windows["G"])] == [2, 4] and reads[0]["updates"] == 4
    for name in ("D", "G"):
        targets = sum(t for _, t in windows[name])
        loss = sum(loss * t for loss, t in windows[name]) / targets
        assert reads[0][f"{name}/num_targets"] == targets == 4  # D was 6: 2 batches twice
        assert reads[0][f"{name}/loss"] == pytest.approx(loss, rel=1e-6)
        assert reads[0][f"{name}/mean"] == pytest.approx(sum(aux[name]) / 4, rel=1e-6)
    assert "loss" not in reads[0]


def test_the_grad_norm_monitor_reports_each_steps_norms_under_its_name() -> None:
    # D (last, clipped) closes a window every 2 batches, G (counted, clipped) every 3: at G's
    # updates D's window was open (no norm), and the monitor refused the run as unclipped.
    norms: dict[str, list[float]] = {"D": [], "G": []}

    def closed(event: Event) -> None:
        assert event.outputs is not None
        for name, out in event.outputs.items():
            if out.grad_norm is not None:
                norms[name].append(float(out.grad_norm))

    steps = {"D": _steps()["D"], "G": clip(_steps()["G"], max_norm=1.0)}
    monitor = GradNormMonitor()
    events = Events().on("micro_step_end", closed)
    monitor.attach(events)
    run(steps, _state(), _batches(6), events=events)
    read = monitor.read(None)
    assert [len(norms["D"]), len(norms["G"])] == [3, 2]
    for name in ("D", "G"):
        assert read[f"{name}/grad_norm_mean"] == pytest.approx(sum(norms[name]) / len(norms[name]))
        assert read[f"{name}/grad_norm_max"] == pytest.approx(max(norms[name]))


def test_the_lr_monitor_reads_every_optimizer_under_its_name() -> None:
    # G's Adam at 1e-2 is the state's first optimizer; D's SGD at 0.1. It logged G's as "lr".
    reads: list[dict[str, Any]] = []
    events = Events().on("step_end", lambda event: reads.append(LRMonitor().read(event)))
    run(_steps(), _state(), _batches(3), events=events)
    assert reads[-1] == {"G/next_lr": pytest.approx(1e-2), "D/next_lr": pytest.approx(0.1)}


def test_a_record_at_an_update_holds_each_steps_values_only_of_a_window_it_closed(
    tmp_path: Any,
) -> None:
    # G (counted) closes a window every 3 batches, D every 2: at G's first update (batch 3)
    # D's window is open. The record (Log's default source) and a checkpoint's metrics wrote
    # as D/loss that call's one micro-batch (num_targets 1), a loss no update of D had.
    data = _batches(6)
    state, steps, closed = _state(), _steps(), {}
    for index, batch in enumerate(data):  # the reference: the steps in your own loop
        for name, step in steps.items():
            state, out = step(state, batch, close_window=index == len(data) - 1)
            if bool(out.did_update):
                closed[(name, state[name].micro_step)] = (out.loss.item(), int(out.num_targets))
    records: list[dict[str, Any]] = []
    ckpt = checkpoint_every(str(tmp_path / "ckpt"), every=1)
    events = Events().on("step_end", lambda event: records.append(event_record(event)))
    run(_steps(), _state(), data, events=events.add(ckpt))
    saved = [c.metrics for c in list_checkpoints(str(tmp_path / "ckpt"))]
    assert [r["micro_step"] for r in records] == [3, 6]
    for record, metrics in zip(records, saved, strict=True):
        for name in ("D", "G"):
            window = closed.get((name, record["micro_step"]))
            if window is None:  # D at batch 3: its window is open
                assert f"{name}/loss" not in record and f"{name}/num_targets" not in record
                assert f"{name}/loss" not in metrics
            else:
                assert record[f"{name}/loss"] == pytest.approx(window[0], rel=1e-6)
                assert record[f"{name}/num_targets"] == window[1]
                assert metrics[f"{name}/loss"] == pytest.approx(window[0], rel=1e-6)
    assert "D/loss" not in records[0] and "D/loss" in records[1]


def test_the_record_of_a_run_stopped_inside_the_counted_window_counts_each_window_once() -> None:
    # G (counted) closes a window every 3 batches, D every 2; the run stops at batch 8, inside
    # G's third window, and Log writes G's last update (batch 6) at fit_end. The readers had
    # seen D's window of batch 8 since, so they took D's window of batch 6 for a new one and
    # added it again (its norm, its targets, its batches).
    from steplib.events import Stop
    from steplib.handlers import Throughput
    from steplib.handlers.logging import Log
    from tests.reference import RecordingSink

    norms: dict[str, list[float]] = {"D": [], "G": []}
    targets = {"D": 0, "G": 0}

    def closed(event: Event) -> None:
        assert event.outputs is not None
        for name, out in event.outputs.items():
            if out.grad_norm is not None:
                norms[name].append(float(out.grad_norm))
                targets[name] += int(out.num_targets)

    steps = {"D": _steps()["D"], "G": clip(_steps()["G"], max_norm=1.0)}
    monitor, train, speed = GradNormMonitor(), TrainMetrics(), Throughput(unit="batches")
    sink = RecordingSink()
    events = Events(monitor, train, speed).on("micro_step_end", closed)
    events.add(Log(sink, sources=[monitor.read, train.read, speed.read], every=4))
    events.on("micro_step_end", lambda event: Stop("enough") if event.micro_step == 8 else None)
    run(steps, _state(), _batches(9), events=events)
    (record,) = sink.records
    assert record["step"] == 2 and [len(norms["D"]), len(norms["G"])] == [4, 2]
    for name in ("D", "G"):
        mean = sum(norms[name]) / len(norms[name])
        assert record[f"{name}/grad_norm_mean"] == pytest.approx(mean)
        assert record[f"{name}/num_targets"] == targets[name]
        per_update = record[f"{name}/batches_per_s"] / record["steps_per_s"]  # G's 2 updates
        assert per_update == pytest.approx(targets[name] / 2)  # a mean loss: 1 target a batch

"""Throughput: FLOPs counted on the meta device equal a real count and change nothing; the
rates equal counts over a fake clock; MFU against the given peak; bad input."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from steplib import ConfigError, Events, TrainState, accumulate, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.handlers import Log, Throughput, count_flops, flops_per_batch
from tests.reference import RecordingSink


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Dropout(0.1),
        torch.nn.BatchNorm1d(32),
        torch.nn.Linear(32, 5),
    )


def _loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def _batch(size: int = 16):
    gen = torch.Generator().manual_seed(2)
    return torch.randn(size, 8, generator=gen), torch.randint(0, 5, (size,), generator=gen)


def test_meta_flop_count_equals_a_real_count_and_changes_nothing() -> None:
    model, batch = _model(), _batch()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()

    counted = flops_per_batch(model, batch, loss_fn=_loss_fn)

    assert torch.equal(rng, torch.get_rng_state())  # dropout drew nothing
    for name, value in model.state_dict().items():  # batch-norm statistics untouched
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())

    twin = copy.deepcopy(model)
    real = count_flops(lambda: _loss_fn(twin, batch)[0].backward())
    assert counted == real
    # Forward 2*N*(8*32 + 32*5); backward: weight grads of both, input grad of the second only.
    n = 16
    assert counted == 2 * n * (8 * 32 + 32 * 5) + 2 * n * (8 * 32 + 32 * 5) + 2 * n * 32 * 5
    assert flops_per_batch(model, batch, loss_fn=_loss_fn, backward=False) == 2 * n * (
        8 * 32 + 32 * 5
    )


def test_a_loss_fn_that_reads_values_is_a_clear_error() -> None:
    def reading(model, batch):
        loss, _ = _loss_fn(model, batch)
        return loss / float(loss)

    with pytest.raises(ConfigError, match="meta device"):
        flops_per_batch(_model(), _batch(), loss_fn=reading)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rates_and_mfu_equal_counts_over_the_clock() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(3)
    sizes = [4, 6, 2, 8, 4, 4, 6, 2]
    batches = [(torch.randn(s, 8, generator=gen), torch.randint(0, 5, (s,))) for s in sizes]
    clock = FakeClock()
    speed = Throughput(samples_per_step=10, flops_per_step=1e6, peak_flops=1e8, clock=clock)
    sink = RecordingSink()
    events = Events()
    # The Log before the counter: read() counts the event itself, nothing is counted twice.
    events.on("step_end", Log(sink, sources=[speed.read]), every=2)
    speed.attach(events)
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 0.5))  # 0.5 s per update
    run(accumulate(make_train_step(_loss_fn), 2), state, batches, events=events)

    assert [r["step"] for r in sink.records] == [2, 4]
    # 2 updates in 1.0 s, except the first interval, which starts at fit_start: 2 in 0.5 s.
    first, second = sink.records
    assert first["steps_per_s"] == pytest.approx(4.0) and second["steps_per_s"] == pytest.approx(2)
    assert first["tokens_per_s"] == pytest.approx(sum(sizes[:4]) / 0.5)
    assert second["tokens_per_s"] == pytest.approx(sum(sizes[4:]) / 1.0)
    assert second["samples_per_s"] == pytest.approx(20.0)
    assert second["flops_per_s"] == pytest.approx(2e6)
    assert second["mfu"] == pytest.approx(0.02)
    assert speed.read(None) == {}  # nothing new since the last read


@pytest.mark.parametrize(("accumulation", "batches", "per_s"), [(1, 3, 500.0), (4, 8, 2000.0)])
def test_tokens_from_a_user_function(accumulation: int, batches: int, per_s: float) -> None:
    # tokens(out) reads out.aux, which is one micro-batch's: it was called on the update's
    # output alone, so with windows of 4 it counted 1 micro-batch of 4 (500/s, not 2000/s).
    clock = FakeClock()
    speed = Throughput(tokens=lambda out: out.aux["tokens"], clock=clock)
    model = torch.nn.Linear(8, 5)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(model, batch):
        loss, count = _loss_fn(model, batch)
        return loss, count, {"tokens": torch.tensor(1000.0)}

    events = speed.attach(Events())
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 2.0))
    step = accumulate(make_train_step(loss_fn), accumulation)
    run(step, state, [_batch(4)] * batches, events=events)
    assert speed.read(None) == {"steps_per_s": 0.5, "tokens_per_s": per_s}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"peak_flops": 1e12}, "needs flops_per_step"),
        ({"samples_per_step": 0}, "samples_per_step"),
        ({"flops_per_step": -1.0}, "flops_per_step"),
        ({"flops_per_step": 10, "peak_flops": 0}, "peak_flops"),
        ({"tokens": 5}, "tokens"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        Throughput(**kwargs)


@pytest.mark.parametrize(("accumulation", "unit"), [(1, None), (3, None), (3, "images")])
def test_a_mean_loss_rate_is_named_batches_not_tokens(accumulation: int, unit: str | None) -> None:
    from steplib import Events, TrainState, accumulate, make_train_step, run

    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    step = accumulate(make_train_step(lambda m, b: m(b).pow(2).mean()), accumulation)
    speed = Throughput(unit=unit)
    run(step, state, [torch.ones(4, 2)] * 6, events=speed.attach(Events()))
    stats = speed.read(None)
    assert f"{unit or 'batches'}_per_s" in stats and "tokens_per_s" not in stats


def test_a_run_of_several_steps_counts_each_steps_tokens_under_its_name() -> None:
    # D (counted) closes a window every 2 batches, G every batch, each micro-batch 4 targets.
    # The count was the last step's output at D's updates: one of G's micro-batches per 2.
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    state = TrainState.create(
        model={"G": g, "D": d},
        optimizer={"D": torch.optim.SGD(d.parameters(), lr=0.1),
                   "G": torch.optim.SGD(g.parameters(), lr=0.1)},
    )  # fmt: skip
    d_loss = lambda m, b: (m["D"](m["G"](b).detach()).pow(2).sum(), 4)  # noqa: E731
    g_loss = lambda m, b: (-m["D"](m["G"](b)).sum(), 4)  # noqa: E731
    steps = {
        "D": accumulate(make_train_step(d_loss, optimizer="D"), 2),
        "G": make_train_step(g_loss, optimizer="G"),
    }
    clock = FakeClock()
    speed = Throughput(clock=clock)
    events = speed.attach(Events())
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0))
    run(steps, state, [torch.randn(4, 2) for _ in range(8)], events=events)
    stats = speed.read(None)
    assert stats == {"steps_per_s": 1.0, "D/tokens_per_s": 8.0, "G/tokens_per_s": 8.0}


def _rates_on_ranks(rank: int, world: int, *, ddp: bool = True) -> list[dict[str, float]]:
    # Under DDP rank r's micro-batches hold 3 + 2r samples; its loss counts them, its aux too.
    # Without (tensor or pipeline parallel: every rank sees the batch), each holds 3.
    from steplib import ddp_wrap
    from steplib.distributed import apply_ddp

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(8, 5)
    model = apply_ddp(model) if ddp else model
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(model, batch):
        loss, count = _loss_fn(model, batch)
        return loss, count, {"samples": torch.tensor(float(count))}

    clocks = [FakeClock(), FakeClock()]
    speeds = [
        Throughput(clock=clocks[0]),
        Throughput(tokens=lambda o: o.aux["samples"], clock=clocks[1]),
    ]
    events = Events(*speeds)

    def tick(event: Any) -> None:
        for clock in clocks:
            clock.now += 1.0

    events.on("step_end", tick)
    step = accumulate(make_train_step(loss_fn), 2)
    step = ddp_wrap(step) if ddp else step
    run(step, state, [_batch(3 + 2 * rank if ddp else 3)] * 4, events=events)
    rates = [speed.read(None) for speed in speeds]
    del model, state, step
    return rates


def test_on_two_ranks_tokens_per_s_is_the_global_rate_whatever_counts_the_tokens() -> None:
    # The default counts each window's num_targets, summed over the ranks by the step; a
    # tokens= function counted this rank's micro-batches alone: 3 samples a batch where the
    # two ranks train on 8, so rank 0's log showed the rate of its share.
    from steplib.testing import run_ranks

    for default, counted in run_ranks(_rates_on_ranks):
        assert default == {"steps_per_s": 1.0, "tokens_per_s": 16.0}  # 2 updates of 2 x (3 + 5)
        assert counted == default
    # Ranks that each train on the whole batch (no DDP or FSDP2 model) share nothing out.
    for default, counted in run_ranks(functools.partial(_rates_on_ranks, ddp=False)):
        assert default == counted == {"steps_per_s": 1.0, "tokens_per_s": 6.0}


def _mean_loss_rates(rank: int, world: int) -> dict[str, float]:
    # No DDP or FSDP2 model: every rank trains on the whole batch, as tensor parallelism does.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    clock = FakeClock()
    speed = Throughput(clock=clock)
    events = speed.attach(Events())
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0))
    step = accumulate(make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1])), 2)
    run(step, state, [_batch(3)] * 4, events=events)
    return speed.read(None)


def test_ranks_that_each_see_the_whole_batch_name_a_mean_losss_rate_batches_per_s() -> None:
    # The micro-batches were counted once per rank (8 for 4), so the count of 4 looked like
    # tokens: tensor-parallel ranks logged tokens_per_s where one process logs batches_per_s.
    from steplib.testing import run_ranks

    for rates in run_ranks(_mean_loss_rates):
        assert rates == {"steps_per_s": 1.0, "batches_per_s": 2.0}  # as in one process


def _pipeline_mean_loss_rates(rank: int, world: int) -> dict[str, float]:
    from steplib.distributed.pipeline_split import split_model
    from steplib.step.pipeline import make_pipeline_step, pipeline_stage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    step = make_pipeline_step(
        lambda output, target: F.cross_entropy(output, target),  # a mean: 1 per micro-batch
        split_model(model, split_points=["2"]),
        n_microbatches=4,
    )
    module = pipeline_stage(step).module
    state = TrainState.create(model=module, optimizer=torch.optim.SGD(module.parameters()))
    clock = FakeClock()
    speed = Throughput(clock=clock)
    events = speed.attach(Events())
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0))
    run(step, state, [_batch(8)] * 3, events=events)
    return speed.read(None)


def test_a_pipeline_steps_mean_loss_rate_is_named_batches_per_s() -> None:
    # Its mean loss counts the 4 micro-batches of each batch, not 1: the count did not match
    # the loop's batches and the rate was named tokens_per_s (4.0 "tokens" a second).
    from steplib.testing import run_ranks

    for rates in run_ranks(_pipeline_mean_loss_rates):
        assert rates == {"steps_per_s": 1.0, "batches_per_s": 4.0}


def _gan_steps(d_window: int) -> tuple[TrainState, dict[str, Any]]:
    g, d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    state = TrainState.create(
        model={"G": g, "D": d},
        optimizer={"D": torch.optim.SGD(d.parameters(), lr=0.1),
                   "G": torch.optim.SGD(g.parameters(), lr=0.1)},
    )  # fmt: skip
    d_loss = lambda m, b: m["D"](m["G"](b[0]).detach()).pow(2).mean()  # noqa: E731
    g_loss = lambda m, b: -m["D"](m["G"](b[0])).mean()  # noqa: E731
    # G first in the run: the updates counted are still D's, the state's first optimizer's.
    steps = {
        "G": make_train_step(g_loss, optimizer="G"),
        "D": accumulate(make_train_step(d_loss, optimizer="D"), d_window),
    }
    return state, steps


@pytest.mark.parametrize("several", [False, True])
def test_samples_and_flops_per_s_count_an_epochs_shorter_last_window_as_what_it_ran(
    several: bool,
) -> None:
    # 10 batches of 8 samples an epoch, windows of 4: updates of 4, 4 and 2 batches. The
    # per-update constants counted the last window as a full one: 96 samples an epoch, not 80.
    batch, window, per_batch_flops = 8, 4, 1000
    batches = [_batch(batch) for _ in range(10)]
    step: Any
    if several:
        state, step = _gan_steps(window)
    else:
        model = torch.nn.Linear(8, 5)
        state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        step = accumulate(make_train_step(_loss_fn), window)
    clock = FakeClock()
    speed = Throughput(
        samples_per_step=batch * window, flops_per_step=per_batch_flops * window, clock=clock
    )
    sink = RecordingSink()
    events = speed.attach(Events())
    events.on("micro_step_end", lambda e: setattr(clock, "now", clock.now + 0.25))
    events.on("epoch_end", Log(sink, sources=[speed.read]))
    run(step, state, batches, events=events, max_epochs=2)

    # By hand, as a plain loop over the same batches counts them: each epoch's own samples
    # and micro-batches over its 10 * 0.25 s.
    seconds = 0.25 * len(batches)
    samples = sum(len(x) for x, _ in batches)
    assert [r["step"] for r in sink.records] == [3, 6]
    for record in sink.records:
        assert record["steps_per_s"] == pytest.approx(3 / seconds)
        assert record["samples_per_s"] == pytest.approx(samples / seconds)
        assert record["flops_per_s"] == pytest.approx(per_batch_flops * len(batches) / seconds)


class _KilledError(Exception):
    pass


def _timed_run(directory: Path, *, kill_at: int | None = None) -> list[dict[str, Any]]:
    """10 updates of 1 s each on a fake clock, saved every 4 and resumed from ``directory``,
    the rates logged every 2; a ``fit_start`` handler registered after ``Throughput`` takes
    60 s (as an Evaluator's sanity evaluation, or a ``resume_from`` registered by hand with
    ``events.on``, does); killed after ``kill_at``."""
    clock = FakeClock()
    speed = Throughput(samples_per_step=4, clock=clock)
    ckpt = checkpoint_every(str(directory), every=4)
    sink = RecordingSink()
    events = Events(speed, resume_from(ckpt), Log(sink, sources=[speed.read], every=2), ckpt)
    events.on("fit_start", lambda e: setattr(clock, "now", clock.now + 60.0))
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0), first=True)

    def kill(event: Any) -> None:
        if event.step == kill_at:
            raise _KilledError

    events.on("step_end", kill, last=True)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = resumable_loader(torch.ones(10, 2), batch_size=1)
    run(make_train_step(lambda m, b: m(b).pow(2).mean()), state, data, events=events, max_steps=10)
    return sink.records


def test_a_resumed_runs_first_rate_leaves_out_the_other_fit_start_handlers(
    tmp_path: Path,
) -> None:
    # The clock started at Throughput's own fit_start, before the handlers registered after
    # it: the first interval of every run, a resumed one's too, held their 60 s, and read 2
    # updates in 62 s (0.03/s, 0.13 samples/s) for the 1.0/s of every other interval.
    want = _timed_run(tmp_path / "uninterrupted")
    with pytest.raises(_KilledError):
        _timed_run(tmp_path / "resumed", kill_at=6)
    got = _timed_run(tmp_path / "resumed")
    assert [r["step"] for r in got] == [6, 8, 10]
    for record in (*want, *got):
        assert record["steps_per_s"] == pytest.approx(1.0)
        assert record["samples_per_s"] == pytest.approx(4.0)

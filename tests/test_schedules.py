"""LR schedules (values, shape, use with ``LambdaLR`` and ``run``) and ``accumulation_steps``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from steplib import (
    ConfigError,
    Events,
    TrainState,
    accumulate,
    make_train_step,
    run,
    warmup_cosine,
    warmup_linear,
)
from steplib.schedules import accumulation_steps, warmup_constant

# --- values at key points ---------------------------------------------------------------------


def test_warmup_constant_ramps_linearly_then_stays_at_one():
    f = warmup_constant(warmup=4)
    # The first update (step 0) already uses 1/warmup of the base LR, not zero.
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert f(10_000) == 1.0


def test_warmup_constant_without_warmup_is_constant_one():
    f = warmup_constant(warmup=0)
    assert [f(s) for s in (0, 1, 100)] == [1.0, 1.0, 1.0]


def test_warmup_linear_values_at_key_points():
    f = warmup_linear(warmup=2, total=10)
    assert f(0) == 0.5  # first update
    assert f(1) == 1.0  # end of warmup
    assert f(2) == 1.0  # start of decay
    assert f(6) == pytest.approx(0.5)  # middle of the decay
    assert f(8) == pytest.approx(0.25)  # linear, not cosine
    assert f(10) == 0.0  # total
    assert f(25) == 0.0  # beyond total: constant


def test_warmup_linear_decays_to_min_ratio():
    f = warmup_linear(warmup=2, total=10, min_ratio=0.1)
    assert f(6) == pytest.approx(0.55)
    assert f(10) == pytest.approx(0.1)
    assert f(99) == pytest.approx(0.1)


def test_warmup_cosine_values_at_key_points():
    f = warmup_cosine(warmup=2, total=10)
    assert f(0) == 0.5
    assert f(1) == 1.0
    assert f(2) == 1.0
    assert f(4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.854, not linear 0.75
    assert f(6) == pytest.approx(0.5)
    assert f(10) == pytest.approx(0.0, abs=1e-15)
    assert f(25) == pytest.approx(0.0, abs=1e-15)


def test_warmup_cosine_decays_to_min_ratio():
    f = warmup_cosine(warmup=0, total=10, min_ratio=0.2)
    assert f(0) == 1.0  # no warmup: the first update uses the base LR
    assert f(5) == pytest.approx(0.6)
    assert f(10) == pytest.approx(0.2)
    assert f(11) == pytest.approx(0.2)


@pytest.mark.parametrize("build", [warmup_linear, warmup_cosine])
def test_decaying_schedules_rise_during_warmup_and_never_rise_after(build):
    f = build(warmup=5, total=40, min_ratio=0.1)
    values = [f(s) for s in range(60)]
    warm, decay = values[:5], values[5:]
    assert all(a < b for a, b in itertools.pairwise(warm))
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert decay[0] == 1.0
    assert decay[-1] == pytest.approx(0.1)


@given(
    warmup=st.integers(0, 50),
    span=st.integers(1, 500),
    min_ratio=st.floats(0.0, 1.0),
    step=st.integers(0, 2000),
)
def test_cosine_stays_within_min_ratio_and_one_after_warmup(warmup, span, min_ratio, step):
    f = warmup_cosine(warmup=warmup, total=warmup + span, min_ratio=min_ratio)
    value = f(step)
    assert 0.0 < value <= 1.0 or (value == 0.0 and min_ratio == 0.0)
    if step >= warmup:
        assert min_ratio <= value <= 1.0
    else:
        assert value == (step + 1) / warmup


@given(warmup=st.integers(0, 30), span=st.integers(1, 200), min_ratio=st.floats(0.0, 1.0))
def test_linear_never_rises_after_warmup(warmup, span, min_ratio):
    f = warmup_linear(warmup=warmup, total=warmup + span, min_ratio=min_ratio)
    values = [f(s) for s in range(warmup, warmup + span + 3)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert values[-1] == pytest.approx(min_ratio)


# --- with LambdaLR and run --------------------------------------------------------------------


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def test_lr_follows_the_schedule_once_per_update_not_per_micro_batch():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = warmup_cosine(warmup=2, total=8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    update_lrs: list[float] = []
    micro_lrs: list[tuple[int, float]] = []
    events = Events()
    events.on("step_end", lambda e: update_lrs.append(float(e.output.lr)))
    events.on("micro_step_end", lambda e: micro_lrs.append((e.step, float(e.output.lr))))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(40)]
    state = run(accumulate(make_train_step(_mse), 4), state, data, events=events, max_steps=8)

    assert (state.step, state.micro_step) == (8, 32)
    assert sched.last_epoch == 8  # 8 updates, 32 micro-batches
    expected = [0.5 * schedule(s) for s in range(8)]
    assert update_lrs == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # Every micro-batch of window n reports the LR that window's update used.
    for index, (_, lr) in enumerate(micro_lrs):
        assert lr == pytest.approx(expected[index // 4], rel=1e-6, abs=1e-9)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * schedule(8))


# --- accumulation_steps -----------------------------------------------------------------------


def test_accumulation_steps_divides_the_token_budget():
    assert accumulation_steps(tokens_per_update=65536, batch_size=16, seq_len=1024) == 4
    assert accumulation_steps(tokens_per_update=16384, batch_size=16, seq_len=1024) == 1
    assert accumulation_steps(tokens_per_update=480, batch_size=3, seq_len=10) == 16


def test_accumulation_steps_refuses_a_budget_that_does_not_divide_and_gives_nearest_ones():
    with pytest.raises(ConfigError) as info:
        accumulation_steps(tokens_per_update=100_000, batch_size=16, seq_len=1024)
    message = str(info.value)
    assert "tokens_per_update=100000 is not a multiple" in message
    assert "16 * 1024 = 16384" in message
    # 6 * 16384 = 98304 < 100000 < 114688 = 7 * 16384
    assert "tokens_per_update=98304 or 114688" in message


def test_accumulation_steps_below_one_micro_batch_suggests_one_micro_batch():
    with pytest.raises(ConfigError) as info:
        accumulation_steps(tokens_per_update=1000, batch_size=16, seq_len=1024)
    assert "tokens_per_update=16384" in str(info.value)


@pytest.mark.parametrize("label", ["tokens_per_update", "batch_size", "seq_len"])
@pytest.mark.parametrize("value", [0, -4, 2.0, True, "16"])
def test_accumulation_steps_refuses_non_positive_ints(label, value):
    args = {"tokens_per_update": 65536, "batch_size": 16, "seq_len": 1024, label: value}
    with pytest.raises(ConfigError) as info:
        accumulation_steps(**args)
    message = str(info.value)
    assert f"accumulation_steps({label}=...) received {value!r}" in message
    assert "int >= 1" in message


# --- bad schedule arguments -------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 2.0, True, "4", None])
def test_warmup_constant_refuses_a_bad_warmup(value):
    with pytest.raises(ConfigError) as info:
        warmup_constant(warmup=value)
    assert f"warmup_constant(warmup=...) received {value!r}" in str(info.value)
    assert "int >= 0" in str(info.value)


@pytest.mark.parametrize("build", [warmup_linear, warmup_cosine])
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"warmup": -1, "total": 10}, "(warmup=...) received -1"),
        ({"warmup": 0, "total": 0}, "(total=...) received 0"),
        ({"warmup": 0, "total": 10.0}, "(total=...) received 10.0"),
        ({"warmup": 0, "total": True}, "(total=...) received True"),
    ],
)
def test_decaying_schedules_refuse_bad_counts(build, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        build(**kwargs)
    assert f"{build.__name__}{fragment}" in str(info.value)


@pytest.mark.parametrize("build", [warmup_linear, warmup_cosine])
def test_decaying_schedules_refuse_warmup_not_below_total(build):
    with pytest.raises(ConfigError) as info:
        build(warmup=100, total=100)
    message = str(info.value)
    assert "warmup=100 >= total=100" in message
    assert "needs updates after the warmup" in message
    assert "e.g. warmup=10" in message


@pytest.mark.parametrize("build", [warmup_linear, warmup_cosine])
@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan, "0.1", True])
def test_decaying_schedules_refuse_a_min_ratio_outside_zero_one(build, ratio):
    with pytest.raises(ConfigError) as info:
        build(warmup=1, total=10, min_ratio=ratio)
    message = str(info.value)
    assert f"min_ratio received {ratio!r}" in message
    assert "in [0, 1]" in message

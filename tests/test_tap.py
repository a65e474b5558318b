"""tap: hooks called at the phase boundaries, in order, and not at all when absent."""

from __future__ import annotations

import pytest
import torch

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    amp_wrap,
    make_train_step,
    skip_nonfinite,
    tap,
)
from steplib.step import HOOK_POINTS as HOOK_NAMES
from tests.reference import make_batches, params_of, tiny_model, token_loss


def _state() -> TrainState:
    model = tiny_model(0)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_hooks_fire_in_phase_order_also_around_a_skipped_update() -> None:
    calls: list[tuple[str, int, int]] = []

    def record(name):
        return lambda state: calls.append((name, state.step, state.micro_step))

    step = tap(
        skip_nonfinite(accumulate(make_train_step(token_loss), 2)),
        **{name: record(name) for name in HOOK_NAMES},
    )
    batches = make_batches(4)
    x, y, m = batches[3]
    batches[3] = (x * float("nan"), y, m)  # the second window is non-finite: skipped
    state = _state()
    for batch in batches:
        state, _ = step(state, batch)
    window = [("before_backward", 0, 0), ("after_backward", 0, 0)]
    assert calls == [
        *window,
        ("before_backward", 0, 1),
        ("after_backward", 0, 1),
        ("before_update", 0, 2),
        ("after_update", 0, 2),
        ("after_zero_grad", 0, 2),
        ("before_backward", 1, 2),
        ("after_backward", 1, 2),
        ("before_backward", 1, 3),
        ("after_backward", 1, 3),
        ("before_update", 1, 4),  # a skipped update: the same points (issue 26)
        ("after_update", 1, 4),
        ("after_zero_grad", 1, 4),
    ]


def test_before_update_sees_the_final_gradients_and_after_update_the_new_parameters() -> None:
    seen = {}

    def before(state):
        seen["grads"] = [p.grad.clone() for p in state.model.parameters()]
        seen["before"] = params_of(state.model)

    step = tap(make_train_step(token_loss), before_update=before)
    state = _state()
    state, _ = step(state, make_batches(1)[0])
    for g, old, new in zip(seen["grads"], seen["before"], state.model.parameters(), strict=True):
        torch.testing.assert_close(new, old - 0.1 * g)  # SGD: exactly what the hook saw


def test_after_backward_sees_the_scaled_sum_and_before_update_the_unscaled_mean() -> None:
    # What each point sees under a float16 GradScaler with accumulation (the docstring says it):
    # after_backward the window's gradients so far, summed and still times the loss scale;
    # before_update the final ones, unscaled and divided by the window's targets.
    seen: dict[str, list[torch.Tensor]] = {"after_backward": [], "before_update": []}

    def grab(point):
        return lambda state: seen[point].append(state.model[0].bias.grad.clone())

    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    step = make_train_step(token_loss)
    step = tap(accumulate(amp_wrap(step, dtype=torch.float16), 2), **{p: grab(p) for p in seen})
    batches = make_batches(2)
    for batch in batches:
        state, _ = step(state, batch)
    targets = sum(int(m.sum()) for _, _, m in batches)
    summed, final = seen["after_backward"][-1], seen["before_update"][0]
    torch.testing.assert_close(summed, final * 2.0**8 * targets)


def test_a_step_without_tap_carries_no_hooks() -> None:
    assert make_train_step(token_loss).plan.hooks == {}


@pytest.mark.parametrize(
    ("hooks", "message"),
    [
        ({}, "received no hook"),
        ({"before_step": print}, "unknown hook name(s) ['before_step']"),
        ({"after_update": 3}, "is not callable"),
    ],
)
def test_bad_hooks_are_refused_at_build_time(hooks, message) -> None:
    with pytest.raises(ConfigError) as err:
        tap(make_train_step(token_loss), **hooks)
    assert message in str(err.value)


def test_out_lr_is_the_rate_the_update_used_when_a_hook_sets_it() -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt)

    def set_lr(state: TrainState) -> None:
        for group in state.optimizer.param_groups:
            group["lr"] = 0.01 * (state.step + 1)

    step = tap(make_train_step(token_loss), before_update=set_lr)
    for n, batch in enumerate(make_batches(3, [2, 3, 4])):
        state, out = step(state, batch)
        assert out.lr.item() == pytest.approx(0.01 * (n + 1))

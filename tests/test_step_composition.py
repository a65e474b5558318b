"""Composition that users share: ``clip`` and ``skip_nonfinite`` rebuilt here, outside steplib,
with only its public API (``Part``, ``add_part``, ``Gradients``, the ranks), give parameters
bit-identical to the built-ins in every order of the wrappers; the core runs the parts in the
fixed phase order whatever order they were added in; one declared rule refuses what cannot be
right, with the fix."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from steplib import (
    ConfigError,
    Step,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compile_step,
    make_train_step,
    skip_nonfinite,
)
from steplib.step import CLIP, FINITE, NORMALISE, TRANSFORM, UNSCALE, Gradients, Part, add_part
from tests.reference import make_batches, tiny_model, token_loss

# --- the two wrappers, as a user writes them -------------------------------------------------


def my_clip(step: Step, *, max_norm: float) -> Step:
    def clip_by_norm(grads: Gradients) -> None:
        grads.grad_norm = norm = grads.norm(2.0)
        grads.scale_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))  # clip_grad_norm_'s formula

    part = Part(
        name="my_clip", settings={"max_norm": max_norm}, grad_transform=clip_by_norm, order=CLIP
    )
    return add_part(step, part)


def my_skip(step: Step, *, max_consecutive: int) -> Step:
    def check_finite(grads: Gradients) -> None:
        if grads.grad_norm is None:
            grads.grad_norm = grads.norm()
        grads.flag_nonfinite(~torch.isfinite(grads.grad_norm) | ~torch.isfinite(grads.loss_sum))

    part = Part(
        name="my_skip",
        grad_transform=check_finite,
        order=FINITE,
        max_consecutive_skips=max_consecutive,
    )
    return add_part(step, part)


# --- runs ------------------------------------------------------------------------------------

LENGTHS = [3, 1, 4, 1, 5, 2, 6, 5, 3, 2]
POISONED = 4  # this micro-batch's loss is inf: its window's update must be skipped


def _batches() -> list[Any]:
    batches = make_batches(len(LENGTHS), LENGTHS, seed=3)
    x, y, mask = batches[POISONED]
    batches[POISONED] = (x * float("inf"), y, mask)
    return batches


def _train(wrappers: tuple[Callable[[Step], Step], ...]) -> tuple[list[torch.Tensor], Any]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    step = make_train_step(token_loss)
    for wrap in wrappers:
        step = wrap(step)
    outputs = []
    for batch in _batches():
        state, out = step(state, batch)
        outputs.append((out.grad_norm, bool(out.did_update), bool(out.skipped)))
    return [p.detach().clone() for p in model.parameters()], (outputs, state.skipped_updates)


BUILT_IN = {
    "clip": lambda s: clip(s, max_norm=0.3),
    "skip": lambda s: skip_nonfinite(s, max_consecutive=3),
}
MINE = {
    "clip": lambda s: my_clip(s, max_norm=0.3),
    "skip": lambda s: my_skip(s, max_consecutive=3),
}
OTHERS = {
    "accumulate": lambda s: accumulate(s, 2),
    "amp": lambda s: amp_wrap(s, dtype=torch.float16),
}


def _same(a: Any, b: Any) -> None:
    (params_a, (outs_a, skips_a)), (params_b, (outs_b, skips_b)) = a, b
    for got, want in zip(params_a, params_b, strict=True):
        assert torch.equal(got, want)
    assert skips_a == skips_b == 1
    for (norm_a, *flags_a), (norm_b, *flags_b) in zip(outs_a, outs_b, strict=True):
        assert flags_a == flags_b
        assert (norm_a is None) == (norm_b is None)
        if norm_a is not None:
            assert torch.equal(norm_a, norm_b) or (norm_a.isnan() and norm_b.isnan())


def test_clip_and_skip_rebuilt_with_the_public_api_equal_the_built_ins_in_every_order() -> None:
    names = ["clip", "skip", "accumulate", "amp"]
    want = _train(tuple({**OTHERS, **BUILT_IN}[n] for n in names))
    for order in itertools.permutations(names):
        mine = _train(tuple({**OTHERS, **MINE}[n] for n in order))
        _same(mine, want)
        built_in = _train(tuple({**OTHERS, **BUILT_IN}[n] for n in order))
        _same(built_in, want)


def test_the_core_runs_gradient_transforms_in_order_whatever_the_order_of_application() -> None:
    seen: list[str] = []

    def recorder(name: str, order: float) -> Callable[[Step], Step]:
        def transform(grads: Gradients) -> None:
            seen.append(name)

        return lambda s: add_part(s, Part(name=name, grad_transform=transform, order=order))

    wrappers = [
        recorder("after unscale", UNSCALE + 1),
        recorder("before normalise", NORMALISE - 1),
        recorder("mine", TRANSFORM),
        recorder("after finite", FINITE + 1),
    ]
    for order in itertools.permutations(wrappers):
        seen.clear()
        _train(tuple(order))
        update = seen[:4]
        assert update == ["after unscale", "before normalise", "mine", "after finite"]


def test_contexts_nest_in_the_order_applied_and_the_forward_context_is_inside() -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def named(name: str) -> Iterator[None]:
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    def loss(model: torch.nn.Module, batch: Any) -> Any:
        events.append("loss_fn")
        return token_loss(model, batch)

    step = make_train_step(loss)
    step = add_part(step, Part(name="a", micro_context=lambda state, sync: named("a")))
    step = add_part(step, Part(name="f", forward_context=lambda state: named("f")))
    step = add_part(step, Part(name="b", micro_context=lambda state, sync: named("b")))
    step = add_part(
        step, Part(name="h", hooks={"before_backward": lambda s: events.append("backward")})
    )
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step(state, make_batches(1, [3])[0])
    assert events == [
        "enter a",
        "enter b",
        "enter f",
        "loss_fn",
        "exit f",
        "backward",
        "exit b",
        "exit a",
    ]


def test_update_parts_run_around_the_optimizer_update_in_the_order_applied() -> None:
    events: list[str] = []

    def around(name: str) -> Callable[[TrainState, Callable[[], None]], None]:
        def update(state: TrainState, apply: Callable[[], None]) -> None:
            events.append(f"before {name}")
            apply()
            events.append(f"after {name} at step {state.step}")

        return update

    step = make_train_step(token_loss)
    for name in ("outer", "inner"):
        step = add_part(step, Part(name=name, update=around(name)))
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    step(state, make_batches(1, [3])[0])
    assert events == [
        "before outer",
        "before inner",
        "after inner at step 0",
        "after outer at step 0",
    ]
    assert not torch.equal(before[0], next(model.parameters()))


def test_one_declared_rule_refuses_what_cannot_be_right_with_the_fix() -> None:
    base = make_train_step(token_loss)
    with pytest.raises(ConfigError, match="applied twice"):
        my_clip(my_clip(base, max_norm=1.0), max_norm=2.0)
    with pytest.raises(ConfigError, match=r"Apply compile_step last: compile_step\(my_clip"):
        my_clip(compile_step(base), max_norm=1.0)
    with pytest.raises(ConfigError, match="expects a Step"):
        my_clip(token_loss, max_norm=1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not callable"):
        Part(name="bad", grad_transform=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown point"):
        Part(name="bad", hooks={"before_forward": print})
    with pytest.raises(ConfigError, match="build one with"):
        add_part(base, "clip")  # type: ignore[arg-type]

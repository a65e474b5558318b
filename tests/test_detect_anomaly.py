"""detect_anomaly: a NaN made in backward raises with the forward traceback naming the op;
training that does not fail is bit-equal to the step without it; the wrapped gradient sync
keeps doing its job; anomaly mode is off after the step; bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import pytest
import torch

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    clip,
    compile_step,
    make_train_step,
)
from steplib.step import GradSync, Part, add_part
from steplib.step.anomaly import AnomalyError, detect_anomaly
from tests.reference import make_batches, tiny_model, token_loss


def _state(model: torch.nn.Module) -> TrainState:
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _root_of_output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    # sqrt of a negative output is NaN but masked out: the loss is finite, its gradient is not
    root = torch.sqrt(out)
    return torch.where(out > 0, root, torch.zeros_like(out)).sum()


def _negative_model() -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(-1.0)
        model.bias.fill_(0.0)
    return model


def test_a_nan_made_in_backward_raises_with_the_forward_op_in_the_message() -> None:
    model = _negative_model()
    step = detect_anomaly(make_train_step(_root_of_output))
    with pytest.raises(AnomalyError) as info:
        step(_state(model), torch.ones(3, 2))
    message = str(info.value)
    assert "SqrtBackward0" in message and "returned nan values" in message
    assert "in _root_of_output" in message and "torch.sqrt(out)" in message  # the forward line
    assert isinstance(info.value, RuntimeError)
    assert "returned nan values" in str(info.value.__cause__)  # torch's own error, kept
    assert not torch.is_anomaly_enabled()  # the mode is off again after a failure

    # Without the wrapper the same step silently writes NaN into the parameters.
    plain = make_train_step(_root_of_output)
    plain(_state(model), torch.ones(3, 2))
    assert torch.isnan(model.weight).all()


def test_check_nan_false_lets_the_nan_through() -> None:
    model = _negative_model()
    detect_anomaly(make_train_step(_root_of_output), check_nan=False)(
        _state(model), torch.ones(3, 2)
    )
    assert torch.isnan(model.weight).all()


def test_other_backward_errors_get_the_forward_traceback_too() -> None:
    def in_place_after_use(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.sigmoid(model(x))
        loss = hidden.sum() * 1.0
        hidden.mul_(2)  # sigmoid's backward needs its output: modified in place
        return loss

    step = detect_anomaly(make_train_step(in_place_after_use), check_nan=False)
    with pytest.raises(AnomalyError, match="modified by an inplace operation") as info:
        step(_state(torch.nn.Linear(2, 1)), torch.ones(3, 2))
    assert "SigmoidBackward0" in str(info.value) and "torch.sigmoid(model(x))" in str(info.value)


def test_an_error_in_the_forward_pass_is_not_rewrapped() -> None:
    def broken(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bad batch")

    with pytest.raises(RuntimeError, match=r"^bad batch$") as info:
        detect_anomaly(make_train_step(broken))(_state(torch.nn.Linear(2, 1)), torch.ones(1, 2))
    assert not isinstance(info.value, AnomalyError)


def test_training_under_anomaly_mode_is_bit_equal_to_the_plain_step() -> None:
    results = []
    for wrap in (lambda s: s, detect_anomaly):
        model = tiny_model(0)
        state = _state(model)
        step = wrap(clip(accumulate(make_train_step(token_loss), 2), max_norm=0.5))
        losses = []
        for batch in make_batches(6, [1, 4, 3, 2, 5, 2], seed=3):
            state, out = step(state, batch)
            losses.append(out.loss)
        results.append(([p.detach().clone() for p in model.parameters()], losses, state.step))
    (params_a, losses_a, steps_a), (params_b, losses_b, steps_b) = results
    assert steps_a == steps_b == 3
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))


def test_user_warnings_inside_the_step_still_reach_the_caller() -> None:
    def warns(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("from the loss", UserWarning, stacklevel=1)
        return model(x).sum()

    with pytest.warns(UserWarning, match="from the loss"):
        detect_anomaly(make_train_step(warns))(_state(torch.nn.Linear(2, 1)), torch.ones(1, 2))


@dataclasses.dataclass
class _RecordingSync(GradSync):
    """A stand-in for a distributed sync: records what the step asks of it."""

    calls: list[Any] = dataclasses.field(default_factory=list)

    def micro_context(self, state: TrainState, sync: bool) -> Any:
        @contextlib.contextmanager
        def inside() -> Any:
            self.calls.append(("enter", sync, torch.is_anomaly_enabled()))
            yield
            self.calls.append(("exit", sync))

        return inside()

    def reduce_window(self, state: TrainState, loss_sum: torch.Tensor, targets: Any) -> Any:
        self.calls.append("reduce")
        return loss_sum, targets, 1

    def sync_unsynced(self, state: TrainState) -> None:
        self.calls.append("sync_unsynced")

    def describe(self) -> dict[str, Any]:
        return {"recording": True}


def test_the_distributed_part_still_runs_around_anomaly_mode() -> None:
    inner = _RecordingSync()
    # What ddp_wrap contributes, recorded: a micro-batch context and a gradient sync.
    recording = Part(name="recording", micro_context=inner.micro_context, sync=inner)
    base = add_part(accumulate(make_train_step(token_loss), 3), recording)
    step = detect_anomaly(base)
    assert step.plan.sync is inner
    state = _state(tiny_model(0))
    batches = make_batches(2, [2, 3], seed=1)
    for batch in batches:
        state, _ = step(state, batch)
    state, out = step.flush(state)
    assert out is not None and bool(out.did_update)
    # The distributed context is entered first (DDP's no_sync must hold for forward and
    # backward), anomaly mode is turned on inside it.
    assert inner.calls == [
        ("enter", False, False),
        ("exit", False),
        ("enter", False, False),
        ("exit", False),
        "sync_unsynced",
        "reduce",
    ]
    assert step.describe()[-1] == {"wrapper": "detect_anomaly", "check_nan": True}


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="check_nan"):
        detect_anomaly(make_train_step(token_loss), check_nan="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expects a Step"):
        detect_anomaly(token_loss)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="applied twice"):
        detect_anomaly(detect_anomaly(make_train_step(token_loss)))
    with pytest.raises(ConfigError, match="after compile_step"):
        detect_anomaly(compile_step(make_train_step(token_loss)))


def _ddp_with_and_without_anomaly(rank: int, world: int) -> list[list[torch.Tensor]]:
    from steplib import ddp_wrap
    from steplib.distributed import apply_ddp

    finals = []
    builds = (
        lambda s: ddp_wrap(s),
        lambda s: detect_anomaly(ddp_wrap(s)),
        # the other order composes too: both are micro-batch contexts (no_sync outermost)
        lambda s: ddp_wrap(detect_anomaly(s)),
    )
    for build in builds:
        model = apply_ddp(tiny_model(0))
        state = _state(model)
        step = build(accumulate(make_train_step(token_loss), 2))
        for batch in make_batches(4, [2, 3, 1, 4], seed=10 + rank):
            state, _ = step(state, batch)
        finals.append([p.detach().clone() for p in model.parameters()])
        del model, state, step
    return finals


def test_with_ddp_wrap_in_either_order_two_ranks_stay_in_sync_and_bit_equal_to_plain_ddp() -> None:
    from steplib.testing import run_ranks

    (plain0, anomaly0, first0), (plain1, anomaly1, first1) = run_ranks(
        _ddp_with_and_without_anomaly
    )
    for a, b, c, d, e, f in zip(plain0, anomaly0, plain1, anomaly1, first0, first1, strict=True):
        assert torch.equal(a, b) and torch.equal(c, d)  # anomaly mode changes no number
        assert torch.equal(b, d)  # the ranks' gradients were averaged: same parameters
        assert torch.equal(a, e) and torch.equal(c, f)  # in either order of the wrappers

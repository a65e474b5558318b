"""``amp_wrap(dtype=torch.float16, min_loss_scale=...)``: the error comes in the update whose
backoff takes the scale below the minimum (not before), without a host sync, and a run that
stays above it is bit-identical to one without the setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steplib import ConfigError, TrainState, amp_wrap, make_train_step
from steplib.errors import TooManySkipsError
from steplib.step import amp as amp_module
from steplib.step.device_skips import HostCopy
from steplib.testing import assert_no_host_sync
from tests.reference import make_batches, mean_loss, tiny_model


def _state(*, fused: bool = False, init_scale: float = 16.0) -> TrainState:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    return TrainState.create(model=model, optimizer=opt, scaler=scaler)


def _overflowing(n: int) -> list:
    """Batches whose every update overflows: the scaler halves the scale each time."""
    return [(x * float("inf"), y, mask) for x, y, mask in make_batches(n)]


def _updates_until_error(step, state: TrainState, batches: list) -> tuple[int, str]:
    done = 0
    with pytest.raises(TooManySkipsError) as info:
        for batch in batches:
            state, _ = step(state, batch)
            done += 1
    return done, str(info.value)


@pytest.mark.parametrize("fused", [False, True], ids=["host-decided", "device-decided"])
def test_the_error_comes_in_the_update_that_takes_the_scale_below_the_minimum(fused):
    state = _state(fused=fused)
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16, min_loss_scale=1.0)
    # 16 -> 8, 4, 2, 1 (not below 1.0), then 0.5 in the fifth update.
    done, message = _updates_until_error(step, state, _overflowing(8))
    assert done == 4
    assert state.scaler.get_scale() == 0.5  # type: ignore[union-attr]
    assert "loss scale fell to 0.5 at step 5, below min_loss_scale=1" in message
    assert "Lower the learning rate" in message and "bfloat16" in message


def test_the_check_reads_no_tensor_on_the_host_when_the_skip_stays_on_the_device():
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16, min_loss_scale=1.0)
    state = assert_no_host_sync(step, _state(fused=True), _overflowing(4))  # 16 -> 1: no error
    assert state.scaler.get_scale() == 1.0
    with pytest.raises(TooManySkipsError, match=r"fell to 0\.5 at step 5"):
        assert_no_host_sync(step, state, _overflowing(1))


class _LandsAtTheNextUpdate(HostCopy):
    """A host copy that is in flight until it is asked a second time, as a CUDA copy is when
    the host runs one update ahead of the GPU."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor.clone())  # a snapshot: on the CPU the "copy" is the tensor
        self.asked = 0

    def ready(self) -> bool:
        self.asked += 1
        return self.asked > 1


def test_a_copy_in_flight_is_read_one_update_later_and_names_its_own_step(monkeypatch):
    monkeypatch.setattr(amp_module, "HostCopy", _LandsAtTheNextUpdate)
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16, min_loss_scale=1.0)
    done, message = _updates_until_error(step, _state(), _overflowing(8))
    assert done == 5  # the scale was read one update late
    assert "fell to 0.5 at step 5" in message  # the update that took it below


def test_a_run_above_the_minimum_is_bit_identical_to_one_without():
    batches = make_batches(10)
    batches[3] = _overflowing(1)[0]  # one skipped update, the scale backs off once
    runs = []
    for setting in ({}, {"min_loss_scale": 1.0}):
        state = _state(init_scale=4.0)
        step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16, **setting)
        losses = []
        for batch in batches:
            state, out = step(state, batch)
            losses.append(out.loss)
        runs.append((list(state.model.parameters()), losses, state.scaler.get_scale()))  # type: ignore[union-attr]
    (params_a, losses_a, scale_a), (params_b, losses_b, scale_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    torch.testing.assert_close(losses_a, losses_b, rtol=0, atol=0, equal_nan=True)
    assert scale_a == scale_b == 16.0  # 4, 8 after 3 updates, 4 at the skip, 8, 16


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"dtype": torch.bfloat16, "min_loss_scale": 1.0}, "needs dtype=torch.float16"),
        ({"dtype": torch.float16, "min_loss_scale": 0.0}, "received 0.0"),
        ({"dtype": torch.float16, "min_loss_scale": -1}, "received -1"),
        ({"dtype": torch.float16, "min_loss_scale": float("inf")}, "received inf"),
        ({"dtype": torch.float16, "min_loss_scale": True}, "received True"),
        ({"dtype": torch.float16, "min_loss_scale": "1e-4"}, "received '1e-4'"),
    ],
)
def test_a_bad_min_loss_scale_is_refused_when_the_step_is_built(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        amp_wrap(make_train_step(mean_loss), **kwargs)
    assert fragment in str(info.value)
    assert "amp_wrap(step, dtype=torch.float16, min_loss_scale=1e-4)" in str(info.value)


def test_with_several_optimizers_each_step_watches_its_own_scaler():
    torch.manual_seed(0)
    nets = {"a": nn.Linear(8, 3), "b": nn.Linear(8, 3)}
    scalers = {name: torch.amp.GradScaler("cpu", init_scale=16.0) for name in nets}
    state = TrainState.create(
        model=nets,
        optimizer={name: torch.optim.SGD(net.parameters(), lr=0.1) for name, net in nets.items()},
        scaler=scalers,
    )

    def loss_of(name: str):
        return lambda model, batch: mean_loss(
            torch.nn.Sequential(model[name], nn.Flatten(0)), batch
        )

    def fp16(name: str):
        step = make_train_step(loss_of(name), optimizer=name)
        return amp_wrap(step, dtype=torch.float16, min_loss_scale=1.0)

    step_a, step_b = fp16("a"), fp16("b")
    healthy, overflowing = make_batches(8, seed=2), _overflowing(8)
    with pytest.raises(TooManySkipsError, match=r"fell to 0\.5 at step 5,"):
        for good, bad in zip(healthy, overflowing, strict=True):
            state, _ = step_a(state, good)
            state, _ = step_b(state, bad)
    assert state["b"].step == 4 and state["a"].step == 5  # b raised in its fifth update
    assert scalers["a"].get_scale() == 16.0 and scalers["b"].get_scale() == 0.5


def test_a_minimum_above_the_initial_scale_is_a_setting_error_not_divergence():
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16, min_loss_scale=1e5)
    with pytest.raises(ConfigError) as info:
        step(_state(init_scale=2.0**16), make_batches(1)[0])
    message = str(info.value)
    assert "min_loss_scale=100000" in message and "initial scale (65536)" in message
    assert "GradScaler(init_scale=" in message and "diverged" not in message

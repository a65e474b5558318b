"""A sweep refuses, when it is built, what vmap cannot run or what would be wrong in silence:
the message names the operation, where it is, and the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.errors import EmptyWindowError
from steplib.schedules import AbsoluteLR
from steplib.sweep import Copies, SweepAdamW, SweepSGD, sweep_step
from steplib.testing import assert_no_host_sync
from tests.reference import make_batches, mean_loss, tiny_model, token_loss

BATCH = make_batches(1)[0]


def build(loss_fn: Any, copies: Copies | None = None) -> Any:
    copies = copies or Copies.stack([tiny_model(i) for i in range(3)])
    return sweep_step(sl.make_train_step(loss_fn), copies=copies, example_batch=BATCH)


def loss_with_item(model: nn.Module, batch: Any) -> torch.Tensor:
    loss = mean_loss(model, batch)
    scale = 2.0 if loss.item() > 1.0 else 1.0
    return loss * scale


def loss_with_branch(model: nn.Module, batch: Any) -> torch.Tensor:
    loss = mean_loss(model, batch)
    if loss > 1.0:
        return loss * 2
    return loss


def loss_with_boolean_mask(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    out = model(x)
    confident = out.abs() > 0.1  # depends on the copy's outputs: a shape per copy
    return F.mse_loss(out[confident], y[confident])


def test_a_boolean_mask_from_the_shared_batch_runs() -> None:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y, mask = batch
        return F.mse_loss(model(x)[mask], y[mask])

    build(loss_fn)  # the same shape for every copy: nothing to refuse


@pytest.mark.parametrize(
    ("loss_fn", "operation", "fix", "line"),
    [
        (loss_with_item, ".item()", "keep the value a tensor", "loss.item()"),
        (loss_with_branch, "branches in Python", "torch.where", "if loss > 1.0"),
        (loss_with_boolean_mask, "boolean mask", "multiply by the mask", "out[confident]"),
    ],
)
def test_sweep_refuses_a_loss_vmap_cannot_run_when_built_naming_operation_line_and_fix(
    loss_fn: Any, operation: str, fix: str, line: str
) -> None:
    with pytest.raises(sl.ConfigError) as caught:
        build(loss_fn)
    message = str(caught.value)
    assert operation in message and fix in message and line in message
    assert "test_sweep_refusals.py" in message


class Counting(nn.Module):
    """Keeps a running sum in a tensor attribute that is not a registered buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.seen = torch.zeros(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.seen += out.detach().sum(0)
        return out.flatten()


def test_sweep_refuses_an_in_place_update_of_a_tensor_that_is_not_per_copy() -> None:
    copies = Copies.stack([Counting() for _ in range(3)])
    with pytest.raises(sl.ConfigError, match="register_buffer"):
        build(mean_loss, copies)


def test_building_a_sweep_changes_no_buffer_and_no_random_stream() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 3), nn.BatchNorm1d(3), nn.Dropout(0.5), nn.Flatten(0))

    copies = Copies.stack([make() for _ in range(3)])
    buffers = {k: v.clone() for k, v in copies.stacked.named_buffers()}
    rng = torch.get_rng_state()
    build(mean_loss, copies)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in copies.stacked.named_buffers():
        assert torch.equal(value, buffers[name]), name


def test_sweep_refuses_a_loss_of_the_wrong_form_with_the_step_message() -> None:
    with pytest.raises(sl.LossFnError, match="shape"):
        build(lambda m, b: (m(b[0]) - b[1]) ** 2)  # not reduced


def test_sweep_refuses_a_float16_scaler_a_step_number_and_another_model() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(2)])
    opt = SweepSGD(copies.parameters(), lr=0.1)
    step = build(mean_loss, copies)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(sl.ConfigError, match="bfloat16"):
        step(sl.TrainState.create(model=copies, optimizer=opt, scaler=scaler), BATCH)
    other = Copies.stack([tiny_model(i) for i in range(2)])
    with pytest.raises(sl.ConfigError, match="same copies"):
        step(sl.TrainState.create(model=other, optimizer=SweepSGD(other.parameters(), lr=1)), BATCH)
    with pytest.raises(sl.ConfigError, match="step number"):
        sweep_step(
            sl.make_train_step(lambda m, b, step: mean_loss(m, b)),
            copies=copies,
            example_batch=BATCH,
        )


def test_copies_refuse_different_architectures_and_optimizers_the_wrong_number_of_values() -> None:
    with pytest.raises(sl.ConfigError, match="same architecture"):
        Copies.stack([nn.Linear(2, 3), nn.Linear(2, 4)])
    with pytest.raises(sl.ConfigError, match="two or more"):
        Copies.stack([nn.Linear(2, 3)])
    copies = Copies.stack([nn.Linear(2, 3) for _ in range(3)])
    with pytest.raises(sl.ConfigError, match="2 values for 3 copies"):
        SweepAdamW(copies.parameters(), lr=[0.1, 0.2])
    with pytest.raises(sl.ConfigError, match="leading"):
        SweepAdamW(nn.Linear(2, 4).parameters(), lr=0.1, n=3)
    with pytest.raises(sl.ConfigError, match=r"\[0, 3\)"):
        copies.copy(3)


def test_a_per_copy_skip_with_a_torch_optimizer_is_refused_before_any_update() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(3)])
    with torch.no_grad():
        copies.stacked.get_parameter("0.weight")[1].fill_(float("nan"))
    before = [p.detach().clone() for p in copies.parameters()]
    opt = torch.optim.AdamW(copies.parameters(), lr=0.1)  # cannot mask one copy
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(
        sl.skip_nonfinite(sl.make_train_step(mean_loss)), copies=copies, example_batch=BATCH
    )
    with pytest.raises(sl.ConfigError, match="SweepAdamW or SweepSGD"):
        step(state, BATCH)
    for b, p in zip(before, copies.parameters(), strict=True):
        assert torch.equal(b.nan_to_num(), p.detach().nan_to_num())


def test_a_window_without_targets_with_a_torch_optimizer_is_an_error_naming_the_fix() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(2)])
    opt = torch.optim.SGD(copies.parameters(), lr=0.1, momentum=0.9)  # cannot skip one window
    state = sl.TrainState.create(model=copies, optimizer=opt)
    x, y, mask = BATCH
    step = sweep_step(sl.make_train_step(token_loss), copies=copies, example_batch=BATCH)
    state, _ = step(state, BATCH)
    with pytest.raises(EmptyWindowError, match="held no targets"):
        step(state, (x, y, torch.zeros_like(mask)))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: SweepSGD(p, lr=[0.1, -0.1, 0.1]), r"lr=...\) received -0.1 for copy 1"),
        (lambda p: SweepSGD(p, lr=0.1, momentum=[0.9, 0.9, -0.5]), "momentum=...\\) received -0.5"),
        (lambda p: SweepAdamW(p, beta1=[0.9, 1.5, 0.9]), r"beta1=...\) received 1.5 for copy 1"),
        (lambda p: SweepAdamW(p, beta2=1.0), r"beta2=...\) received 1.0 for copy 0"),
        (lambda p: SweepAdamW(p, eps=[1e-8, 1e-8, -1e-8]), "eps=...\\) received -1e-08"),
        (
            lambda p: SweepAdamW(p, weight_decay=[0.1, -0.1, 0.0]),
            "weight_decay=...\\) received -0.1",
        ),
        (lambda p: SweepAdamW(p, lr=[float("nan"), 1e-3, 1e-3]), r"lr=...\) received nan"),
        (lambda p: SweepSGD(p, lr=0.1, momentum=0.9, nesterov=[False, True]), "one bool"),  # type: ignore[arg-type]
        (lambda p: SweepAdamW(p, decoupled=[True, False]), "one bool"),  # type: ignore[arg-type]
        (
            lambda p: SweepSGD(p, lr=0.1, momentum=[0.9, 0.0, 0.9], nesterov=True),
            r"momentum=0.0, dampening=0.0 for copy 1; torch.optim.SGD refuses Nesterov",
        ),
        (
            lambda p: SweepSGD(p, lr=0.1, momentum=0.9, dampening=[0, 0, 0.1], nesterov=True),
            r"momentum=0.9, dampening=0.1 for copy 2",
        ),
    ],
)
def test_sweep_optimizers_refuse_what_torch_optim_refuses_and_a_list_for_a_shared_flag(
    make: Any, message: str
) -> None:
    """A copy's value that torch.optim refuses (its own run would not start) trained that copy
    wrong in silence (a negative rate ascends); a list for a flag that is one for every copy
    (nesterov, decoupled) was read as True for all."""
    copies = Copies.stack([tiny_model(i) for i in range(3)])
    with pytest.raises(sl.ConfigError, match=message):
        make(copies.parameters())


def test_copies_refuse_models_frozen_or_in_a_mode_unlike_the_first() -> None:
    """One stacked tensor has one requires_grad: copy 0's was taken for all, so a layer frozen
    in copy 1 trained (or one it trains stayed frozen) in silence; and so for the mode."""
    frozen = tiny_model(1)
    frozen.get_parameter("0.weight").requires_grad_(False)
    with pytest.raises(sl.ConfigError, match=r"requires_grad of \['0.weight'\]"):
        Copies.stack([tiny_model(0), frozen])
    with pytest.raises(sl.ConfigError, match=r"train/eval mode of \['\(the model\)', '0'"):
        Copies.stack([tiny_model(0), tiny_model(1).eval()])
    alike = Copies.stack([frozen, frozen])  # frozen alike: one frozen stacked tensor
    assert not alike.stacked.get_parameter("0.weight").requires_grad


def test_a_count_that_differs_between_copies_is_refused_before_the_update() -> None:
    """A count of targets that depends on the model's outputs differs per copy, and copy 0's
    normalised every copy's gradients in silence. A count from the batch reads nothing on the
    host (the check is a copy read once it has landed)."""

    def confident_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, _ = batch
        out = model(x)
        confident = out.abs() < 0.3  # which outputs count: per copy
        return ((out - y) ** 2 * confident).sum(), confident.sum()

    copies = Copies.stack([tiny_model(i) for i in range(3)])
    state = sl.TrainState.create(model=copies, optimizer=SweepSGD(copies.parameters(), lr=0.1))
    before = [p.detach().clone() for p in copies.parameters()]
    step = sweep_step(sl.make_train_step(confident_loss), copies=copies, example_batch=BATCH)
    with pytest.raises(sl.ConfigError, match="different num_targets for different copies"):
        step(state, BATCH)
    for b, p in zip(before, copies.parameters(), strict=True):
        assert torch.equal(b, p)
    shared = sweep_step(sl.make_train_step(token_loss), copies=copies, example_batch=BATCH)
    assert assert_no_host_sync(shared, state, make_batches(3)).step == 3


def test_an_absolute_schedule_over_per_copy_rates_is_refused_and_allowed_over_one_rate() -> None:
    """AbsoluteLR sets group["lr"] to the rate itself, which a sweep optimizer multiplies by
    each copy's lr: copy i trained at get_lr(n) * lr_i in silence."""
    copies = Copies.stack([tiny_model(i) for i in range(2)])
    step = build(mean_loss, copies)
    opt = SweepSGD(copies.parameters(), lr=[0.1, 0.3])
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=AbsoluteLR(opt, GET_LR))
    with pytest.raises(sl.ConfigError, match="AbsoluteLR sets the group's lr to the rate"):
        step(state, BATCH)
    one = SweepSGD(copies.parameters(), lr=1.0, momentum=[0.0, 0.9])
    state = sl.TrainState.create(model=copies, optimizer=one, scheduler=AbsoluteLR(one, GET_LR))
    _, out = step(state, BATCH)
    assert out.lr.tolist() == [0.05, 0.05]
    assert copy.deepcopy(opt).lr_per_copy and not copy.deepcopy(one).lr_per_copy


def GET_LR(n: int) -> float:  # noqa: N802 - named as nanoGPT names its schedule
    return 0.05 / (n + 1)


def test_an_optimizer_that_mixes_a_tensors_elements_is_refused_at_the_first_call() -> None:
    """torch.optim.Adafactor factors the second moment of a stacked bias [N, out] over the
    copies and scales each tensor's update by its RMS over every copy: 20 float64 updates put
    each copy 5e-3 to 8e-3 from its own Adafactor run, in silence."""
    copies = Copies.stack([tiny_model(i) for i in range(3)])
    step = build(mean_loss, copies)
    state = sl.TrainState.create(model=copies, optimizer=torch.optim.Adafactor(copies.parameters()))
    before = [p.detach().clone() for p in copies.parameters()]
    with pytest.raises(sl.ConfigError, match=r"cannot use torch\.optim\.Adafactor: it mixes"):
        step(state, BATCH)
    assert all(torch.equal(b, p) for b, p in zip(before, copies.parameters(), strict=True))


def test_a_plain_step_over_copies_is_refused_naming_sweep_step() -> None:
    """make_train_step over a Copies state (sweep_step forgotten): loss_fn saw the [N, ...]
    outputs, mse_loss broadcast them against the targets (a torch UserWarning only), and each
    copy trained on a quarter of its own gradient (N=4), in silence."""
    copies = Copies.stack([tiny_model(i) for i in range(4)])
    state = sl.TrainState.create(model=copies, optimizer=SweepSGD(copies.parameters(), lr=0.1))
    before = [p.detach().clone() for p in copies.parameters()]
    with pytest.raises(sl.ConfigError, match=r"holds 4 copies.*sweep_step\(step, copies="):
        sl.make_train_step(mean_loss)(state, BATCH)
    assert all(torch.equal(b, p) for b, p in zip(before, copies.parameters(), strict=True))

"""``num_targets`` cannot make a wrong update (issue 16, defect 3): a negative or fractional
host count is refused on that call with nothing moved; a window whose count is 0 (host) or
<= 0 (a device tensor, read nowhere on the host) contributes no gradient, and the output says
so. Before the fix, -8 reversed the update, ``torch.tensor(-8)`` counted as 1 (an 8x update),
and a zero-count window applied the raw sum of its gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from steplib import LossFnError, TrainState, accumulate, make_train_step
from steplib.testing import assert_no_host_sync


def _setup() -> tuple[TrainState, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    # fused: a window of no targets is then skipped on the device (tests/test_empty_window.py)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    return TrainState.create(model=model, optimizer=opt), model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3), torch.randn(4, 1)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("count", "fragment"), [(-8, "cannot be negative"), (2.5, "int")])
def test_a_negative_or_fractional_host_count_is_refused_and_nothing_moves(
    count: Any, fragment: str
) -> None:
    state, model = _setup()
    before = _params(model)
    step = make_train_step(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    with pytest.raises(LossFnError, match=fragment) as info:
        step(state, _batch())
    assert f"num_targets={count!r}" in str(info.value)
    assert all(p.grad is None for p in model.parameters())  # backward never ran
    for got, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(got, want)
    assert (state.step, state.micro_step, state.window.size) == (0, 0, 0)


@pytest.mark.parametrize("count", [torch.tensor(-8), torch.tensor(0), 0])
def test_a_window_without_valid_targets_contributes_no_gradient(count: Any) -> None:
    state, model = _setup()
    before = _params(model)
    step = make_train_step(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    state, out = step(state, _batch())
    # says so, and makes no update (issue 27)
    assert not bool(out.did_update) and bool(out.skipped) and not bool(out.has_targets)
    for got, want in zip(model.parameters(), before, strict=True):
        assert torch.equal(got, want)  # plain SGD with a zero gradient: nothing moved


def test_a_window_without_targets_among_windows_with_targets_changes_nothing_else() -> None:
    counts = iter([torch.tensor(3), torch.tensor(-8), torch.tensor(0), torch.tensor(2)])

    def loss_fn(m: torch.nn.Module, b: Any) -> Any:
        count = next(counts)
        return F.mse_loss(m(b[0]), b[1], reduction="sum") * (count > 0), count

    batches = [_batch() for _ in range(4)]
    state, model = _setup()
    step = accumulate(make_train_step(loss_fn), 2)
    for batch in batches:
        state, out = step(state, batch)
    assert bool(out.has_targets)
    # Window 1 sums 3 - 8 = -5 targets: none valid, no gradient. Window 2 holds 0 + 2 targets:
    # the gradient of batch 3's loss (batch 2's is multiplied by 0) over 2 targets.
    reference, ref_model = _setup()
    only_second = make_train_step(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), 2))
    reference, _ = only_second(reference, batches[3])
    for got, want in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_device_count_is_never_read_on_the_host() -> None:
    state, _ = _setup()
    step = make_train_step(
        lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), torch.tensor(-1))
    )
    assert_no_host_sync(step, state, [_batch(), _batch()])


class _Holds(torch.autograd.Function):
    """Identity whose graph node holds ``big`` (a Python attribute): alive while the graph is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        ctx.big = big
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def test_a_count_with_a_graph_does_not_keep_the_graph_alive_in_the_window() -> None:
    # A soft count computed from the model (weights.sum()) requires grad. Before the fix the
    # window summed it as it was: every micro-batch's graph stayed alive in state.window until
    # the update, and after it in the output (a leak of one graph per micro-batch).
    import gc
    import weakref

    state, _ = _setup()
    held: list[weakref.ref[torch.Tensor]] = []

    def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        out = model(x)
        big = torch.zeros(1000)
        held.append(weakref.ref(big))
        count = _Holds.apply(torch.sigmoid(out), big).sum()
        return F.mse_loss(out, y, reduction="sum"), count

    step = accumulate(make_train_step(loss_fn), 3)
    outs = []
    for _ in range(3):
        state, out = step(state, _batch())
        outs.append(out)
        gc.collect()
        assert all(ref() is None for ref in held), "a micro-batch's graph is still alive"
    assert not any(out.num_targets.requires_grad for out in outs)

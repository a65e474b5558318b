"""A loss summed over the accumulation window, as a plain loop that calls ``backward()`` on each
micro-batch's summed loss without dividing: docs/migration/README.md's ``sum_over_window``
recipe (copied here verbatim), a four-line ``Part`` before ``NORMALISE``.

Without it ``accumulate(k)`` averages the window's losses (each micro-batch one target), which
with plain SGD is a learning rate k times smaller; a factor k in the loss is exact only for a
full window and a power of two. The recipe is bit for bit with the plain loop, a short last
window included, and on 2 DDP ranks equals one process summing all four micro-batches.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from steplib import TrainState, accumulate, clip, ddp_wrap, make_train_step, run
from steplib.step import NORMALISE, Gradients, Part, Step, add_part
from steplib.testing import run_ranks
from tests.checkpoint_helpers import assert_same
from tests.reference import Batch, make_batches, tiny_model


# The recipe, as docs/migration/README.md gives it.
def sum_over_window(step: Step) -> Step:
    """The window's gradient is the sum of its micro-batches' (no division by their count)."""

    def undivide(grads: Gradients) -> None:  # NORMALISE divides by grads.divisor next:
        grads.divisor = grads.divisor / grads.num_targets  # 1 (1 / world: DDP averaged)

    part = Part(name="sum_over_window", grad_transform=undivide, order=NORMALISE - 1)
    return add_part(step, part)


def summed_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    x, y, _ = batch
    return (model(x) - y).pow(2).sum()  # reduction="sum": one number per micro-batch


def _plain_loop(windows: list[list[Batch]], *, max_norm: float | None = None) -> torch.nn.Module:
    model = tiny_model(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for window in windows:
        opt.zero_grad()
        for batch in window:
            summed_loss(model, batch).backward()  # gradients add up; nothing is divided
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return model


def _batches() -> list[Batch]:
    return [(x.double(), y.double(), mask) for x, y, mask in make_batches(5)]


def test_sum_over_window_equals_the_plain_loop_bit_for_bit_with_a_short_last_window() -> None:
    batches = _batches()  # windows of 2, 2 and 1
    expected = _plain_loop([batches[:2], batches[2:4], batches[4:]], max_norm=50.0)
    model = tiny_model(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = clip(sum_over_window(accumulate(make_train_step(summed_loss), 2)), max_norm=50.0)
    state = run(step, TrainState.create(model=model, optimizer=opt), batches)
    assert state.step == 3
    assert_same(model.state_dict(), expected.state_dict())  # bit for bit, clipped alike


def test_without_the_recipe_accumulate_averages_the_window_sums() -> None:
    # What the recipe changes: steplib's default is the mean of the window's sums.
    batches = _batches()[:4]
    model = tiny_model(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    run(accumulate(make_train_step(summed_loss), 2), state, batches)
    summed = _plain_loop([batches[:2], batches[2:]])
    pairs = zip(model.parameters(), summed.parameters(), strict=True)
    assert all(not torch.equal(a, b) for a, b in pairs)


def _ddp_rank(rank: int, world: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(tiny_model(0).double())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    step = ddp_wrap(sum_over_window(accumulate(make_train_step(summed_loss), 2)))
    mine = _batches()[:4][rank * 2 : rank * 2 + 2]  # rank 0: batches 0, 1; rank 1: 2, 3
    state = run(step, TrainState.create(model=model, optimizer=opt), mine)
    assert state.step == 1
    params = [p.detach().clone() for p in model.module.parameters()]
    del model, state, step, opt  # free the reducer before the group goes
    return params


def test_sum_over_window_on_two_ddp_ranks_sums_every_rank_micro_batches() -> None:
    expected = _plain_loop([_batches()[:4]])  # one process, one window of all four
    for params in run_ranks(_ddp_rank, world=2):
        for got, want in zip(params, expected.parameters(), strict=True):
            # DDP averages the two ranks' sums and the recipe multiplies back by 2: the same
            # sum, added in another order (float64).
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)

"""Law 2: accumulate(step, k) over k micro-batches equals one step over the concatenated batch,
with unequal num_targets per micro-batch, and for a shorter last window."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steplib import TrainState, accumulate, make_train_step
from tests.reference import concat, make_batches, mean_loss, reference_loop, tiny_model, token_loss


def _state(seed: int = 0) -> TrainState:
    model = tiny_model(seed).double()
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _double(batches):
    return [(x.double(), y.double(), m) for x, y, m in batches]


def _assert_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for got, want in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_law2_token_weighted_accumulation_equals_concatenated_batch(k, sizes, seed) -> None:
    micro = _double(make_batches(k, sizes[:k], seed=seed))  # unequal sizes, masks and counts
    state = _state()
    step = accumulate(make_train_step(token_loss), k)
    outs = []
    for batch in micro:
        state, out = step(state, batch)
        outs.append(out)
    assert [bool(o.did_update) for o in outs] == [False] * (k - 1) + [True]

    ref = tiny_model(0).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (record,) = reference_loop(ref, ref_opt, [concat(micro)], token_loss)
    _assert_close(state.model, ref)
    torch.testing.assert_close(outs[-1].loss, record["loss"], atol=1e-6, rtol=1e-6)
    assert int(outs[-1].num_targets) == int(sum(m.sum() for _, _, m in micro))


def test_law2_accumulation_in_float32_within_1e6() -> None:
    micro = make_batches(4, [1, 5, 2, 7])
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(token_loss), 4)
    for batch in micro:
        state, _ = step(state, batch)
    ref = tiny_model(0)
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [concat(micro)], token_loss)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_law2_mean_loss_with_equal_micro_batches_equals_big_batch() -> None:
    micro = _double(make_batches(3, 4))
    state = _state()
    step = accumulate(make_train_step(mean_loss), 3)
    for batch in micro:
        state, _ = step(state, batch)
    ref = tiny_model(0).double()
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [concat(micro)], mean_loss)
    _assert_close(state.model, ref)


def test_law2_shorter_last_window_is_normalised_by_what_it_held() -> None:
    micro = _double(make_batches(5, [3, 1, 4, 2, 5]))
    ref = tiny_model(0).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference_loop(ref, ref_opt, [concat(micro[:3]), concat(micro[3:])], token_loss)

    for close in ("close_window", "flush"):
        state = _state()
        step = accumulate(make_train_step(token_loss), 3)
        for i, batch in enumerate(micro):
            state, out = step(state, batch, close_window=(close == "close_window" and i == 4))
        if close == "flush":
            assert state.window.size == 2
            state, flushed = step.flush(state)
            assert flushed is not None
            out = flushed
        assert state.step == 2 and state.window.size == 0
        assert bool(out.did_update)
        _assert_close(state.model, ref)
        assert step.flush(state) == (state, None)  # nothing left to flush


def test_law2_scheduler_advances_once_per_update_not_per_micro_batch() -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = accumulate(make_train_step(token_loss), 4)
    for batch in make_batches(8):
        state, _ = step(state, batch)
    assert sched.last_epoch == 2 and state.step == 2 and state.micro_step == 8


def test_law2_a_window_with_zero_targets_does_not_divide_by_zero() -> None:
    for count in (0, torch.tensor(0)):
        model = tiny_model(0)
        # fused: a tensor count of 0 is skipped on the device (tests/test_empty_window.py)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        state = TrainState.create(model=model, optimizer=opt)
        before = [p.detach().clone() for p in model.parameters()]

        def zero_targets(m, b, n=count):
            return (m(b[0]) * 0).sum(), n

        step = make_train_step(zero_targets)
        state, out = step(state, make_batches(1)[0])
        assert bool(out.skipped)  # no update at all (issue 27)
        for got, want in zip(model.parameters(), before, strict=True):
            assert torch.equal(got, want)  # zero gradient, no NaN

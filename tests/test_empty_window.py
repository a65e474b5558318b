"""A window that holds no targets makes no update (issue 27, DESIGN §4 "nothing is wrong in
silence"): no optimizer step (AdamW's momentum and weight decay would move the parameters), no
scheduler step, the skip counted, ``did_update`` False and ``skipped`` True; decided on the device
with no host read (law 8) where the optimizer skips in its kernel, also over 2 DDP ranks and under
``compile_step``; against a plain loop that simply does not update on such a window. Where the
optimizer cannot skip on the device and nothing else reads a decision, the update is refused
loudly (``EmptyWindowError``, with the fix), never made in silence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from steplib import (
    TrainState,
    accumulate,
    compile_step,
    ddp_wrap,
    make_train_step,
    skip_nonfinite,
)
from steplib.errors import EmptyWindowError
from steplib.testing import assert_no_host_sync, run_ranks
from tests.reference import make_batches, tiny_model, token_loss

K = 2  # micro-batches per window
EMPTY = 1  # the second window holds no targets


def _windows(n: int = 4, *, seed: int = 1) -> list[list[Any]]:
    batches = make_batches(n * K, seed=seed)
    for i in range(EMPTY * K, (EMPTY + 1) * K):
        x, y, mask = batches[i]
        batches[i] = (x, y, torch.zeros_like(mask))  # all padding
    return [batches[w * K : (w + 1) * K] for w in range(n)]


def _int_count_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    loss_sum, _ = token_loss(model, batch)
    return loss_sum, int(batch[2].sum())  # the count from the data, on the host


def _pieces(
    seed: int = 0, *, fused: bool = True
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    return model, opt, sched


def _plain_loop(windows: Sequence[Sequence[Any]], *, fused: bool = True) -> tuple[Any, ...]:
    """The reference: a window whose targets sum to 0 is dropped, nothing else happens."""
    model, opt, sched = _pieces(fused=fused)
    for window in windows:
        count = torch.zeros((), dtype=torch.int64)
        for batch in window:
            loss_sum, n = token_loss(model, batch)
            loss_sum.backward()
            count += n
        if int(count) > 0:
            for p in model.parameters():
                p.grad.div_(count)  # type: ignore[union-attr]
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, sched


def _assert_same(got: tuple[Any, ...], want: tuple[Any, ...], *, exact: bool = True) -> None:
    (model, opt, sched), (ref_model, ref_opt, ref_sched) = got, want
    check = torch.equal if exact else _close
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert check(a, b)
    for index, buffers in ref_opt.state_dict()["state"].items():
        for name, value in buffers.items():
            mine = opt.state_dict()["state"][index][name]
            assert check(
                torch.as_tensor(mine, dtype=torch.float64),
                torch.as_tensor(value, dtype=torch.float64),
            )
    assert sched.last_epoch == ref_sched.last_epoch
    assert sched.get_last_lr() == ref_sched.get_last_lr()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    return True


def _check_outputs(outs: list[Any], state: TrainState, n: int) -> None:
    closing = outs[K - 1 :: K]
    assert [bool(o.did_update) for o in closing] == [w != EMPTY for w in range(n)]
    assert [bool(o.skipped) for o in closing] == [w == EMPTY for w in range(n)]
    assert state.step == n and int(state.skipped_updates) == 1
    assert int(state.consecutive_skips) == 0


def test_an_empty_window_makes_no_update_decided_on_the_device_without_a_host_read() -> None:
    windows = _windows()
    model, opt, sched = _pieces()
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = accumulate(make_train_step(token_loss), K)
    flat = [b for w in windows for b in w]
    state = assert_no_host_sync(step, state, flat)  # law 8: every read patched to raise
    _assert_same((model, opt, sched), _plain_loop(windows))

    model, opt, sched = _pieces()  # again, for the outputs
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    outs = []
    for batch in flat:
        state, out = step(state, batch)
        outs.append(out)
    _check_outputs(outs, state, len(windows))


def test_an_int_count_of_zero_is_skipped_on_the_host_for_any_optimizer() -> None:
    windows = _windows()
    model, opt, sched = _pieces(fused=False)  # foreach AdamW: it cannot skip in a kernel
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = accumulate(make_train_step(_int_count_loss), K)
    outs = []
    for batch in (b for w in windows for b in w):
        state, out = step(state, batch)
        outs.append(out)
    _check_outputs(outs, state, len(windows))
    _assert_same((model, opt, sched), _plain_loop(windows, fused=False))


def test_a_non_fused_optimizer_skips_with_skip_nonfinite_and_refuses_without_it() -> None:
    windows = _windows()
    flat = [b for w in windows for b in w]
    model, opt, sched = _pieces(fused=False)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = skip_nonfinite(accumulate(make_train_step(token_loss), K))  # one host read per update
    for batch in flat:
        state, _ = step(state, batch)
    assert int(state.skipped_updates) == 1
    _assert_same((model, opt, sched), _plain_loop(windows, fused=False))

    model, opt, sched = _pieces(fused=False)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = accumulate(make_train_step(token_loss), K)
    with pytest.raises(EmptyWindowError, match=r"update 2 .* held no targets.*fused=True"):
        for batch in flat:
            state, _ = step(state, batch)


def test_compile_step_makes_no_update_on_an_empty_window() -> None:
    windows = _windows(5)
    windows.insert(3, windows.pop(EMPTY))  # the empty window after the eager first update
    model, opt, sched = _pieces()
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = compile_step(accumulate(make_train_step(token_loss), K))
    outs = []
    for batch in (b for w in windows for b in w):
        state, out = step(state, batch)
        outs.append(out)
    closing = outs[K - 1 :: K]
    assert [bool(o.skipped) for o in closing] == [w == 3 for w in range(len(windows))]
    assert int(state.skipped_updates) == 1
    _assert_same((model, opt, sched), _plain_loop(windows), exact=False)


def _ddp_empty(rank: int, world: int) -> dict[str, Any]:
    # Each rank holds its own half of every window; the second window is empty on both ranks,
    # so the window over the processes holds no targets and every rank must skip it.
    model = DistributedDataParallel(tiny_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = ddp_wrap(accumulate(make_train_step(token_loss), K))
    skipped = []
    for window in _windows(seed=10 + rank):
        for batch in window:
            state, out = step(state, batch)
        skipped.append(bool(out.skipped))
    result = {
        "skipped": skipped,
        "counted": int(state.skipped_updates),
        "position": sched.last_epoch,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    del model, state, step, opt, sched
    return result


def test_ddp_every_rank_skips_an_empty_window_together() -> None:
    r0, r1 = run_ranks(_ddp_empty)
    assert r0["skipped"] == r1["skipped"] == [w == EMPTY for w in range(4)]
    assert r0["counted"] == r1["counted"] == 1 and r0["position"] == r1["position"] == 3
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
    # The one-process reference on the concatenated windows: the empty one dropped.
    ranks = [_windows(seed=10 + r) for r in range(2)]
    model, opt, sched = _pieces()
    for w in range(4):
        batches = [b for r in range(2) for b in ranks[r][w]]
        count = sum(int(b[2].sum()) for b in batches)
        for batch in batches:
            token_loss(model, batch)[0].backward()
        if count:
            for p in model.parameters():
                p.grad.div_(count)  # type: ignore[union-attr]
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(r0["params"], model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

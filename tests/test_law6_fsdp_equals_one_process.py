"""Law 6 for FSDP2: fsdp_wrap on 2 ranks gives the parameters of 1 process on the full batch,
and no gradient reduce-scatter happens on non-final micro-batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    clip,
    compile_step,
    fsdp_wrap,
    make_train_step,
    skip_nonfinite,
)
from steplib.distributed import apply_fsdp
from steplib.step.compile import compile_stats
from steplib.testing import run_ranks
from tests.reference import concat, make_batches, reference_loop

K = 2
SIZES = [1, 4, 3, 2]  # rank 0 holds 5 samples, rank 1 holds 5 with other masks


def _model() -> nn.Module:
    # No Flatten at the end: FSDP2 warns when a sharded module returns a view.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, mask = batch
    err = (model(x).reshape(-1) - y) ** 2
    return (err * mask).sum(), mask.sum()


def _fsdp_train(rank: int, world: int) -> dict[str, Any]:
    model = apply_fsdp(_model(), blocks=[])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    step = fsdp_wrap(skip_nonfinite(clip(accumulate(make_train_step(_loss), K), max_norm=0.5)))
    calls: list[int] = []
    # FSDP2 reduce-scatters through one of these, depending on the torch version.
    names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    reduced = []
    try:
        for update in range(2):
            micro = make_batches(2 * K, SIZES, seed=50 + update)
            for batch in micro[rank * K : (rank + 1) * K]:
                before = len(calls)
                state, out = step(state, batch)
                reduced.append(len(calls) > before)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    params = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    result = {"params": params, "reduced": reduced, "norm": out.grad_norm, "loss": out.loss}
    del model, state, step, opt
    return result


def test_law6_fsdp_two_ranks_equal_one_process_on_the_full_batch() -> None:
    results = run_ranks(_fsdp_train)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    windows = [concat(make_batches(2 * K, SIZES, seed=50 + u)) for u in range(2)]
    records = reference_loop(ref, opt, windows, _loss, max_norm=0.5)
    for result in results:
        for got, want in zip(result["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(result["norm"], records[-1]["grad_norm"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(result["loss"], records[-1]["loss"], atol=1e-6, rtol=1e-6)
        assert result["reduced"] == [False, True, False, True]


def _flush(rank: int, world: int) -> str:
    model = apply_fsdp(_model())
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = fsdp_wrap(accumulate(make_train_step(_loss), 3))
    state, _ = step(state, make_batches(1, seed=rank)[0])
    try:
        step.flush(state)
    except ConfigError as err:
        message = str(err)
    else:
        message = "no error"
    del model, state, step
    return message


def test_fsdp_flush_after_the_data_ended_is_refused_with_the_fix() -> None:
    for message in run_ranks(_flush):
        assert "close_window=True" in message


def _several_models(rank: int, world: int) -> str:
    models = {"G": _model(), "D": _model()}
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    state = TrainState.create(model=models, optimizer=optimizers)
    step = fsdp_wrap(make_train_step(lambda model, batch: _loss(model["G"], batch), optimizer="G"))
    try:
        step(state, make_batches(1, seed=rank)[0])
    except ConfigError as err:
        return str(err)
    return "no error"


def test_fsdp_wrap_over_several_models_points_to_ddp_not_to_apply_fsdp() -> None:
    # It said "a ModuleDict, not an FSDP2-sharded module: apply_fsdp(model, blocks=...)",
    # which cannot be followed for a dict of models.
    for message in run_ranks(_several_models):
        assert "several models (G, D)" in message and "apply_ddp(g)" in message


def test_fsdp_wrap_without_a_process_group_says_what_to_call() -> None:
    with pytest.raises(ConfigError, match="init_distributed"):
        fsdp_wrap(make_train_step(_loss))


def _nan_on_rank1(rank: int, world: int, *, fused: bool) -> dict[str, Any]:
    model = apply_fsdp(_model(), blocks=[])
    # fused=True: the skip is decided on the device (found_inf into the fused kernel, the
    # LambdaLR's rates from a device table); fused=False reads it on the host.
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9**n)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = fsdp_wrap(skip_nonfinite(accumulate(make_train_step(_loss), 2)))
    skipped = []
    for i, (x, y, mask) in enumerate(make_batches(6, seed=rank)):
        if rank == 1 and i == 3:
            x = x * float("nan")  # only rank 1 sees it, in the second window
        state, out = step(state, (x, y, mask))
        if state.window.size == 0:
            skipped.append(bool(out.skipped))
    params = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    result = {
        "skipped": skipped,
        "position": sched.last_epoch,
        "on_device": isinstance(opt.param_groups[0]["lr"], torch.Tensor),  # a LambdaLR table
        "params": params,
    }
    del model, state, step, opt
    return result


def _nan_on_rank1_fused(rank: int, world: int) -> dict[str, Any]:
    return _nan_on_rank1(rank, world, fused=True)


def _nan_on_rank1_foreach(rank: int, world: int) -> dict[str, Any]:
    return _nan_on_rank1(rank, world, fused=False)


def test_law6_fsdp_a_nan_on_one_rank_skips_everywhere_also_decided_on_device() -> None:
    fused, foreach = run_ranks(_nan_on_rank1_fused), run_ranks(_nan_on_rank1_foreach)
    for result in (*fused, *foreach):
        assert result["skipped"] == [False, True, False]
        assert result["position"] == 2  # the schedule moved for the two applied updates only
    assert [r["on_device"] for r in fused] == [True, True]
    assert [r["on_device"] for r in foreach] == [False, False]
    for a, b in zip(fused[0]["params"], foreach[0]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # fused vs foreach AdamW rounding


def _fsdp_compiled(rank: int, world: int) -> dict[str, Any]:
    model = apply_fsdp(_model(), blocks=[])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    step = compile_step(fsdp_wrap(clip(accumulate(make_train_step(_loss), K), max_norm=0.5)))
    for update in range(3):  # the first update runs eagerly, the second compiles
        for batch in make_batches(2 * K, SIZES, seed=50 + update)[rank * K : (rank + 1) * K]:
            state, _ = step(state, batch)
    params = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    stats = compile_stats(step)
    del model, state, step, opt
    return {"params": params, "updates": stats.updates, "fused": stats.fused_backward}


# Dynamo reads `.grad` of non-leaf tensors while it traces and hides torch's warning about it
# (`safe_has_grad`); this suite's error-on-warning filter turns it into an error regardless.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_law6_fsdp_holds_under_compile_step() -> None:
    results = run_ranks(_fsdp_compiled, timeout=300)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    windows = [concat(make_batches(2 * K, SIZES, seed=50 + u)) for u in range(3)]
    reference_loop(ref, opt, windows, _loss, max_norm=0.5)
    for result in results:
        assert (result["updates"], result["fused"]) == (3, False)
        for got, want in zip(result["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

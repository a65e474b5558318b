"""Law 4: amp_wrap in bf16 matches the autocast reference loop; fp16 with a scaler skips the
update on inf/NaN gradients, backs the scale off, reports did_update=False and does not advance
the scheduler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from steplib import TrainState, accumulate, amp_wrap, clip, make_train_step, skip_nonfinite
from tests.reference import make_batches, mean_loss, params_of, reference_loop, tiny_model


def test_law4_bf16_matches_autocast_reference_loop() -> None:
    batches = make_batches(8)
    ref = tiny_model(0)
    records = reference_loop(
        ref,
        torch.optim.SGD(ref.parameters(), lr=0.1),
        batches,
        mean_loss,
        autocast_dtype=torch.bfloat16,
    )
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.bfloat16)
    for batch, record in zip(batches, records, strict=True):
        state, out = step(state, batch)
        assert torch.equal(out.loss, record["loss"])
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert got.dtype == torch.float32  # autocast leaves the master weights in fp32
        assert torch.equal(got, want)


def test_law4_fp16_matches_scaled_reference_loop() -> None:
    batches = make_batches(6)
    ref = tiny_model(0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    reference_loop(
        ref,
        torch.optim.SGD(ref.parameters(), lr=0.1),
        batches,
        mean_loss,
        autocast_dtype=torch.float16,
        scaler=ref_scaler,
        max_norm=1.0,
    )
    model = tiny_model(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    step = clip(amp_wrap(make_train_step(mean_loss), dtype=torch.float16), max_norm=1.0)
    for batch in batches:
        state, _ = step(state, batch)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want)
    assert scaler.get_scale() == ref_scaler.get_scale()


def test_law4_fp16_skips_update_on_inf_gradient_and_backs_off() -> None:
    batches = make_batches(4)
    poisoned = (batches[2][0] * float("inf"), batches[2][1], batches[2][2])
    batches[2] = poisoned
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.float16)
    outs = []
    for i, batch in enumerate(batches):
        before, scale, epoch = params_of(model), scaler.get_scale(), sched.last_epoch
        state, out = step(state, batch)
        outs.append(out)
        if i == 2:
            assert not bool(out.did_update) and bool(out.skipped)
            assert scaler.get_scale() == scale * 0.5  # the scale backed off
            assert sched.last_epoch == epoch  # the scheduler did not advance
            for got, want in zip(model.parameters(), before, strict=True):
                assert torch.equal(got, want)  # the parameters did not move
            assert all(p.grad is None for p in model.parameters())  # the window was dropped
        else:
            assert bool(out.did_update) and not bool(out.skipped)
    assert sched.last_epoch == 3 and state.step == 4 and state.skipped_updates == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _scaled_recipe(
    model: torch.nn.Module, batches: list[Any], loss_fn: Any, scaler: torch.amp.GradScaler
) -> list[float]:
    """torch's AMP recipe, one update per batch; the scale after each update."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            result = loss_fn(model, batch)
        loss = result[0] / result[1] if isinstance(result, tuple) else result
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales


def test_law4_fp16_a_skip_for_a_nonfinite_loss_moves_the_scale_as_torchs_recipe() -> None:
    # The scale follows the gradients alone, as the scaler's own rule says: a loss made
    # non-finite by a term without gradient leaves them finite (a clean iteration: the scale
    # may grow; skip_nonfinite still skips the update), an inf input overflows them (back off).
    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y, mask, extra = batch
        return mean_loss(model, (x, y, mask)) + extra

    batches: list[Any] = [(*b, torch.tensor(0.0)) for b in make_batches(8)]
    batches[2] = (*batches[2][:3], torch.tensor(float("inf")))  # finite gradients
    batches[5] = (batches[5][0] * float("inf"), *batches[5][1:])  # non-finite gradients
    ref = tiny_model(0)
    want = _scaled_recipe(
        ref, batches, loss_fn, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    )
    model = tiny_model(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    step = skip_nonfinite(amp_wrap(make_train_step(loss_fn), dtype=torch.float16))
    got, skipped = [], []
    for batch in batches:
        state, out = step(state, batch)
        got.append(scaler.get_scale())
        skipped.append(bool(out.skipped))
    assert got == want == [256.0, 512.0, 512.0, 1024.0, 1024.0, 512.0, 512.0, 1024.0]
    assert skipped == [i in (2, 5) for i in range(8)]


def _token_lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 64),
    )


def _token_sum(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    logits = model(tokens[:, :-1]).float().flatten(0, 1)
    return F.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="sum"), tokens[:, 1:].numel()


def test_law4_fp16_token_sums_skip_as_torchs_recipe_from_a_scale_per_target() -> None:
    # The scaler scales the loss sum, whose gradients are num_targets (here 1024) times the
    # mean's that torch's recipe scales: from the same init_scale the scale must back off about
    # log2(1024) times more (skipped updates the recipe does not skip). A scaler started at
    # init_scale / num_targets (amp_wrap's docstring) skips as the recipe does, its scale
    # num_targets times lower.
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (4, 257), generator=gen) for _ in range(8)]
    per_target = 2.0**16 / 1024
    want = _scaled_recipe(_token_lm(), batches, _token_sum, torch.amp.GradScaler("cpu"))
    for init_scale in (2.0**16, per_target):
        model = _token_lm()
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
        step = amp_wrap(make_train_step(_token_sum), dtype=torch.float16)
        got = []
        for batch in batches:
            state, _ = step(state, batch)
            got.append(scaler.get_scale() * 1024)  # the scale of the mean it stands for
        if init_scale == per_target:
            assert got == want and state.skipped_updates == 0
        else:
            assert state.skipped_updates > 0 and want == [2.0**16] * 8  # the recipe skipped none


@pytest.mark.parametrize("fused", [False, True])  # the skip decided on the host, on the device
def test_law4_fp16_a_nonfinite_micro_batch_mid_window_skips_its_window_as_torchs_recipe(
    fused: bool,
) -> None:
    batches = make_batches(12)
    batches[5] = (batches[5][0] * float("inf"), *batches[5][1:])  # a window's second
    batches[8] = (batches[8][0] * float("nan"), *batches[8][1:])  # a window's first
    runs = []
    for ours in (False, True):
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
        step = amp_wrap(accumulate(make_train_step(mean_loss), 2), dtype=torch.float16)
        step = skip_nonfinite(clip(step, max_norm=1.0))
        scales = []
        for i, batch in enumerate(batches):
            if ours:
                state, _ = step(state, batch)
            else:  # torch's recipe with accumulation: each micro-batch's loss / 2
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = mean_loss(model, batch)
                scaler.scale(loss / 2).backward()
                if i % 2 == 1:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        runs.append((scales, list(model.parameters())))
        if ours:
            assert int(state.skipped_updates) == 2 and state.step == 6
    (want, ref), (got, params) = runs
    assert got == want and want[1::2] == [256.0, 512.0, 256.0, 256.0, 128.0, 128.0]
    for a, b in zip(params, ref, strict=True):
        assert torch.equal(a, b)

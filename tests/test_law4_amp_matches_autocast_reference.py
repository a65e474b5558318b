"""Law 4: amp_wrap in bf16 matches the autocast reference loop; fp16 with a scaler skips the
update on inf/NaN gradients, backs the scale off, reports did_update=False and does not advance
the scheduler."""

from __future__ import annotations

import torch

from steplib import TrainState, amp_wrap, clip, make_train_step
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

"""Law 1: make_train_step over N batches gives the raw loop's parameters, bit for bit (CPU fp32)."""

from __future__ import annotations

import torch

from steplib import TrainState, make_train_step, warmup_cosine
from tests.reference import make_batches, mean_loss, params_of, reference_loop, tiny_model


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_law1_make_train_step_equals_raw_loop_bit_for_bit_with_dropout_and_schedule() -> None:
    batches = make_batches(12)
    for make_opt in (_sgd, _adamw):
        ref_model = tiny_model(0, dropout=0.2)
        ref_opt = make_opt(ref_model)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, warmup_cosine(warmup=3, total=12))
        torch.manual_seed(123)  # dropout masks come from the global generator in both runs
        records = reference_loop(ref_model, ref_opt, batches, mean_loss, scheduler=ref_sched)

        model = tiny_model(0, dropout=0.2)
        opt = make_opt(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=3, total=12))
        state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
        step = make_train_step(mean_loss)
        torch.manual_seed(123)
        losses = []
        for batch in batches:
            state, out = step(state, batch)
            losses.append(out.loss)

        for got, want in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(got, want), make_opt.__name__
        for loss, record in zip(losses, records, strict=True):
            assert torch.equal(loss, record["loss"])
        assert state.step == 12 and state.micro_step == 12
        assert sched.last_epoch == ref_sched.last_epoch == 12


def test_law1_output_reports_update_and_lr_used() -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = make_train_step(mean_loss)
    lrs = []
    for batch in make_batches(3):
        before = params_of(model)
        state, out = step(state, batch)
        assert bool(out.did_update) and not bool(out.skipped)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        lrs.append(float(out.lr))
    assert lrs == [0.5, 0.25, 0.5 / 3]


def test_the_update_clears_the_gradients_and_calls_an_optimizers_own_zero_grad() -> None:
    calls: list[bool] = []

    class OwnZeroGrad(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    batch = make_batches(1)[0]
    for optimizer_class in (torch.optim.SGD, OwnZeroGrad):
        model = tiny_model(0)
        opt = optimizer_class(model.parameters(), lr=0.1)
        make_train_step(mean_loss)(TrainState.create(model=model, optimizer=opt), batch)
        assert all(p.grad is None for p in model.parameters())
    assert calls == [True]  # the plain SGD's grads were cleared without its zero_grad

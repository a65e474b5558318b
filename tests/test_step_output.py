"""StepOutput values are snapshots: later training never changes an output already returned."""

from __future__ import annotations

import torch

from steplib import TrainState, accumulate, make_train_step
from tests.reference import make_batches, mean_loss, tiny_model, token_loss


def test_lr_held_as_a_tensor_is_copied_into_each_output() -> None:
    model = tiny_model(0)
    opt = torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(0.5, dtype=torch.float64), fused=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 4)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = make_train_step(mean_loss)
    outs = []
    for batch in make_batches(3):
        state, out = step(state, batch)
        outs.append(out)
    assert [float(o.lr) for o in outs] == [0.5, 0.375, 0.25]


def test_a_tensor_lr_is_reported_as_a_copy_and_every_write_is_seen() -> None:
    # out.lr is a copy of a tensor LR (its scheduler writes it in place), taken at each call:
    # any in-place write (the scheduler's, or the user's between two micro-batches) shows.
    model = tiny_model(0)
    lr = torch.tensor(0.5, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 8)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = accumulate(make_train_step(mean_loss), 3)
    outs = []
    for n, batch in enumerate(make_batches(6)):
        if n == 4:
            with torch.no_grad():
                opt.param_groups[0]["lr"].fill_(0.125)  # mid-window, by hand
        state, out = step(state, batch)
        outs.append(out)
    assert [float(o.lr) for o in outs] == [0.5, 0.5, 0.5, 0.4375, 0.125, 0.125]
    assert all(o.lr is not opt.param_groups[0]["lr"] for o in outs)


def test_micro_step_outputs_report_their_own_loss_and_the_update_the_window_loss() -> None:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    step = accumulate(make_train_step(token_loss), 2)
    a, b = make_batches(2, [2, 5])
    state, first = step(state, a)
    state, second = step(state, b)
    sum_a, n_a = token_loss(model, a)
    sum_b, n_b = token_loss(model, b)
    torch.testing.assert_close(first.loss, (sum_a / n_a).detach())
    torch.testing.assert_close(second.loss, ((sum_a + sum_b) / (n_a + n_b)).detach())
    assert int(second.num_targets) == int(n_a + n_b)


def test_outputs_and_the_window_hold_no_autograd_graph() -> None:
    # The forward's graph (and every activation it saves) must not live on in what a step
    # returns: the output's loss and the open window's running sum are detached.
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(mean_loss), 2)
    state, out = step(state, make_batches(1)[0])
    assert out.loss.grad_fn is None and not out.loss.requires_grad
    assert isinstance(state.window.loss, torch.Tensor) and state.window.loss.grad_fn is None


def test_the_loss_is_reported_in_its_own_dtype_and_at_least_float32() -> None:
    # issue 28: a float64 model reported a float32 out.loss (rounded to 7 digits).
    model = torch.nn.Linear(3, 1).double()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(lambda m, b: (m(b).pow(2).sum(), b.shape[0])), 2)
    batches = [torch.randn(n, 3, dtype=torch.float64) for n in (1, 2)]
    with torch.no_grad():
        expected = model(batches[0]).pow(2).sum()  # float64: 16 digits, not float32's 7
    state, micro = step(state, batches[0])
    assert micro.loss.dtype == torch.float64 and float(micro.loss) == float(expected)
    assert state.window.loss.dtype == torch.float64  # type: ignore[union-attr]
    state, update = step(state, batches[1])
    assert bool(update.did_update) and update.loss.dtype == torch.float64

    half = torch.nn.Linear(3, 1).to(torch.bfloat16)  # a bf16 loss is reported in float32
    state = TrainState.create(model=half, optimizer=torch.optim.SGD(half.parameters(), lr=0.1))
    state, out = make_train_step(lambda m, b: m(b).pow(2).mean())(
        state, torch.ones(2, 3, dtype=torch.bfloat16)
    )
    assert out.loss.dtype == torch.float32

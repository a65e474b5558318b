"""The sweep law: a sweep of N copies equals N separate plain-torch runs (tests/reference.py's
loop, one per copy). float64: parameters within 1e-12 after 100 updates; float32: the gradients
of every update within 1e-6 relative; clip per copy is clip_grad_norm_ per copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.sweep import Copies, SweepAdamW, SweepSGD, stop_copies, sweep_step
from tests.reference import make_batches, mean_loss, tiny_model, token_loss

N = 4
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
WDS = [0.0, 0.01, 0.1, 0.3]


def schedule(i: int) -> float:
    return sl.warmup_cosine(warmup=10, total=100)(i)


def plain_runs(
    make_opt: Callable[[nn.Module, int], torch.optim.Optimizer],
    batches: list[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], Any] = mean_loss,
    clip: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[list[nn.Module], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """N separate runs: the PyTorch docs' loop. Returns the models, every update's gradients
    (flattened) and clip_grad_norm_'s norms, per copy."""
    models, grads, norms = [], [], []
    for i in range(N):
        model = tiny_model(i).to(dtype)
        opt = make_opt(model, i)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        seen, measured = [], []
        for batch in batches:
            loss = loss_fn(model, batch)
            loss.backward()
            if clip is not None:
                measured.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            seen.append(torch.cat([_grad(p).flatten() for p in model.parameters()]))
            opt.step()
            opt.zero_grad()
            sched.step()
        models.append(model)
        grads.append(seen)
        norms.append(measured)
    return models, grads, norms


def sweep_run(
    make_opt: Callable[[Copies], torch.optim.Optimizer],
    batches: list[Any],
    *,
    loss_fn: Callable[[nn.Module, Any], Any] = mean_loss,
    wrap: Callable[[sl.Step], sl.Step] = lambda s: s,
    dtype: torch.dtype = torch.float64,
) -> tuple[Copies, list[torch.Tensor], list[sl.StepOutput]]:
    copies = Copies.stack([tiny_model(i).to(dtype) for i in range(N)])
    opt = make_opt(copies)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    seen: list[torch.Tensor] = []

    def record(state: sl.TrainState) -> None:
        seen.append(torch.cat([_grad(p).flatten(1) for p in copies.parameters()], dim=1).clone())

    step = sl.make_train_step(loss_fn)
    step = wrap(sl.tap(step, before_update=record))
    sweep = sweep_step(step, copies=copies, example_batch=batches[0])
    outs = []
    for batch in batches:
        state, out = sweep(state, batch)
        outs.append(out)
    return copies, seen, outs


def assert_params_equal(copies: Copies, models: list[nn.Module], tol: float) -> None:
    for i, model in enumerate(models):
        for (name, mine), theirs in zip(
            copies.copy(i).named_parameters(), model.parameters(), strict=True
        ):
            err = (mine - theirs).abs().max().item()
            assert err <= tol, f"copy {i} {name}: {err}"


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def first_weight(module: nn.Module) -> torch.Tensor:
    return module.get_parameter("0.weight")


def f64_batches(n: int = 100) -> list[Any]:
    return [(x.double(), y.double(), m) for x, y, m in make_batches(n, seed=3)]


def test_sweep_adamw_per_copy_lr_and_wd_float64_equals_separate_runs_within_1e_12() -> None:
    batches = f64_batches()
    models, _, _ = plain_runs(
        lambda m, i: torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WDS[i]), batches
    )
    copies, _, outs = sweep_run(
        lambda c: SweepAdamW(c.parameters(), lr=LRS, weight_decay=WDS), batches
    )
    assert_params_equal(copies, models, 1e-12)
    assert outs[-1].loss.shape == (N,) and outs[-1].lr.shape == (N,)
    expected_lr = torch.tensor([lr * schedule(99) for lr in LRS], dtype=torch.float64)
    torch.testing.assert_close(outs[-1].lr, expected_lr, rtol=1e-15, atol=0)


def test_sweep_adam_l2_per_copy_betas_float64_equals_separate_runs() -> None:
    batches = f64_batches(40)
    betas = [(0.9, 0.999), (0.8, 0.99), (0.95, 0.9), (0.5, 0.999)]
    models, _, _ = plain_runs(
        lambda m, i: torch.optim.Adam(m.parameters(), lr=LRS[i], betas=betas[i], weight_decay=0.1),
        batches,
    )
    copies, _, _ = sweep_run(
        lambda c: SweepAdamW(
            c.parameters(),
            lr=LRS,
            beta1=[b[0] for b in betas],
            beta2=[b[1] for b in betas],
            weight_decay=0.1,
            decoupled=False,
        ),
        batches,
    )
    assert_params_equal(copies, models, 1e-12)


@pytest.mark.parametrize("decoupled", [True, False])
def test_sweep_adamw_defaults_are_torchs_for_adamw_and_for_adam(decoupled: bool) -> None:
    """Left out, weight_decay is AdamW's 1e-2 or Adam's 0: decoupled=False decayed by AdamW's
    1e-2 as an L2 term (copy 0 ended 3.3e-3 from its torch.optim.Adam run here; 6e-3 to
    0.18 over rates 1e-3 to 3e-2 without a schedule)."""
    batches = f64_batches(30)
    make = torch.optim.AdamW if decoupled else torch.optim.Adam
    models, _, _ = plain_runs(lambda m, i: make(m.parameters(), lr=LRS[i]), batches)
    copies, _, _ = sweep_run(
        lambda c: SweepAdamW(c.parameters(), lr=LRS, decoupled=decoupled), batches
    )
    assert_params_equal(copies, models, 1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sweep_sgd_momentum_float64_equals_separate_runs_within_1e_12(nesterov: bool) -> None:
    batches = f64_batches()
    momenta = [0.0, 0.5, 0.9, 0.95] if not nesterov else [0.5, 0.9, 0.9, 0.95]
    damp = [0.0, 0.1, 0.0, 0.0] if not nesterov else [0.0] * N
    models, _, _ = plain_runs(
        lambda m, i: torch.optim.SGD(
            m.parameters(),
            lr=LRS[i] * 10,
            momentum=momenta[i],
            dampening=damp[i],
            weight_decay=WDS[i],
            nesterov=nesterov,
        ),
        batches,
    )
    copies, _, _ = sweep_run(
        lambda c: SweepSGD(
            c.parameters(),
            lr=[lr * 10 for lr in LRS],
            momentum=momenta,
            dampening=damp,
            weight_decay=WDS,
            nesterov=nesterov,
        ),
        batches,
    )
    assert_params_equal(copies, models, 1e-12)


def test_sweep_of_seeds_with_torch_adamw_over_the_stacked_parameters_is_exact() -> None:
    """Same hyper-parameters: torch's own AdamW over the stacked tensors (element-wise)."""
    batches = f64_batches(50)
    models, _, _ = plain_runs(lambda m, i: torch.optim.AdamW(m.parameters(), lr=1e-2), batches)
    copies, _, _ = sweep_run(lambda c: torch.optim.AdamW(c.parameters(), lr=1e-2), batches)
    assert_params_equal(copies, models, 1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
        lambda p: torch.optim.Adagrad(p, lr=1e-2),
    ],
)
def test_sweep_of_seeds_with_any_element_wise_torch_optimizer_is_exact(make: Any) -> None:
    batches = f64_batches(30)
    models, _, _ = plain_runs(lambda m, i: make(m.parameters()), batches)
    copies, _, _ = sweep_run(lambda c: make(c.parameters()), batches)
    assert_params_equal(copies, models, 1e-12)


def test_sweep_float32_gradients_of_every_update_within_1e_6_relative() -> None:
    batches = make_batches(30, seed=4)
    _, grads, _ = plain_runs(
        lambda m, i: torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WDS[i]),
        batches,
        dtype=torch.float32,
    )
    _, seen, _ = sweep_run(
        lambda c: SweepAdamW(c.parameters(), lr=LRS, weight_decay=WDS),
        batches,
        dtype=torch.float32,
    )
    worst = max(
        ((stacked[i] - grads[i][t]).norm() / grads[i][t].norm()).item()
        for t, stacked in enumerate(seen)
        for i in range(N)
    )
    assert worst <= 1e-6, worst  # relative to the gradient's norm


def test_sweep_clip_per_copy_equals_clip_grad_norm_per_copy() -> None:
    batches = f64_batches(30)
    models, grads, norms = plain_runs(
        lambda m, i: torch.optim.SGD(m.parameters(), lr=LRS[i] * 30), batches, clip=0.05
    )
    copies, seen, outs = sweep_run(
        lambda c: SweepSGD(c.parameters(), lr=[lr * 30 for lr in LRS]),
        batches,
        wrap=lambda s: sl.clip(s, max_norm=0.05),
    )
    for t, out in enumerate(outs):
        expected = torch.stack([norms[i][t] for i in range(N)])
        torch.testing.assert_close(out.grad_norm, expected, rtol=1e-12, atol=0)
        for i in range(N):
            torch.testing.assert_close(seen[t][i], grads[i][t], rtol=1e-12, atol=1e-15)
    assert any(bool((o.grad_norm > 0.05).any()) for o in outs if o.grad_norm is not None)
    assert_params_equal(copies, models, 1e-12)


def test_sweep_accumulate_token_weighted_equals_one_concatenated_batch_per_copy() -> None:
    micro = [(x.double(), y.double(), m) for x, y, m in make_batches(40, sizes=[3, 7, 5, 9] * 10)]
    windows = [micro[i : i + 4] for i in range(0, 40, 4)]
    whole = [tuple(torch.cat(parts) for parts in zip(*w, strict=True)) for w in windows]
    models, _, _ = plain_runs(
        lambda m, i: torch.optim.AdamW(m.parameters(), lr=LRS[i]), whole, loss_fn=_token_mean
    )
    copies, _, outs = sweep_run(
        lambda c: SweepAdamW(c.parameters(), lr=LRS),
        micro,
        loss_fn=token_loss,
        wrap=lambda s: sl.accumulate(s, 4),
    )
    assert [bool(o.did_update.all()) for o in outs] == [i % 4 == 3 for i in range(40)]
    assert_params_equal(copies, models, 1e-12)


def test_sweep_accumulate_short_last_window_through_run_equals_each_copys_windows() -> None:
    """10 micro-batches of unequal counts in windows of 3: run flushes the last, shorter one
    (normalised by the targets it held), as each copy's own run of 4 concatenated batches."""
    micro = [(x.double(), y.double(), m) for x, y, m in make_batches(10, sizes=[3, 7, 5, 9, 2] * 2)]
    whole = [tuple(torch.cat(p) for p in zip(*micro[i : i + 3], strict=True)) for i in (0, 3, 6, 9)]
    models = []
    for i in range(N):
        model = tiny_model(i).double()
        opt = torch.optim.AdamW(model.parameters(), lr=LRS[i], weight_decay=WDS[i])
        for batch in whole:
            _token_mean(model, batch).backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    swept = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=WDS)
    state = sl.TrainState.create(model=copies, optimizer=swept)
    step = sweep_step(
        sl.accumulate(sl.make_train_step(token_loss), 3), copies=copies, example_batch=micro[0]
    )
    state = sl.run(step, state, micro, max_epochs=1)
    assert int(state.step) == 4
    assert_params_equal(copies, models, 1e-12)


def _token_mean(model: nn.Module, batch: Any) -> torch.Tensor:
    total, count = token_loss(model, batch)
    return total / count


def test_sweep_skip_nonfinite_skips_only_the_copy_that_diverged() -> None:
    batches = f64_batches(5)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    with torch.no_grad():
        first_weight(copies.stacked)[2].fill_(float("nan"))  # copy 2 is broken
    before = [p.detach().clone() for p in copies.parameters()]
    opt = SweepAdamW(copies.parameters(), lr=LRS)
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(
        sl.skip_nonfinite(sl.make_train_step(mean_loss)), copies=copies, example_batch=batches[0]
    )
    for batch in batches:
        state, out = step(state, batch)
    assert out.skipped.tolist() == [False, False, True, False]
    assert out.did_update.tolist() == [True, True, False, True]
    assert int(state.skipped_updates) == 5  # copy-updates skipped, in total
    for b, p in zip(before, copies.parameters(), strict=True):
        assert torch.equal(b[2].nan_to_num(), p.detach()[2].nan_to_num())  # copy 2 untouched
        assert not torch.equal(b[0], p.detach()[0])
    assert torch.equal(
        opt.state[first_weight(copies.stacked)]["step"], torch.tensor([5.0, 5, 0, 5])
    )


def test_sweep_batchnorm_buffers_are_per_copy_and_equal_separate_runs() -> None:
    batches = [
        (torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(20)
    ]
    assert_batchnorm_copies_equal_their_runs(batches)


def assert_batchnorm_copies_equal_their_runs(
    batches: list[Any], *, stop: tuple[int, int] | None = None
) -> None:
    """A sweep of a BatchNorm model with SweepSGD against N plain SGD runs: every copy's
    ``state_dict`` (running statistics included) within 1e-12. ``stop=(update, copy)``: that
    copy is stopped before that update, and its run ends there."""

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    models = []
    for i in range(N):
        model = make(i).double()
        plain = torch.optim.SGD(model.parameters(), lr=LRS[i] * 10)
        for b in batches[: stop[0]] if stop is not None and stop[1] == i else batches:
            loss_fn(model, b).backward()
            plain.step()
            plain.zero_grad()
        models.append(model)
    copies = Copies.stack([make(i).double() for i in range(N)])
    opt = SweepSGD(copies.parameters(), lr=[lr * 10 for lr in LRS])
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(sl.make_train_step(loss_fn), copies=copies, example_batch=batches[0])
    for t, b in enumerate(batches):
        if stop is not None and t == stop[0]:
            stop_copies(opt, [stop[1]])
        state, _ = step(state, b)
    for i, model in enumerate(models):
        for (name, mine), theirs in zip(
            copies.copy(i).state_dict().items(), model.state_dict().values(), strict=True
        ):
            assert torch.allclose(mine.double(), theirs.double(), rtol=0, atol=1e-12), (i, name)


def test_sweep_tied_weights_stay_tied_and_equal_separate_runs() -> None:
    """One parameter under two names (an encoder and a decoder sharing a weight): each copy's
    gradient is the sum of both uses, as in its own run."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encode = nn.Linear(8, 4)
            self.decode = nn.Linear(4, 8, bias=False)
            self.decode.weight = nn.Parameter(self.encode.weight.T.contiguous())
            self.encode.weight = self.decode.weight  # tied: forward uses it as x @ W

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x @ self.encode.weight + self.encode.bias)
            return self.decode(h)

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return Tied().double()

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]), b[0])

    batches = [x for x, _, _ in f64_batches(30)]
    models = []
    for i in range(N):
        model = make(i)
        plain = torch.optim.AdamW(model.parameters(), lr=LRS[i], weight_decay=WDS[i])
        for x in batches:
            loss_fn(model, (x,)).backward()
            plain.step()
            plain.zero_grad()
        models.append(model)
    copies = Copies.stack([make(i) for i in range(N)])
    stacked = copies.stacked
    assert stacked.get_parameter("encode.weight") is stacked.get_parameter("decode.weight")
    opt = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=WDS)
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(sl.make_train_step(loss_fn), copies=copies, example_batch=(batches[0],))
    for x in batches:
        state, _ = step(state, (x,))
    assert_params_equal(copies, models, 1e-12)


def test_sweep_dropout_draws_a_different_mask_per_copy() -> None:
    same = Copies.stack([tiny_model(0, dropout=0.5) for _ in range(N)])  # identical copies
    state = sl.TrainState.create(model=same, optimizer=SweepSGD(same.parameters(), lr=0.1))
    batch = make_batches(1)[0]
    step = sweep_step(sl.make_train_step(mean_loss), copies=same, example_batch=batch)
    _, out = step(state, batch)
    assert len(set(out.loss.tolist())) == N  # same weights, same batch: only dropout differs


def test_copy_taken_out_is_a_plain_module_of_the_original_class() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    model = copies.copy(1)
    assert type(model) is nn.Sequential
    torch.testing.assert_close(first_weight(model), first_weight(tiny_model(1)), rtol=0, atol=0)
    first_weight(model).data.add_(1.0)  # its own tensors: the sweep is unchanged
    assert not torch.equal(first_weight(model), first_weight(copies.stacked)[1])
    x = torch.randn(5, 8)
    torch.testing.assert_close(copies(x)[1], tiny_model(1)(x))


def test_sweep_amp_bf16_matches_the_autocast_runs_within_bfloat16_precision() -> None:
    batches = make_batches(10, seed=2)
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    opt = SweepSGD(copies.parameters(), lr=[lr * 10 for lr in LRS])
    state = sl.TrainState.create(model=copies, optimizer=opt)
    amp = sl.amp_wrap(sl.make_train_step(mean_loss), dtype=torch.bfloat16)
    step = sweep_step(amp, copies=copies, example_batch=batches[0])
    losses = []
    for batch in batches:
        state, out = step(state, batch)
        losses.append(out.loss)
    for i in range(N):
        model = tiny_model(i)
        plain = torch.optim.SGD(model.parameters(), lr=LRS[i] * 10)
        for t, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mean_loss(model, batch)
            if t == 0:  # the reference does compute in bfloat16: it differs from float32
                assert loss.item() != mean_loss(model, batch).item()
            # One bf16 rounding (2**-8 relative) apart: the batched kernels round elsewhere.
            assert abs(losses[t][i].item() - loss.item()) <= 2**-8 * abs(loss.item()) + 1e-3
            loss.backward()
            plain.step()
            plain.zero_grad()
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=4e-3)  # 10 bf16 updates


@pytest.mark.parametrize("scheduled", [False, True])
def test_sweep_window_without_targets_updates_no_copy_as_the_plain_loop_skips_it(
    scheduled: bool,
) -> None:
    """Nor does it move a LambdaLR schedule: the plain loop skips the window, step and all."""
    micro = [(x.double(), y.double(), m) for x, y, m in make_batches(8, seed=6)]
    micro[2], micro[3] = [(x, y, torch.zeros_like(m)) for x, y, m in micro[2:4]]  # all padding
    windows = [micro[i : i + 2] for i in range(0, 8, 2)]
    whole = [tuple(torch.cat(parts) for parts in zip(*w, strict=True)) for w in windows]

    def schedule_of(opt: torch.optim.Optimizer) -> Any:
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
        return decay if scheduled else None

    models = []
    for i in range(N):
        model = tiny_model(i).double()
        plain = torch.optim.AdamW(model.parameters(), lr=LRS[i])
        sched = schedule_of(plain)
        for w, batch in enumerate(whole):
            if w == 1:
                continue  # nothing to learn from: no update
            _token_mean(model, batch).backward()
            plain.step()
            plain.zero_grad()
            if sched is not None:
                sched.step()
        models.append(model)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = SweepAdamW(copies.parameters(), lr=LRS)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=schedule_of(opt))
    step = sweep_step(
        sl.accumulate(sl.make_train_step(token_loss), 2), copies=copies, example_batch=micro[0]
    )
    updates = []
    for batch in micro:
        state, out = step(state, batch)
        if state.window.size == 0:
            updates.append(out)
    assert updates[1].skipped.all() and not updates[1].did_update.any()
    assert updates[2].did_update.all()
    if scheduled:  # the second update applied is at the schedule's second position
        expected = torch.tensor([lr / 2 for lr in LRS], dtype=torch.float64)
        torch.testing.assert_close(updates[2].lr, expected, rtol=1e-15, atol=0)
    assert_params_equal(copies, models, 1e-12)


@pytest.mark.parametrize("make_opt", [SweepAdamW, SweepSGD])
def test_a_stopped_copy_with_nan_gradients_is_left_exactly_as_it_was(make_opt: Any) -> None:
    batches = f64_batches(3)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    with torch.no_grad():
        first_weight(copies.stacked)[1].fill_(float("nan"))  # diverged, then stopped
    opt = make_opt(copies.parameters(), lr=LRS, weight_decay=0.1)
    stop_copies(opt, [1])
    before = [p.detach().clone() for p in copies.parameters()]
    state = sl.TrainState.create(model=copies, optimizer=opt)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
    for batch in batches:
        state, out = step(state, batch)
    assert out.did_update.tolist() == [True, False, True, True]
    for b, p in zip(before, copies.parameters(), strict=True):
        assert torch.equal(b[1].nan_to_num(), p.detach()[1].nan_to_num())
        assert not torch.equal(b[0], p.detach()[0])


def test_a_stopped_copy_keeps_its_batchnorm_statistics_as_its_own_run_stopped_there() -> None:
    """Stopping a copy stops its whole state: its running statistics stay where its own run,
    stopped at that update, left them, while the other copies' go on as their runs'."""
    gen = torch.Generator().manual_seed(7)
    batches = [
        (torch.randn(6, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (6,)))
        for _ in range(12)
    ]
    assert_batchnorm_copies_equal_their_runs(batches, stop=(5, 1))


@pytest.mark.parametrize("kind", ["adamw", "adam_l2", "sgd_nesterov"])
def test_stopped_copies_stay_frozen_and_the_others_equal_their_runs(kind: str) -> None:
    """Copies 1 and 3 stopped before updates 7 and 15 of 30, under per-copy weight decay and
    a warmup-cosine schedule: each stopped copy's parameters and optimizer state stay bit for
    bit what they were (decay, momentum and the schedule move nothing), and every copy is
    within 1e-12 of its own run (the stopped ones: run up to their stop)."""
    batches, stops = f64_batches(30), {1: 7, 3: 15}

    def plain(model: nn.Module, i: int) -> torch.optim.Optimizer:
        params = model.parameters()
        if kind == "sgd_nesterov":
            return torch.optim.SGD(params, lr=LRS[i] * 10, momentum=0.9, nesterov=True,
                                   weight_decay=WDS[i])  # fmt: skip
        make = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return make(params, lr=LRS[i], weight_decay=WDS[i])

    def swept(copies: Copies) -> torch.optim.Optimizer:
        params = copies.parameters()
        if kind == "sgd_nesterov":
            return SweepSGD(params, lr=[lr * 10 for lr in LRS], momentum=0.9, nesterov=True,
                            weight_decay=WDS)  # fmt: skip
        return SweepAdamW(params, lr=LRS, weight_decay=WDS, decoupled=kind == "adamw")

    models = []
    for i in range(N):
        model = tiny_model(i).double()
        opt = plain(model, i)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for batch in batches[: stops.get(i, len(batches))]:
            mean_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        models.append(model)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = swept(copies)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
    frozen: dict[int, list[torch.Tensor]] = {}

    def held(i: int) -> list[torch.Tensor]:
        state_of = [value[i] for p in copies.parameters() for value in opt.state[p].values()]
        return [p.detach()[i].clone() for p in copies.parameters()] + [s.clone() for s in state_of]

    for t, batch in enumerate(batches):
        for i, at in stops.items():
            if t == at:
                stop_copies(opt, [i])
                frozen[i] = held(i)
        state, _ = step(state, batch)
    for i, before in frozen.items():
        assert all(torch.equal(a, b) for a, b in zip(before, held(i), strict=True)), i
    assert_params_equal(copies, models, 1e-12)


def test_one_copy_diverging_leaves_the_others_bit_for_bit_as_without_it() -> None:
    """skip_nonfinite with clip and accumulate: copy 2's weights turn inf at micro-batch 5;
    the others' parameters equal, bit for bit, a sweep where nothing diverged, and copy 2's
    update count stops where it was."""

    def sweep(diverge: bool) -> tuple[Copies, sl.TrainState]:
        copies = Copies.stack([tiny_model(i) for i in range(N)])
        opt = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
        inner = sl.clip(sl.skip_nonfinite(sl.make_train_step(mean_loss)), max_norm=0.1)
        batches = make_batches(20, seed=3)
        step = sweep_step(sl.accumulate(inner, 2), copies=copies, example_batch=batches[0])
        for t, batch in enumerate(batches):
            if diverge and t == 5:
                with torch.no_grad():
                    first_weight(copies.stacked)[2].fill_(float("inf"))
            state, _ = step(state, batch)
        return copies, state

    (broken, state), (healthy, _) = sweep(True), sweep(False)
    for mine, theirs in zip(broken.parameters(), healthy.parameters(), strict=True):
        for i in (0, 1, 3):
            assert torch.equal(mine[i], theirs[i])
    assert int(state.skipped_updates) == 8  # copy 2: windows 2 to 9
    steps = state.optimizer.state[first_weight(broken.stacked)]["step"]
    assert steps.tolist() == [10, 10, 2, 10]


@pytest.mark.parametrize("counted", [False, True])
def test_an_update_that_skipped_every_copy_holds_a_lambdalr_as_each_copys_own_run(
    counted: bool,
) -> None:
    # A NaN batch makes every copy's update non-finite: no copy is updated, and each copy's own
    # steplib run (skip_nonfinite) holds its LambdaLR there. The sweep moved it on: the next
    # applied update ran at the schedule's third position instead of its second.
    batches = f64_batches(3)
    x, y, m = batches[1]
    batches[1] = (torch.full_like(x, float("nan")), y, m)
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = SweepAdamW(copies.parameters(), lr=LRS)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=decay)
    loss = token_loss if counted else mean_loss
    inner = sl.skip_nonfinite(sl.make_train_step(loss))
    step = sweep_step(inner, copies=copies, example_batch=batches[0])
    outs = []
    for batch in batches:
        state, out = step(state, batch)
        outs.append(out)
    assert outs[1].skipped.all() and not outs[1].did_update.any()
    expected = torch.tensor([lr / 2 for lr in LRS], dtype=torch.float64)
    torch.testing.assert_close(outs[2].lr, expected, rtol=1e-15, atol=0)

    own = tiny_model(0).double()  # copy 0's own run holds the schedule the same way
    own_opt = torch.optim.AdamW(own.parameters(), lr=LRS[0])
    own_decay = torch.optim.lr_scheduler.LambdaLR(own_opt, lambda t: 1 / (1 + t))
    own_state = sl.TrainState.create(model=own, optimizer=own_opt, scheduler=own_decay)
    own_step = sl.skip_nonfinite(sl.make_train_step(loss))
    for batch in batches:
        own_state, own_out = own_step(own_state, batch)
    assert float(own_out.lr) == float(expected[0])

"""Parameter groups in a sweep: ``SweepAdamW`` / ``SweepSGD`` over torch.optim's groups
(``weight_decay_groups``: no decay on biases and norms), each group with its own values, per
copy where given, against N separate ``torch.optim`` runs with the same groups."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import steplib as sl
from steplib.checkpoint import latest, load, save
from steplib.param_groups import weight_decay_groups
from steplib.sweep import Copies, SweepAdamW, SweepSGD, stop_copies, sweep_step
from tests.reference import make_batches, mean_loss, tiny_model

N = 4
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
WDS = [0.0, 0.01, 0.1, 0.3]
BIAS_LRS = [2e-3, 1e-3, 5e-3, 1e-2]


def schedule(i: int) -> float:
    return sl.warmup_cosine(warmup=10, total=100)(i)


def f64_batches(n: int) -> list[Any]:
    return [(x.double(), y.double(), m) for x, y, m in make_batches(n, seed=3)]


def own_runs(make: Callable[[nn.Module, int], torch.optim.Optimizer], n: int) -> list[nn.Module]:
    """N plain runs: the PyTorch docs' loop, float64, a warmup-cosine LambdaLR."""
    models = []
    for i in range(N):
        model = tiny_model(i).double()
        opt = make(model, i)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for batch in f64_batches(n):
            mean_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        models.append(model)
    return models


def sweep(make: Callable[[Copies], torch.optim.Optimizer], n: int) -> tuple[Copies, Any]:
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])
    opt = make(copies)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    batches = f64_batches(n)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
    for batch in batches:
        state, out = step(state, batch)
    return copies, out


def largest_difference(copies: Copies, models: list[nn.Module]) -> float:
    return max(
        (mine - theirs).abs().max().item()
        for i, model in enumerate(models)
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True)
    )


def test_weight_decay_groups_of_copies_leave_the_biases_undecayed() -> None:
    """A stacked bias is [N, out]: the rule "fewer than 2 dimensions" put every bias of a
    sweep into the decayed group (its 4 tensors decayed, none left without)."""
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    decay, other = weight_decay_groups(copies, WDS)
    plain = weight_decay_groups(tiny_model(0), 0.1)
    assert [p.shape[1:] for p in decay["params"]] == [p.shape for p in plain[0]["params"]]
    assert [p.shape[1:] for p in other["params"]] == [p.shape for p in plain[1]["params"]]
    assert decay["weight_decay"] == WDS and other["weight_decay"] == 0.0
    with pytest.raises(sl.ConfigError, match="one such number per copy"):
        weight_decay_groups(copies, WDS[:2])
    with pytest.raises(sl.ConfigError, match="finite number >= 0"):
        weight_decay_groups(tiny_model(0), WDS)  # one model: one decay


def test_sweep_adamw_over_weight_decay_groups_equals_torch_adamw_runs_with_the_groups() -> None:
    """100 updates, float64, per-copy lr and per-copy decay on the weights, none on the
    biases, a warmup-cosine schedule: every copy equals its own torch.optim.AdamW run with the
    same two groups to the last bits (within 1e-12, as the one-group law)."""
    models = own_runs(
        lambda m, i: torch.optim.AdamW(weight_decay_groups(m, WDS[i]), lr=LRS[i]), 100
    )
    copies, out = sweep(lambda c: SweepAdamW(weight_decay_groups(c, WDS), lr=LRS), 100)
    assert largest_difference(copies, models) <= 1e-12
    expected = torch.tensor([lr * schedule(99) for lr in LRS], dtype=torch.float64)
    torch.testing.assert_close(out.lr, expected, rtol=1e-15, atol=0)  # the first group's


@pytest.mark.parametrize("kind", ["adam_l2", "sgd"])
def test_each_group_with_its_own_per_copy_values_equals_the_runs_with_those_groups(
    kind: str,
) -> None:
    """Group 0 takes the optimizer's values (its per-copy decay among them), group 1 (the
    biases) its own lr and momentum or beta1, per copy or one for every copy."""

    def groups(model: nn.Module, pick: Callable[[list[float]], Any]) -> list[dict[str, Any]]:
        decay, other = weight_decay_groups(model, 0.0)
        del decay["weight_decay"]  # the optimizer's, per copy
        if kind == "sgd":
            return [decay, {**other, "lr": pick(BIAS_LRS), "momentum": 0.5}]
        return [decay, {**other, "lr": pick(BIAS_LRS), "beta1": pick([0.8, 0.85, 0.9, 0.95])}]

    def plain(model: nn.Module, i: int) -> torch.optim.Optimizer:
        given = groups(model, lambda values: values[i])
        if kind == "sgd":
            return torch.optim.SGD(given, lr=LRS[i] * 10, momentum=0.9, weight_decay=WDS[i])
        given[1]["betas"] = (given[1].pop("beta1"), 0.999)
        return torch.optim.Adam(given, lr=LRS[i], weight_decay=WDS[i])

    def swept(copies: Copies) -> torch.optim.Optimizer:
        given = groups(copies, lambda values: values)
        if kind == "sgd":
            lrs = [lr * 10 for lr in LRS]
            return SweepSGD(given, lr=lrs, momentum=0.9, weight_decay=WDS)
        return SweepAdamW(given, lr=LRS, weight_decay=WDS, decoupled=False)

    models = own_runs(plain, 60)
    copies, _ = sweep(swept, 60)
    assert largest_difference(copies, models) <= 1e-12


def test_sweep_adamw_groups_float32_equal_torch_adamw_groups_bit_for_bit() -> None:
    """Given the same gradients, float32, 50 updates: the parameters torch.optim.AdamW gives
    with the same groups, bit for bit (as for one group, tests/test_sweep_optim.py)."""
    plain = [tiny_model(i) for i in range(N)]
    opts = []
    for i, model in enumerate(plain):
        decay, other = weight_decay_groups(model, WDS[i])
        opts.append(torch.optim.AdamW([{**decay, "lr": LRS[i]}, {**other, "lr": BIAS_LRS[i]}]))
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    decay, other = weight_decay_groups(copies, WDS)
    opt = SweepAdamW([{**decay, "lr": LRS}, {**other, "lr": BIAS_LRS}])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        for p in copies.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        for i, (model, plain_opt) in enumerate(zip(plain, opts, strict=True)):
            for p, stacked in zip(model.parameters(), copies.parameters(), strict=True):
                assert stacked.grad is not None
                p.grad = stacked.grad[i].clone()
            plain_opt.step()
    for i, model in enumerate(plain):
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            assert torch.equal(mine, theirs), (mine - theirs).abs().max().item()


def test_a_stopped_copy_stays_frozen_in_every_group_and_a_load_continues_it() -> None:
    """One mask for every group (param_groups[0]["active"]); the state of several groups saved
    and loaded into a new optimizer continues bit for bit."""
    copies = Copies.stack([tiny_model(i).double() for i in range(N)])

    def make() -> SweepAdamW:
        return SweepAdamW(weight_decay_groups(copies, WDS), lr=LRS)

    opt = make()
    assert "active" in opt.param_groups[0] and "active" not in opt.param_groups[1]
    state = sl.TrainState.create(model=copies, optimizer=opt)
    batches = f64_batches(8)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
    for batch in batches[:3]:
        state, _ = step(state, batch)
    stop_copies(opt, [2])
    frozen = [p.detach()[2].clone() for p in copies.parameters()]
    saved = (copy.deepcopy(copies.state_dict()), copy.deepcopy(opt.state_dict()))
    for batch in batches[3:]:
        state, out = step(state, batch)
    assert out.did_update.tolist() == [True, True, False, True]
    assert all(
        torch.equal(f, p.detach()[2]) for f, p in zip(frozen, copies.parameters(), strict=True)
    )
    straight = [p.detach().clone() for p in copies.parameters()]
    copies.load_state_dict(saved[0])
    again = make()
    again.load_state_dict(saved[1])
    state = sl.TrainState.create(model=copies, optimizer=again)
    for batch in batches[3:]:
        state, _ = step(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(straight, copies.parameters(), strict=True))


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"betas": (0.9, 0.95)}, r"param group 1 sets betas=\(0.9, 0.95\).*beta1=... and beta2"),
        ({"amsgrad": True}, "param group 1 sets amsgrad=True"),
        ({"lr": [1e-3, 1e-3]}, r"received 2 values for 4 copies"),
        ({"weight_decay": [0.1, -0.1, 0.0, 0.0]}, r"received -0.1 for copy 1 \(param group 1\)"),
        ({"decoupled": [True, False]}, "one bool"),
    ],
)
def test_a_group_value_torch_optim_would_refuse_or_ignore_is_refused(
    group: dict[str, Any], message: str
) -> None:
    """``betas`` in a group (a torch.optim.AdamW recipe's) was silently ignored: every copy
    trained with the optimizer's beta1 and beta2."""
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    decay, other = weight_decay_groups(copies, 0.1)
    with pytest.raises(sl.ConfigError, match=message):
        SweepAdamW([decay, {**other, **group}], lr=LRS)


def test_groups_of_tensors_without_the_copies_dimension_are_refused() -> None:
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    opt = SweepSGD(copies.parameters(), lr=0.1)
    extra = nn.Parameter(torch.zeros(N, 5))
    opt.add_param_group({"params": extra, "lr": BIAS_LRS})  # one tensor: one parameter
    assert opt.param_groups[1]["params"] == [extra] and opt.lr_per_copy == (1,)
    with pytest.raises(sl.ConfigError, match=r"param group 1 has shapes \[\(16, 8\)"):
        SweepSGD([{"params": copies.parameters()}, {"params": tiny_model(0).parameters()}], lr=0.1)
    with pytest.raises(sl.ConfigError, match="or parameter groups of them"):
        mixed: list[Any] = [{"params": list(copies.parameters())}, *copies.parameters()]
        SweepSGD(mixed, lr=0.1)


def test_an_absolute_rate_is_judged_for_the_groups_with_per_copy_rates() -> None:
    """Only group 1 has per-copy rates: a OneCycleLR whose max_lr is absolute for group 0
    (one rate, as a plain run's) and 1.0 for group 1 (each copy's own peak) is each copy's
    own one-cycle schedule and is taken; the other way round it is refused, naming group 1,
    and so is an eta_min, which every group shares."""
    copies = Copies.stack([tiny_model(i) for i in range(N)])
    batch = make_batches(1)[0]
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batch)

    def state_with(make_sched: Callable[[torch.optim.Optimizer], Any]) -> sl.TrainState:
        decay, other = weight_decay_groups(copies, 0.1)
        opt = SweepAdamW([decay, {**other, "lr": BIAS_LRS}], lr=1e-3)
        assert opt.lr_per_copy == (1,)
        return sl.TrainState.create(model=copies, optimizer=opt, scheduler=make_sched(opt))

    def one_cycle(max_lr: list[float]) -> Callable[[torch.optim.Optimizer], Any]:
        return lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=max_lr, total_steps=10, cycle_momentum=False
        )

    step(state_with(one_cycle([1e-3, 1.0])), batch)
    with pytest.raises(sl.ConfigError, match=r"OneCycleLR has max_lr=0.001.*param group 1\)"):
        step(state_with(one_cycle([1.0, 1e-3])), batch)
    cosine = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10, eta_min=1e-5)  # noqa: E731
    with pytest.raises(sl.ConfigError, match="CosineAnnealingLR has eta_min=1e-05"):
        step(state_with(cosine), batch)


def test_a_checkpoint_of_a_sweep_with_groups_resumes_bit_for_bit(tmp_path: Path) -> None:
    """save / load: each group's per-copy values, the one active mask and the schedule."""

    def build() -> tuple[Copies, sl.TrainState, Any]:
        copies = Copies.stack([tiny_model(i) for i in range(3)])
        decay, other = weight_decay_groups(copies, [0.0, 0.1, 0.2])
        opt = SweepAdamW([decay, {**other, "lr": BIAS_LRS[:3]}], lr=LRS[:3])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
        step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
        return copies, state, step

    batches = make_batches(10, seed=4)
    copies, state, step = build()
    for batch in batches[:4]:
        state, _ = step(state, batch)
    stop_copies(state.optimizer, [1])
    save(state, str(tmp_path))
    for batch in batches[4:]:
        state, _ = step(state, batch)
    again, resumed, step = build()
    newest = latest(str(tmp_path))
    assert newest is not None
    resumed = load(newest, resumed)
    assert resumed.optimizer.param_groups[0]["active"].tolist() == [True, False, True]
    for batch in batches[4:]:
        resumed, _ = step(resumed, batch)
    for a, b in zip(copies.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)

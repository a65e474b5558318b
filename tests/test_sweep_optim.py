"""The sweep optimizers against torch.optim, given the same gradients: in float32 the same
parameters bit for bit (the same operations in the same order, the hyper-parameters' arithmetic
in float64 as torch.optim's on Python floats). They update every parameter of a dtype as one
flat ``[N, D]`` tensor (``steplib.sweep.flat_state``), and what torch.optim does per parameter
still holds: a parameter without a gradient keeps its state and count, a state loaded into the
same optimizer is the one it continues from, and the state keeps torch.optim's shapes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from steplib.sweep import Copies, SweepAdamW, SweepSGD
from steplib.sweep.per_copy_optimizer import PACK_LIMIT

N = 3
LRS = [1e-2, 3e-2, 1e-1]
WDS = [0.0, 0.01, 0.1]

MAKERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer]]]
MAKERS = {
    "adamw": (
        lambda c: SweepAdamW(c.parameters(), lr=LRS, weight_decay=WDS),
        lambda m, i: torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WDS[i]),
    ),
    "sgd": (
        lambda c: SweepSGD(c.parameters(), lr=LRS, momentum=0.9, weight_decay=WDS),
        lambda m, i: torch.optim.SGD(m.parameters(), lr=LRS[i], momentum=0.9, weight_decay=WDS[i]),
    ),
}


def models(wide: int = 0) -> list[nn.Module]:
    """Two small layers; with ``wide``, a third whose weight is over PACK_LIMIT across the
    copies (updated alone, through a view, rather than packed with the others)."""
    out: list[nn.Module] = []
    for i in range(N):
        torch.manual_seed(i)
        layers = [nn.Linear(4, 3), nn.Linear(3, 2)]
        if wide:
            layers.append(nn.Linear(2, wide))
        out.append(nn.Sequential(*layers).double())
    return out


def grads(update: int) -> list[torch.Tensor | None]:
    """Every copy's gradients at ``update`` (stacked); the last bias has none before update 2
    and at every third one after."""
    gen = torch.Generator().manual_seed(update)
    shapes = [(N, 3, 4), (N, 3), (N, 2, 3), (N, 2)]
    out: list[torch.Tensor | None] = [
        torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes
    ]
    if update < 2 or update % 3 == 0:
        out[-1] = None
    return out


def sweep_update(opt: torch.optim.Optimizer, copies: Copies, update: int) -> None:
    for p, g in zip(copies.parameters(), grads(update), strict=True):
        p.grad = g
    opt.step()


def same_gradients(
    opt: torch.optim.Optimizer,
    copies: Copies,
    opts: Sequence[torch.optim.Optimizer],
    plain: Sequence[nn.Module],
    *,
    updates: int,
) -> None:
    """``updates`` updates of the sweep and of each plain run, from the same random gradients
    (drawn in float32, cast to the parameters' dtype)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(updates):
        stacked = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in copies.parameters()]
        for p, g in zip(copies.parameters(), stacked, strict=True):
            p.grad = g
        opt.step()
        for i, (model, plain_opt) in enumerate(zip(plain, opts, strict=True)):
            for p, g in zip(model.parameters(), stacked, strict=True):
                p.grad = g[i].clone()
            plain_opt.step()


@pytest.mark.parametrize("wide", [0, PACK_LIMIT // N // 2 + 1])
def test_sweep_adamw_float32_equals_torch_adamw_bit_for_bit_given_the_same_gradients(
    wide: int,
) -> None:
    """AdamW only: torch's Adam with L2 decay and its SGD add with ``alpha=``, a fused
    multiply-add in their vector kernels that no operation with a per-copy tensor reproduces
    (their law is float64 within 1e-12, tests/test_sweep_exactness.py)."""
    betas = [(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)]
    plain = [m.float() for m in models(wide)]
    opts = [
        torch.optim.AdamW(m.parameters(), lr=LRS[i], betas=betas[i], weight_decay=WDS[i])
        for i, m in enumerate(plain)
    ]
    copies = Copies.stack([m.float() for m in models(wide)])
    assert wide == 0 or list(copies.parameters())[-2].numel() > PACK_LIMIT
    opt = SweepAdamW(
        copies.parameters(),
        lr=LRS,
        beta1=[b[0] for b in betas],
        beta2=[b[1] for b in betas],
        weight_decay=WDS,
    )
    same_gradients(opt, copies, opts, plain, updates=100)
    for i, model in enumerate(plain):
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            assert torch.equal(mine, theirs), (mine - theirs).abs().max().item()


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_parameter_without_a_gradient_keeps_its_state_and_count_as_torch_optim(
    kind: str,
) -> None:
    make_sweep, make_plain = MAKERS[kind]
    plain = models()
    opts = [make_plain(m, i) for i, m in enumerate(plain)]
    copies = Copies.stack(models())
    opt = make_sweep(copies)
    for update in range(12):
        sweep_update(opt, copies, update)
        for i, (model, plain_opt) in enumerate(zip(plain, opts, strict=True)):
            for p, g in zip(model.parameters(), grads(update), strict=True):
                p.grad = None if g is None else g[i].clone()
            plain_opt.step()
    for i, model in enumerate(plain):
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            assert (mine - theirs).abs().max().item() <= 1e-12
    last_bias = list(copies.parameters())[-1]
    assert torch.equal(opt.state[last_bias]["step"], torch.full((N,), 7.0, dtype=torch.float64))
    for p in copies.parameters():  # torch.optim's shapes: step [N], buffers as the parameter
        for key, value in opt.state[p].items():
            assert value.shape == ((N,) if key == "step" else p.shape), key


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_state_loaded_into_the_same_optimizer_is_the_one_it_continues_from(kind: str) -> None:
    copies = Copies.stack(models())
    opt = MAKERS[kind][0](copies)
    for update in range(4):
        sweep_update(opt, copies, update)
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_params = copy.deepcopy(copies.state_dict())
    for update in range(4, 8):
        sweep_update(opt, copies, update)
    straight = [p.detach().clone() for p in copies.parameters()]
    copies.load_state_dict(saved_params)
    opt.load_state_dict(saved_opt)  # new state tensors: the optimizer must use these
    for update in range(4, 8):
        sweep_update(opt, copies, update)
    for a, b in zip(straight, copies.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_state_tensor_replaced_by_hand_is_the_one_it_continues_from(kind: str) -> None:
    def run(reset: Callable[[torch.optim.Optimizer, torch.Tensor], None]) -> list[torch.Tensor]:
        copies = Copies.stack(models())
        opt = MAKERS[kind][0](copies)
        for update in range(2, 5):
            sweep_update(opt, copies, update)
        reset(opt, next(copies.parameters()))
        for update in range(5, 8):
            sweep_update(opt, copies, update)
        return [p.detach().clone() for p in copies.parameters()]

    key = SweepAdamW.state_keys[0] if kind == "adamw" else SweepSGD.state_keys[0]
    in_place = run(lambda opt, w: opt.state[w][key].zero_())
    replaced = run(lambda opt, w: opt.state[w].__setitem__(key, torch.zeros_like(w)))
    untouched = run(lambda opt, w: None)
    for a, b in zip(in_place, replaced, strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(in_place, untouched, strict=True))


def test_a_deep_copy_of_a_sweep_optimizer_steps_on_its_own() -> None:
    copies = Copies.stack(models())
    opt = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=WDS)
    sweep_update(opt, copies, 2)
    twin = copy.deepcopy(opt)  # its own parameters and state (torch.optim's __getstate__)
    assert twin.n == N
    first = next(copies.parameters())
    before = {key: value.clone() for key, value in opt.state[first].items()}
    for p, g in zip(twin.param_groups[0]["params"], grads(5), strict=True):
        p.grad = g
    twin.step()
    twin_first = twin.param_groups[0]["params"][0]
    assert torch.equal(twin.state[twin_first]["step"], torch.full((N,), 2.0, dtype=torch.float64))
    for key, value in opt.state[first].items():
        assert torch.equal(value, before[key]), key


def test_a_bfloat16_sweep_counts_every_update_as_torch_adamw_does() -> None:
    """The step counts are kept in float32, as torch.optim keeps them: in bfloat16 a count
    stops at 256, and so would Adam's bias correction (each update too small by a third at
    600 updates, in every copy)."""
    plain = [m.bfloat16() for m in models()]
    opts = [
        torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=0.0) for i, m in enumerate(plain)
    ]
    copies = Copies.stack([m.bfloat16() for m in models()])
    opt = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=0.0)
    same_gradients(opt, copies, opts, plain, updates=600)
    for p in copies.parameters():
        assert torch.equal(opt.state[p]["step"], torch.full((N,), 600.0))
    for i, model in enumerate(plain):
        for mine, theirs in zip(copies.copy(i).parameters(), model.parameters(), strict=True):
            # bfloat16 roundings apart (the hyper-parameters are cast to it), not a third
            assert (mine.float() - theirs.float()).abs().max().item() <= 2 * LRS[i]

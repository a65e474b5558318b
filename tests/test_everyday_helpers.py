"""The everyday helpers of issue 16: ``token_cross_entropy`` (the right loss the easy way),
``AbsoluteLR`` (nanoGPT's ``get_lr(it)`` as a scheduler, exactly), and ``to_device=True``
(the batch moved to the model's device without a line of user code)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import steplib.data.device
from steplib import TrainState, accumulate, make_eval_step, make_train_step
from steplib.errors import ConfigError
from steplib.losses import token_cross_entropy
from steplib.schedules import AbsoluteLR

VOCAB = 7


def _lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def _batches(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for valid in lengths:  # rows of 6 positions, `valid` of them real targets per row
        x = torch.randint(0, VOCAB, (2, 6), generator=gen)
        y = torch.randint(0, VOCAB, (2, 6), generator=gen)
        y[:, valid:] = -100
        out.append((x, y))
    return out


def test_token_cross_entropy_is_the_sum_over_real_targets_and_their_count() -> None:
    logits = torch.randn(2, 6, VOCAB)
    _, y = _batches([4])[0]
    loss_sum, count = token_cross_entropy(logits, y)
    mask = y != -100
    assert int(count) == int(mask.sum()) == 8
    torch.testing.assert_close(loss_sum, F.cross_entropy(logits[mask], y[mask], reduction="sum"))


def test_token_cross_entropy_makes_accumulation_exact_where_a_mean_is_not() -> None:
    micro = _batches([1, 6])  # 2 and 12 real targets: very unequal micro-batches

    def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        return token_cross_entropy(model(x), y)

    model = _lm()
    reference = copy.deepcopy(model)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = accumulate(make_train_step(loss_fn), 2)
    for batch in micro:
        state, _ = step(state, batch)
    x, y = (torch.cat(parts) for parts in zip(*micro, strict=True))
    F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1)).backward()  # one big batch
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_token_cross_entropy_refuses_mismatched_shapes() -> None:
    with pytest.raises(ConfigError, match=r"logits \(B, T, V\) and targets \(B, T\)"):
        token_cross_entropy(torch.zeros(2, 6, VOCAB), torch.zeros(2, 5, dtype=torch.long))


def _get_lr(it: int) -> float:  # nanoGPT's: warmup, cosine decay, floor
    warmup, decay, top, low = 3, 10, 6e-4, 6e-5
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    if it > decay:
        return low
    ratio = (it - warmup) / (decay - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - low)


def test_absolute_lr_gives_every_update_exactly_nanogpts_rate() -> None:
    batches = _batches([6] * 14)

    def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        return token_cross_entropy(model(x), y)

    model = _lm()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    state = TrainState.create(model=model, optimizer=opt, scheduler=AbsoluteLR(opt, _get_lr))
    step = make_train_step(loss_fn)
    rates = []
    for batch in batches:
        state, out = step(state, batch)
        rates.append(out.lr.item())

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1.0)
    for it, (x, y) in enumerate(batches):  # nanoGPT's loop
        for group in ref_opt.param_groups:
            group["lr"] = _get_lr(it)
        loss_sum, count = token_cross_entropy(reference(x), y)
        (loss_sum / count).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert rates == [_get_lr(it) for it in range(len(batches))]  # exactly, not within 1e-19
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_absolute_lr_resumes_from_its_state_dict_without_the_function() -> None:
    opt = torch.optim.SGD(_lm().parameters(), lr=0.0)
    sched = AbsoluteLR(opt, _get_lr)
    for _ in range(5):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    assert "lr_fn" not in saved and "optimizer" not in saved
    fresh_opt = torch.optim.SGD(_lm().parameters(), lr=0.0)
    fresh = AbsoluteLR(fresh_opt, _get_lr)
    fresh.load_state_dict(saved)
    fresh_opt.step()
    fresh.step()
    sched.step()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == _get_lr(6)
    with pytest.raises(ConfigError, match="not callable"):
        AbsoluteLR(opt, 0.1)  # type: ignore[arg-type]


def test_absolute_lr_refuses_groups_with_different_rates() -> None:
    # It gives every group lr_fn(n): a head at 10x the backbone's rate trained at the
    # backbone's, in silence (both groups were set to lr_fn(0)).
    model = _lm()
    params = list(model.parameters())
    groups: list[dict[str, Any]] = [{"params": params[:1], "lr": 1e-2}, {"params": params[1:]}]
    opt = torch.optim.SGD(groups, lr=1e-3)
    with pytest.raises(ConfigError, match=r"rates \[0.01, 0.001\].*LambdaLR"):
        AbsoluteLR(opt, _get_lr)
    same = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3)
    AbsoluteLR(same, _get_lr)  # one rate, given to every group: as documented
    assert [group["lr"] for group in same.param_groups] == [_get_lr(0)] * 2


def test_to_device_moves_every_tensor_of_the_batch_to_the_models_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moved: list[Any] = []
    real = steplib.data.device.to_device

    def recording(batch: Any, device: Any) -> Any:
        if isinstance(batch, tuple):  # the whole batch, not the recursion into its tensors
            moved.append(device)
        return real(batch, device)

    monkeypatch.setattr(steplib.data.device, "to_device", recording)
    model = _lm()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, b: token_cross_entropy(m(b[0]), b[1]), to_device=True)
    state, _ = step(state, _batches([3])[0])
    eval_step = make_eval_step(lambda m, b: m(b[0]).argmax(-1), to_device=True)
    eval_step(model, _batches([3])[0])
    assert moved == [torch.device("cpu"), torch.device("cpu")]
    plain = make_train_step(lambda m, b: token_cross_entropy(m(b[0]), b[1]))
    plain(state, _batches([3])[0])
    assert len(moved) == 2  # off by default: no per-batch cost


@pytest.mark.gpu
def test_to_device_trains_a_cuda_model_on_a_cpu_batch() -> None:
    model = _lm().cuda()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_train_step(lambda m, b: token_cross_entropy(m(b[0]), b[1]), to_device=True)
    state, out = step(state, _batches([3])[0])
    assert out.loss.device.type == "cuda" and state.step == 1

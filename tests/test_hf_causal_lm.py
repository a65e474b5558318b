"""A Hugging Face causal LM trained with steplib (examples/hf_causal_lm.py): the accumulated
gradient is the full-batch gradient of the next-token mean; the model's own mean ``.loss``
under accumulation, and the unshifted ``token_cross_entropy``, are not."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import steplib as sl
from steplib.losses import causal_lm_loss, token_cross_entropy

pytest.importorskip("transformers")

K = 4  # micro-batches per update


def _example() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_causal_lm.py"
    spec = importlib.util.spec_from_file_location("hf_causal_lm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _example()


def _full_batch_gradient(ex: ModuleType, model: torch.nn.Module, micro: list[Any]) -> list[Any]:
    """The ground truth: one forward of every row, padded to one width, the mean cross-entropy
    of the logits at t against the token at t + 1 over the real tokens."""
    rows = [
        row[mask.bool()]
        for b in micro
        for row, mask in zip(b["input_ids"], b["attention_mask"], strict=True)
    ]
    batch = ex.pad(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100
    )
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _accumulated_gradient(
    ex: ModuleType, model: torch.nn.Module, micro: list[Any], loss_fn: Callable[..., Any]
) -> list[Any]:
    """The gradient steplib's update applies: read before the optimizer step (lr=0: the model
    is left as it was)."""
    seen: list[list[torch.Tensor]] = []
    record = lambda s: seen.append([p.grad.clone() for p in s.model.parameters()])  # noqa: E731
    step = sl.tap(sl.accumulate(sl.make_train_step(loss_fn), K), before_update=record)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    for batch in micro:
        state, _ = step(state, batch)
    assert len(seen) == 1
    return seen[0]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_accumulated_causal_lm_gradient_equals_the_full_batch_gradient(
    example: ModuleType,
) -> None:
    micro = example.micro_batches(K)
    widths = [b["input_ids"].shape[1] for b in micro]
    targets = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert len(set(widths)) > 1 and len(set(targets)) > 1  # unequal padding and token counts
    model = example.build_model()
    truth = _full_batch_gradient(example, copy.deepcopy(model), micro)
    steplib_grads = _accumulated_gradient(example, model, micro, example.loss_fn)
    assert _max_difference(steplib_grads, truth) < 1e-6


def test_the_models_own_mean_loss_under_accumulation_is_the_pitfall(
    example: ModuleType,
) -> None:
    micro = example.micro_batches(K)
    model = example.build_model()
    truth = _full_batch_gradient(example, copy.deepcopy(model), micro)

    def own_mean(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model(**batch).loss  # each micro-batch's mean: micro-batches weigh alike

    def own_mean_times_count(model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
        count = (batch["labels"][:, 1:] != -100).sum()  # the count of the SHIFTED labels
        return model(**batch).loss * count, count

    pitfall = _max_difference(_accumulated_gradient(example, model, micro, own_mean), truth)
    print(f"the model's own mean .loss under accumulate({K}): gradient off by {pitfall:.2e}")
    assert pitfall > 1e-4
    fixed = _accumulated_gradient(example, model, micro, own_mean_times_count)
    assert _max_difference(fixed, truth) < 1e-6


def test_causal_lm_loss_is_the_models_own_loss_and_the_unshifted_one_is_not(
    example: ModuleType,
) -> None:
    batch = example.micro_batches(1)[0]
    model = example.build_model()
    with torch.no_grad():
        own = model(**batch).loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss_sum, count = causal_lm_loss(logits, batch["labels"])
    assert int(count) == int((batch["labels"][:, 1:] != -100).sum())
    assert abs(float(loss_sum / count) - float(own)) < 1e-6
    unshifted_sum, unshifted_count = token_cross_entropy(logits, batch["labels"])
    off = abs(float(unshifted_sum / unshifted_count) - float(own))
    print(f"token_cross_entropy on the unshifted labels: the loss is off by {off:.3f}")
    assert off > 1e-2


def test_causal_lm_loss_refuses_labels_of_another_shape() -> None:
    with pytest.raises(sl.ConfigError, match="shifts them itself"):
        causal_lm_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


def test_the_example_trains(example: ModuleType) -> None:
    losses = example.main(updates=4, accumulation=2)
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_the_models_own_mean_times_its_count_is_nan_on_a_micro_batch_without_targets(
    example: ModuleType,
) -> None:
    # docs/migration/hf_trainer.md: the model's mean over no token is NaN, and NaN * 0 is NaN,
    # so skip_nonfinite skips a window whose gradient is finite; causal_lm_loss adds 0 there.
    micro = example.micro_batches(2)
    micro[1]["labels"][:] = -100  # prompts whose answers were cut off

    def own_mean_times_count(model: torch.nn.Module, batch: Any) -> tuple[Any, Any]:
        count = (batch["labels"][:, 1:] != -100).sum()
        return model(**batch).loss * count, count

    def last_window(loss_fn: Callable[..., Any]) -> Any:
        model = example.build_model()
        state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        step = sl.skip_nonfinite(sl.accumulate(sl.make_train_step(loss_fn), 2))
        for batch in micro:
            state, out = step(state, batch)
        return out

    own = last_window(own_mean_times_count)
    assert torch.isnan(own.loss) and bool(own.skipped)
    assert torch.isfinite(own.grad_norm)  # the gradient was fine: the update was lost
    summed = last_window(example.loss_fn)
    assert torch.isfinite(summed.loss) and bool(summed.did_update)

"""compile_step: numerically equal to the eager step, recompilations counted, applied last."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, TrainState, accumulate, clip, make_train_step, warmup_cosine
from steplib.step.compile import compile_step


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _data(n: int, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 64, generator=gen), torch.randn(size, 1, generator=gen))
        for _ in range(n)
    ]


def _train(step, updates: int, batches) -> tuple[nn.Module, list[torch.Tensor]]:
    # SGD with momentum and a changing LR. AdamW is not compared here: its compiled update
    # drifts from eager by up to ~1e-3 over 200 updates, not yet understood (issue 3's note).
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=20, total=updates))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    losses = []
    for i in range(updates * 4):
        state, out = step(state, batches[i % len(batches)])
        if state.window_size == 0:
            losses.append(out.loss)
    return model, losses


def test_compiled_step_equals_eager_within_1e5_after_200_updates_without_recompiling() -> None:
    batches = _data(16)
    eager = accumulate(clip(make_train_step(_loss), max_norm=1.0), 4)
    compiled = compile_step(eager)
    eager_model, eager_losses = _train(eager, 200, batches)
    model, losses = _train(compiled, 200, batches)
    for got, want in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), atol=1e-5, rtol=1e-5)
    stats = compiled.compile_stats
    assert stats.graphs >= 2  # at least the forward and the optimizer update
    assert stats.recompiles == 0  # the LR changed on every update, as a tensor: no recompile


def test_a_new_input_shape_after_warm_up_is_counted_as_a_recompile() -> None:
    step = compile_step(make_train_step(_loss), backend="aot_eager", dynamic=False)
    model = _mlp()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in _data(4):
        state, _ = step(state, batch)
    assert step.compile_stats.warm and step.compile_stats.recompiles == 0
    state, _ = step(state, _data(1, size=7)[0])
    assert step.compile_stats.recompiles >= 1


def test_wrapping_after_compile_step_is_refused_with_the_fix() -> None:
    compiled = compile_step(make_train_step(_loss), backend="aot_eager")
    with pytest.raises(ConfigError, match=r"Apply compile_step last: compile_step\(clip"):
        clip(compiled, max_norm=1.0)


def test_unknown_compile_argument_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"torch\.compile does not take"):
        compile_step(make_train_step(_loss), fullgrahp=True)

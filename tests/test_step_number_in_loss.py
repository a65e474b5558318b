"""The step number visible to the loss (issue 17, fairseq2's ``set_step_nr``): a
``loss_fn(model, batch, step)`` receives ``state.step`` as a device tensor; an annealed
coefficient equals a plain loop's; no host read; compile_step does not recompile per update."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib import TrainState, accumulate, make_train_step
from steplib.step.compile import compile_stats, compile_step
from steplib.testing import assert_no_host_sync
from tests.reference import make_batches, tiny_model

WARMUP = 4  # the auxiliary term's weight ramps from 0 to 1 over 4 updates


def annealed(model: nn.Module, batch: Any, step: torch.Tensor) -> torch.Tensor:
    x, y, _ = batch
    out = model(x)
    weight = torch.clamp(step / WARMUP, max=1.0)
    return F.mse_loss(out, y) + weight * out.pow(2).mean()


def test_an_annealed_coefficient_equals_the_plain_loop_with_accumulation() -> None:
    batches = make_batches(12)
    ref = tiny_model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for update in range(6):  # 2 micro-batches per update, as accumulate(.., 2) below
        for batch in batches[2 * update : 2 * update + 2]:
            (annealed(ref, batch, torch.tensor(update)) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[torch.Tensor] = []

    def recording(model: nn.Module, batch: Any, step: torch.Tensor) -> torch.Tensor:
        seen.append(step.clone())
        return annealed(model, batch, step)

    step = accumulate(make_train_step(recording), 2)
    for batch in batches:
        state, _ = step(state, batch)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(got, want)
    assert [int(s) for s in seen] == [u for u in range(6) for _ in range(2)]
    assert all(s.dtype == torch.int64 and s.device == state.device for s in seen)


def test_the_step_follows_a_state_whose_counter_was_set_as_a_load_does() -> None:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    seen: list[int] = []

    def recording(model: nn.Module, batch: Any, step: torch.Tensor) -> torch.Tensor:
        seen.append(int(step))
        return annealed(model, batch, step)

    step = make_train_step(recording)
    batches = make_batches(3)
    state, _ = step(state, batches[0])
    state = state.replace(step=10)  # what load does with the saved counters
    state, _ = step(state, batches[1])
    state, _ = step(state, batches[2])
    assert seen == [0, 10, 11]


def test_a_loss_that_takes_the_step_reads_nothing_on_the_host() -> None:
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(annealed), 2)
    batches = make_batches(4)
    state = assert_no_host_sync(step, state, batches)
    assert state.step == 2


def test_compile_step_does_not_recompile_as_the_step_advances() -> None:
    batches = make_batches(8)
    model = tiny_model(0)
    eager_model = tiny_model(0)
    compiled = compile_step(make_train_step(annealed))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    eager = TrainState.create(
        model=eager_model, optimizer=torch.optim.SGD(eager_model.parameters(), lr=0.1)
    )
    eager_step = make_train_step(annealed)
    for batch in batches:
        state, _ = compiled(state, batch)
        eager, _ = eager_step(eager, batch)
    for got, want in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    stats = compile_stats(compiled)
    assert stats.warm and stats.recompiles == 0


def test_an_in_place_add_to_the_step_in_the_loss_changes_nothing_outside() -> None:
    seen: list[int] = []

    def counting(model: nn.Module, batch: Any, step: torch.Tensor) -> torch.Tensor:
        seen.append(int(step))
        step += 1  # an in-place add on the tensor the loss was given
        return annealed(model, batch, step)

    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(counting), 2)
    for batch in make_batches(6):
        state, _ = step(state, batch)
    assert seen == [0, 0, 1, 1, 2, 2]


def test_a_step_parameter_with_a_default_or_keyword_only_receives_the_step() -> None:
    def with_default(model: nn.Module, batch: Any, step: Any = None) -> torch.Tensor:
        assert isinstance(step, torch.Tensor), "the default was kept"
        seen.append(int(step))
        return annealed(model, batch, step)

    def keyword_only(model: nn.Module, batch: Any, *, step: torch.Tensor) -> torch.Tensor:
        seen.append(int(step))
        return annealed(model, batch, step)

    def other_default(model: nn.Module, batch: Any, scale: float = 1.0) -> torch.Tensor:
        x, y, _ = batch
        return F.mse_loss(model(x) * scale, y)  # a step here would be a tensor, not 1.0

    for loss_fn in (with_default, keyword_only):
        seen: list[int] = []
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainState.create(model=model, optimizer=opt)
        step = make_train_step(loss_fn)  # type: ignore[arg-type]  # step by keyword
        for batch in make_batches(3):
            state, _ = step(state, batch)
        assert seen == [0, 1, 2]
    assert not make_train_step(other_default).takes_step

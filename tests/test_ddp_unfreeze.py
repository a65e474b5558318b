"""Unfreezing under DDP: a DistributedDataParallel module synchronises the parameters that took
gradients when it was built, alone. One unfrozen since would be trained by each rank on its own
gradient, the ranks drifting apart in silence: ``ddp_wrap`` refuses it with the fix, and the
fix (built trainable with ``find_unused_parameters=True``, then frozen) equals one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, TrainState, ddp_wrap, make_train_step
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks

UPDATES, UNFREEZE_AT = 4, 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(update: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * update + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _train(rank: int, *, trainable_when_built: bool) -> tuple[list[torch.Tensor], str]:
    model = _model()
    if not trainable_when_built:
        model[0].requires_grad_(False)
    ddp = apply_ddp(model, find_unused_parameters=trainable_when_built)
    model[0].requires_grad_(False)  # the body starts frozen either way
    state = TrainState.create(model=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1))
    step, refused = ddp_wrap(make_train_step(_loss)), ""
    try:
        for update in range(UPDATES):
            if update == UNFREEZE_AT:
                model[0].requires_grad_(True)
            state, _ = step(state, _batch(update, rank))
    except ConfigError as error:
        refused = f"{state.step}: {error}"
    weights = [p.detach().clone() for p in model.parameters()]
    del ddp, state
    return weights, refused


def test_a_parameter_unfrozen_since_its_ddp_module_was_built_is_refused_on_every_rank() -> None:
    results = run_ranks(lambda rank, world: _train(rank, trainable_when_built=False))
    for _, refused in results:
        assert refused.startswith(f"{UNFREEZE_AT}: ddp_wrap: the DistributedDataParallel"), refused
        assert "has 4 parameters that take gradients, 2 when it was built" in refused
        assert "apply_ddp(model, find_unused_parameters=True)" in refused
    (first, _), (second, _) = results
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_built_trainable_then_frozen_the_unfrozen_body_trains_as_in_one_process() -> None:
    results = run_ranks(lambda rank, world: _train(rank, trainable_when_built=True))
    model = _model()  # the plain loop over both ranks' batches at once
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for update in range(UPDATES):
        if update == UNFREEZE_AT:
            model[0].requires_grad_(True)
        both = zip(_batch(update, 0), _batch(update, 1), strict=True)
        x, y = (torch.cat(parts) for parts in both)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for weights, refused in results:
        assert refused == ""
        for got, want in zip(weights, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)

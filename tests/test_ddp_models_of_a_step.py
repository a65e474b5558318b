"""ddp_wrap on a state holding several models: every parameter the step's optimizer updates
must have its gradient averaged over the ranks, against a plain one-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from steplib import ConfigError, TrainState, accumulate, ddp_wrap, make_train_step
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks
from tests.reference import concat, make_batches

K = 2
SIZES = [3, 4, 2, 5]  # unequal per micro-batch and per rank (token weighting across ranks)


def _body_and_head() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 3)


def _loss(models: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, mask = batch
    err = (models["head"](models["body"](x)).reshape(-1) - y) ** 2
    return (err * mask).sum(), mask.sum()


def _head_outside_ddp(rank: int, world: int) -> str:
    body, head = _body_and_head()
    body = apply_ddp(body)  # the head is not wrapped: its gradients would stay per rank
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    state = TrainState.create(model={"body": body, "head": head}, optimizer={"main": optimizer})
    step = ddp_wrap(accumulate(make_train_step(_loss, optimizer="main"), K))
    try:
        for batch in make_batches(2 * K, SIZES, seed=7)[rank * K : (rank + 1) * K]:
            state, _ = step(state, batch)
    except ConfigError as err:
        message = str(err)
    else:
        message = "no error"
    del body, state, step
    return message


def test_an_optimizer_over_parameters_outside_every_ddp_module_is_refused_with_the_fix() -> None:
    for message in run_ranks(_head_outside_ddp):
        assert "outside every DistributedDataParallel module" in message, message
        assert "'head.weight'" in message and "'head.bias'" in message
        assert "'head': apply_ddp(" in message


def _student(rank: int, world: int) -> list[torch.Tensor]:
    body, head = _body_and_head()
    head.requires_grad_(False)  # a frozen teacher beside a student, one (unnamed) optimizer
    body = apply_ddp(body)
    optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    state = TrainState.create(model={"body": body, "head": head}, optimizer=optimizer)
    step = ddp_wrap(accumulate(make_train_step(_loss), K))
    for batch in make_batches(2 * K, SIZES, seed=7)[rank * K : (rank + 1) * K]:
        state, _ = step(state, batch)
    params = [p.detach().clone() for p in body.module.parameters()]
    del body, state, step
    return params


def test_a_student_beside_a_frozen_model_with_one_optimizer_equals_one_process() -> None:
    body, head = _body_and_head()
    head.requires_grad_(False)
    optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    loss_sum, count = _loss(
        {"body": body, "head": head}, concat(make_batches(2 * K, SIZES, seed=7))
    )
    (loss_sum / count).backward()
    optimizer.step()
    for params in run_ranks(_student):
        for got, want in zip(params, body.parameters(), strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

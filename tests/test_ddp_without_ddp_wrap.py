"""A token-weighted step on a DDP model of several ranks without ``ddp_wrap``: DDP averages the
gradients over the ranks at each backward, and each rank would divide them by its own
window's count (a wrong update wherever the counts differ). Refused at the first update, as
for FSDP2 (tests/test_torchtitan_port.py); a mean loss (no count), or the step wrapped, trains.
"""

from __future__ import annotations

from typing import Any

import torch

from steplib import ConfigError, TrainState, ddp_wrap, make_train_step, run
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks


def _outcomes(rank: int, world: int) -> dict[str, str]:
    out = {}
    for case in ("token_weighted", "mean", "wrapped"):
        model: Any = apply_ddp(torch.nn.Linear(2, 1))
        state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        if case == "mean":
            step = make_train_step(lambda m, b: m(b).pow(2).mean())
        else:  # each rank holds another number of targets
            step = make_train_step(lambda m, b: (m(b).pow(2).sum(), torch.tensor(len(b))))
        step = ddp_wrap(step) if case == "wrapped" else step
        data = [torch.ones(2 + rank, 2)] * 2
        try:
            run(step, state, data, max_steps=1)
            out[case] = "trained"
        except ConfigError as err:
            out[case] = str(err)
        del model, state, step
    return out


def test_a_token_weighted_step_on_a_ddp_model_without_ddp_wrap_is_refused() -> None:
    for rank in run_ranks(_outcomes):
        assert "DistributedDataParallel model on 2 ranks without ddp_wrap" in rank["token_weighted"]
        assert "ddp_wrap(step) for a DDP one" in rank["token_weighted"]
        assert rank["mean"] == "trained" and rank["wrapped"] == "trained"

"""The first mistake of data parallelism: a ``DataLoader`` without a ``DistributedSampler``
under ``torchrun`` gives every rank the same batches, and each update averages copies of one
gradient (the run is one process's, at the cost of several). Lightning and Accelerate replace
the sampler; steplib's ``run`` warns at the run's first batch (one ``all_gather_object`` of a
digest) when the step is data-parallel (``ddp_wrap``, ``fsdp_wrap``). Before, nothing was said:
pytorch/examples' FSDP2 example has it (tests/test_fsdp2_example_port.py)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import steplib as sl
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks

DATA = TensorDataset(torch.arange(16.0).unsqueeze(1))


def _warned(rank: int, world: int) -> dict[str, list[str]]:
    out = {}
    for case in ("same", "sharded", "not_parallel", "objects"):
        model: Any = torch.nn.Linear(1, 1)
        model = model if case == "not_parallel" else apply_ddp(model)
        state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        step = sl.make_train_step(lambda m, b: m(b[0]).pow(2).mean())
        step = step if case == "not_parallel" else sl.ddp_wrap(step)
        sampler: Any = DistributedSampler(DATA, shuffle=False) if case == "sharded" else None
        data: Any = DataLoader(DATA, batch_size=4, sampler=sampler)
        if case == "objects":  # an object in the batch: not compared
            data = [(batch[0], object()) for batch in data]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sl.run(step, state, data, max_steps=2)
        out[case] = [str(w.message) for w in caught]
        del model, state, step
    return out


def test_every_rank_given_the_same_batch_by_a_data_parallel_step_is_warned_about() -> None:
    for rank in run_ranks(_warned):
        assert len(rank["same"]) == 1
        assert "every one of the 2 ranks was given the same first batch" in rank["same"][0]
        assert "(ddp_wrap)" in rank["same"][0] and "DistributedSampler" in rank["same"][0]
        assert rank["sharded"] == []  # each rank its own share
        assert rank["not_parallel"] == []  # no gradient averaged (tensor parallel alike)
        assert rank["objects"] == []  # cannot tell: not said

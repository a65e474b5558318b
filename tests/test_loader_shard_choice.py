"""resumable_loader on several ranks: the ranks share the data out (shard=True) or each reads
its own whole dataset (shard=False) because someone said so; left unsaid, the same dataset and
seed would give every rank the same batches, and each update would average copies of one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from steplib import ConfigError
from steplib.data import resumable_loader
from steplib.testing import run_ranks

DATA = torch.arange(10)


def _epoch(loader: Any) -> list[int]:
    return [i for batch in loader for i in batch.tolist()]


def _unsaid(rank: int, world: int) -> str:
    try:
        resumable_loader(DATA, batch_size=2, seed=0)
    except ConfigError as err:
        return str(err)
    return "no error"


def test_a_loader_without_shard_on_two_ranks_is_refused_with_both_fixes() -> None:
    for message in run_ranks(_unsaid):
        assert "runs on 2 ranks without shard=" in message, message
        assert "the same batches" in message
        assert "shard=True" in message and "shard=False" in message


def _said(rank: int, world: int) -> dict[str, list[int]]:
    return {
        "sharded": _epoch(resumable_loader(DATA, batch_size=2, seed=0, shard=True)),
        "whole": _epoch(resumable_loader(DATA, batch_size=2, seed=0, shard=False)),
    }


def test_shard_true_shares_every_sample_once_and_shard_false_gives_each_rank_all() -> None:
    first, second = run_ranks(_said)
    assert sorted(first["sharded"] + second["sharded"]) == list(range(10))
    assert first["whole"] == second["whole"] and sorted(first["whole"]) == list(range(10))


@pytest.mark.parametrize("shard", [None, True])
def test_a_loader_built_before_the_process_group_is_refused_at_its_first_pass(shard) -> None:
    loader = resumable_loader(DATA, batch_size=2, seed=0, shard=shard)  # one process here

    def first_pass(rank: int, world: int) -> str:  # forked: in a group of 2
        try:
            _epoch(loader)
        except ConfigError as err:
            return str(err)
        return "no error"

    for message in run_ranks(first_pass):
        if shard:
            assert "built for 1 rank(s) but iterates in a process group of 2" in message
            assert "after steplib.distributed.init_distributed()" in message
        else:
            assert "runs on 2 ranks without shard=" in message, message


def _seed_per_rank(rank: int, world: int) -> str:
    try:
        resumable_loader(DATA, batch_size=2, seed=rank, shard=True)
    except ConfigError as err:
        return str(err)
    return "no error"


def test_shard_true_with_a_seed_per_rank_is_refused_since_samples_would_repeat() -> None:
    # Unrefused, ranks 0 and 1 read [4, 7, 3, 0, 6] and [6, 2, 8, 3, 4]: 3, 4 and 6 twice,
    # 1, 5 and 9 never.
    for message in run_ranks(_seed_per_rank):
        assert "'seed': 0" in message and "'seed': 1" in message, message
        assert "read twice per epoch and others never" in message
        assert "seed=0" in message

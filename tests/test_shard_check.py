"""Bad input: a world size that does not divide the data is refused, with the fix, before a
DistributedSampler silently repeats samples."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from steplib import ConfigError
from steplib.distributed.sharding import shard_check


def test_an_even_split_returns_the_samples_per_rank() -> None:
    assert shard_check(512, world_size=2) == 256
    assert shard_check(7) == 7  # no process group: one process gets everything


def test_a_world_size_that_does_not_divide_the_dataset_is_refused_with_both_fixes() -> None:
    with pytest.raises(ConfigError) as caught:
        shard_check(10, world_size=4)
    message = str(caught.value)
    assert "10 samples do not split evenly across 4 ranks (2 left over)" in message
    assert "repeat 2 samples" in message
    assert "drop_last=True" in message
    assert "Subset(dataset, range(8))" in message
    # What shard_check refuses is what DistributedSampler would do silently.
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        TensorDataset(torch.arange(10)), num_replicas=4, rank=0, shuffle=False
    )
    assert sampler.total_size == 12


def test_dropping_the_rest_on_purpose_matches_distributed_sampler() -> None:
    per_rank = shard_check(10, world_size=4, drop_last=True)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        TensorDataset(torch.arange(10)), num_replicas=4, rank=3, drop_last=True
    )
    assert per_rank == len(sampler) == 2


def test_fewer_samples_than_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="3 samples cannot be shared by 4 ranks"):
        shard_check(3, world_size=4, drop_last=True)


def test_a_global_batch_that_does_not_split_across_the_ranks_is_refused() -> None:
    assert shard_check(64, world_size=4, global_batch_size=32) == 16
    with pytest.raises(ConfigError, match="global_batch_size=30 \\(10 per rank\\)"):
        shard_check(64, world_size=3, global_batch_size=32, drop_last=True)


@pytest.mark.parametrize("bad", [2.0, "8", True, None])
def test_a_dataset_length_that_is_not_an_int_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="dataset_len"):
        shard_check(bad, world_size=2)  # type: ignore[arg-type]

"""The sharded loader's position (``resumable_loader(..., shard=True)``), in one process: the
ranks of several world sizes are simulated by building each rank's loader with its own
``ShardedSampler``. The distributed end-to-end test (4 gloo ranks saving, 2 resuming, against
an uninterrupted 2-rank run) is ``tests/test_resume_other_world_size.py``.

The oracle everywhere: a rank's batches after ``load_state_dict(position)`` are the batches
the same rank of an uninterrupted run on the new world size yields from that point on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from steplib import ConfigError
from steplib.data import ResumableLoader, resumable_loader
from steplib.data.shards import ShardedSampler

SIZE = 48


def _loader(rank: int, world: int, batch_size: int, *, seed: int = 3, **kwargs: Any) -> Any:
    sampler = ShardedSampler(SIZE, rank=rank, world_size=world, seed=seed)
    return ResumableLoader(
        torch.arange(SIZE),
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator(),
        **kwargs,
    )


def _epochs(loader: Any, epochs: int) -> list[list[int]]:
    return [batch.tolist() for _ in range(epochs) for batch in loader]


def _after(loader: Any, batches: int) -> Any:
    """``loader``'s position after ``batches`` batches, crossing epochs as a loop does."""
    done = 0
    while True:
        for _ in loader:
            done += 1
            if done == batches:
                return loader.state_dict()


@pytest.mark.parametrize("batches", [0, 1, 3, 6, 7])  # 6: every batch of epoch 0 yielded
def test_4_ranks_resumed_on_2_yield_what_an_uninterrupted_2_rank_run_yields(
    batches: int,
) -> None:
    # 4 ranks x 2 samples = 8 per global batch, as 2 ranks x 4: 6 batches per epoch.
    position = _after(_loader(0, 4, 2), batches) if batches else _loader(0, 4, 2).state_dict()
    for rank in range(2):
        uninterrupted = _epochs(_loader(rank, 2, 4), 3)
        resumed = _loader(rank, 2, 4)
        resumed.load_state_dict(position)
        epochs_left = 3 - batches // 6
        # Where the continued pass begins in its epoch (run's batch_index; no epoch_start
        # unless 0), read before the pass: iterating resets it.
        assert resumed.resumed_at == (0 if batches == 6 else batches % 6)
        assert _epochs(resumed, epochs_left) == uninterrupted[batches:]
        assert resumed.epoch_completed_on_load == (batches == 6)


def test_a_pass_resumed_on_another_global_batch_begins_at_its_own_batch_index() -> None:
    # 4 ranks x 2 samples consumed 3 x 8 = 24 samples: one rank with batches of 2 (24 a pass)
    # continues at its batch 12, and its batch_index and epoch_start follow from that.
    position = _after(_loader(0, 4, 2), 3)
    resumed = _loader(0, 1, 2)
    resumed.load_state_dict(position)
    assert resumed.resumed_at == 12
    assert [batch.tolist() for batch in resumed] == _epochs(_loader(0, 1, 2), 1)[12:]
    assert resumed.resumed_at == 0  # the next pass begins its epoch


def test_with_workers_the_epochs_and_a_resume_on_another_world_size_are_the_same() -> None:
    # A DataLoader with workers iterates its sampler more than once per pass: that must not
    # move the epoch on.
    assert _epochs(_loader(1, 2, 4, num_workers=2), 2) == _epochs(_loader(1, 2, 4), 2)
    saving = _loader(0, 4, 2, num_workers=2)
    position = _after(saving, 3)
    assert position["sharded"]["epoch"] == 0
    resumed = _loader(1, 2, 4, num_workers=2)
    resumed.load_state_dict(position)
    assert _epochs(resumed, 2) == _epochs(_loader(1, 2, 4), 2)[3:]


def test_the_position_counts_the_samples_of_all_ranks_and_the_uncounted_epoch_end() -> None:
    loader = _loader(1, 4, 2)
    assert _after(loader, 2)["sharded"]["samples"] == 2 * 2 * 4
    ended = _after(_loader(1, 4, 2), 6)["sharded"]
    assert (ended["epoch"], ended["samples"], ended["uncounted_epoch_end"]) == (1, 0, True)
    loader = _loader(1, 4, 2)
    _epochs(loader, 1)  # the pass ended: the loop has counted the epoch
    ended = loader.state_dict()["sharded"]
    assert (ended["epoch"], ended["samples"], ended["uncounted_epoch_end"]) == (1, 0, False)


def test_a_resume_on_the_same_world_size_is_exact_across_epochs_and_reports_its_length() -> None:
    uninterrupted = _epochs(_loader(0, 2, 4), 3)
    for batches in (1, 5, 8):
        resumed = _loader(0, 2, 4)
        resumed.load_state_dict(_after(_loader(0, 2, 4), batches))
        assert len(resumed) == 6 - batches % 6  # the batches left in the interrupted epoch
        assert _epochs(resumed, 3 - batches // 6) == uninterrupted[batches:]


def test_a_resumed_position_can_be_saved_and_resumed_again() -> None:
    first = _loader(0, 4, 2)
    first.load_state_dict(_after(_loader(0, 4, 2), 2))  # resumed at 16 samples
    second = _loader(1, 2, 4)
    second.load_state_dict(_after(first, 2))  # 2 more batches of 8: 32 samples
    assert second.state_dict()["sharded"]["samples"] == 32
    assert _epochs(second, 2) == _epochs(_loader(1, 2, 4), 2)[4:]


def test_every_rank_gets_other_worker_seeds_and_a_resume_gives_them_back() -> None:
    def seeds(loader: Any) -> int:
        iter(loader)
        return int(loader.generator.initial_seed())

    assert seeds(_loader(0, 2, 4)) != seeds(_loader(1, 2, 4))
    resumed = _loader(1, 2, 4)
    resumed.load_state_dict(_after(_loader(1, 4, 2), 9))  # epoch 1
    uninterrupted = _loader(1, 2, 4)
    _epochs(uninterrupted, 1)
    assert seeds(resumed) == seeds(uninterrupted)


def test_a_position_that_no_uninterrupted_run_reaches_is_refused_with_the_batch_size() -> None:
    position = _after(_loader(0, 4, 2), 1)  # 8 samples
    with pytest.raises(ConfigError, match=r"8 samples of epoch 0 .* batch_size=2 on 4 ranks"):
        _loader(0, 4, 3).load_state_dict(position)
    with pytest.raises(ConfigError, match="resume on a number of ranks that divides 8"):
        _loader(0, 3, 2).load_state_dict(position)


def test_another_global_order_is_refused() -> None:
    position = _after(_loader(0, 4, 2), 1)
    with pytest.raises(ConfigError, match=r"\(48, 3, True\); this one has \(48, 4, True\)"):
        _loader(0, 2, 4, seed=4).load_state_dict(position)


def test_sharded_and_per_rank_positions_do_not_mix() -> None:
    plain = resumable_loader(torch.arange(SIZE), batch_size=4, seed=3)
    with pytest.raises(ConfigError, match="not a sharded position"):
        _loader(0, 2, 4).load_state_dict(plain.state_dict())
    with pytest.raises(ConfigError, match="this loader is not sharded"):
        plain.load_state_dict(_loader(0, 2, 4).state_dict())


def test_shard_true_without_a_process_group_is_the_one_rank_of_one() -> None:
    loader = resumable_loader(torch.arange(10), batch_size=4, seed=3, shard=True)
    assert isinstance(loader.sampler, ShardedSampler)
    assert (loader.sampler.rank, loader.sampler.world_size) == (0, 1)
    assert sorted(i for batch in _epochs(loader, 1) for i in batch) == list(range(10))


def test_bad_sampler_arguments_are_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"rank=\.\.\.\) received 2 \(type int\) with world_size=2"
    ):
        ShardedSampler(8, rank=2, world_size=2)
    with pytest.raises(ConfigError, match=r"world_size=\.\.\.\) received 0"):
        ShardedSampler(8, rank=0, world_size=0)

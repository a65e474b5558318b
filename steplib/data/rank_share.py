"""Which samples each rank reads: the checks behind ``resumable_loader(shard=...)``.

On several ranks the same dataset and seed would give every rank the same batches (each
update averaging ``world_size`` copies of one batch), and ranks sharing out different orders
would read some samples twice per epoch and others never. Both train in silence, so both are
refused: when the loader is built, and at its first pass for a loader built before the
process group existed.
"""

from __future__ import annotations

from typing import Any

from steplib.data.shards import ShardedSampler
from steplib.distributed.collectives import first_other
from steplib.distributed.process_group import rank, world_size
from steplib.errors import ConfigError


def share_sampler(
    shard: bool | None, dataset: Any, *, seed: int, shuffle: bool
) -> ShardedSampler | None:
    """The sampler of ``resumable_loader(dataset, shard=shard)`` in this process group:
    ``None`` (every rank reads the whole dataset) or this rank's :class:`ShardedSampler`.

    Raises:
        ConfigError: ``shard`` left unsaid on several ranks; ``shard=True`` with fewer
            samples than ranks, or with another seed, dataset length or ``shuffle`` on some
            rank (one collective).
    """
    ranks = world_size()
    if shard is None and ranks > 1:
        raise ConfigError(unsaid_shard(ranks))
    if not shard:
        return None
    if len(dataset) < ranks:
        raise ConfigError(
            f"resumable_loader(shard=True) received a dataset of {len(dataset)} samples for "
            f"{ranks} ranks: some rank would get no data. Use at most "
            f"{max(len(dataset), 1)} ranks, or a larger dataset."
        )
    if ranks > 1:
        _check_one_order({"seed": seed, "len(dataset)": len(dataset), "shuffle": shuffle})
    return ShardedSampler(len(dataset), rank=rank(), world_size=ranks, seed=seed, shuffle=shuffle)


def check_still_shared(built_for: int | None, *, sharded: bool, unsaid: bool) -> None:
    """Refuse, at a pass, a loader built for ``built_for`` ranks (``None``: not built by
    ``resumable_loader``) that now iterates in a process group of another size: built before
    ``init_distributed()``, it would give every rank the whole dataset in the same order."""
    ranks = world_size()
    if built_for is None or ranks in (1, built_for):
        return
    if sharded:
        raise ConfigError(
            f"resumable_loader(shard=True) was built for {built_for} rank(s) but iterates in "
            f"a process group of {ranks}: it was built before init_distributed(), so every "
            "rank would read the whole dataset. Build the loader after "
            "steplib.distributed.init_distributed()."
        )
    if unsaid:
        raise ConfigError(unsaid_shard(ranks))


def unsaid_shard(ranks: int) -> str:
    """The refusal of ``resumable_loader`` without ``shard=`` on ``ranks`` ranks."""
    return (
        f"resumable_loader(...) runs on {ranks} ranks without shard=...: every rank would "
        "iterate the whole dataset, and with the same dataset and seed every rank would get "
        f"the same batches, so each update would average {ranks} copies of one batch. Pass "
        "shard=True to share every epoch out among the ranks; or shard=False when each "
        "rank's dataset is already its own, or every rank must see the same batch (tensor or "
        "pipeline parallelism)."
    )


def _check_one_order(mine: dict[str, Any]) -> None:
    # Each rank would otherwise take its share of another permutation.
    if found := first_other(mine):
        other, theirs = found
        raise ConfigError(
            f"resumable_loader(shard=True) was built with {mine} on rank {rank()} but "
            f"with {theirs} on rank {other}: each rank would take its share of another "
            "order, so some samples would be read twice per epoch and others never. Build "
            "it alike on every rank: the same dataset and shuffle, the same seed (e.g. "
            f"seed={(theirs if other == 0 else mine)['seed']}, rank 0's); the ranks still read "
            "different samples."
        )

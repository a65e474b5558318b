"""``resumable_loader``: the everyday way to build a :class:`~steplib.data.loader.ResumableLoader`
(a data loader whose position and shuffle order are part of a checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from steplib.data.loader import ResumableLoader
from steplib.data.own_states import check_collate
from steplib.data.rank_share import share_sampler
from steplib.distributed.process_group import world_size
from steplib.errors import ConfigError, describe


def resumable_loader(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
    shard: bool | None = None,
) -> ResumableLoader:
    """A data loader over a map-style ``dataset`` whose position belongs in a checkpoint.

    Pass it to ``steplib.checkpoint.save(..., data=loader)`` / ``load(..., data=loader)`` (or
    the ``checkpoint_every`` / ``resume_from`` handlers): a resumed run then sees the same
    batches in the same order as an uninterrupted one, mid-epoch and in later epochs.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch, an int >= 1; ``None`` when every item of ``dataset``
            is already a batch (they are then only shuffled, not collated).
        shuffle: reshuffle every epoch (from the loader's own generator).
        seed: seed of the loader's generator: the shuffle order and worker seeds derive from it
            alone, never from the global torch generator.
        drop_last: drop the last, smaller batch of an epoch.
        num_workers: worker processes (0 loads in the main process).
        collate_fn: how samples become a batch (torch's default collation when ``None``). One
            with ``state_dict()`` / ``load_state_dict()`` (a batch transform such as mixup
            with a generator of its own) is saved and restored with the position.
        pin_memory: copy batches into pinned memory (faster host-to-GPU copies).
        shard: ``True``: share every epoch out among the ranks of the default process group
            (each rank gets ``len(dataset) // world_size`` samples, as from
            ``DistributedSampler(..., drop_last=True)``; build it on every rank with the same
            ``seed``, after ``init_distributed()``), with a position that another world size
            can resume from; see "Resuming on another number of ranks" below. ``batch_size``
            is then per rank. ``False``: every rank iterates its whole ``dataset`` (right when
            each rank's dataset is already its own, or when every rank must see the same
            batch: tensor and pipeline parallelism). ``None`` (the default): ``False`` in one
            process; refused in a process group of several ranks (also at the first pass of
            a loader built before ``init_distributed()``), where the same dataset and seed on
            every rank would give every rank the same batches, so the global batch would be
            ``world_size`` copies of one.

    Resuming on another number of ranks (``shard=True``): the position is the epoch and the
    samples all ranks consumed together, so every rank of the new world size continues with its
    share of the rest of the epoch; the RNG states, the workers' and, without workers, the
    dataset's own state are carried on the same world size only. What is exact and what is
    refused: docs/resume_on_another_world_size.md.

    Returns:
        A :class:`ResumableLoader`.

    Raises:
        ConfigError: ``batch_size`` or ``num_workers`` out of range, ``seed`` not an int, an
            empty ``dataset``, ``shard=True`` with ``len(dataset)`` smaller than the number
            of ranks or with another ``seed``, dataset length or ``shuffle`` on some rank (a
            collective at build time), or ``shard`` left unsaid in a process group of several
            ranks.

    Example:
        >>> import torch
        >>> loader = resumable_loader(torch.arange(6), batch_size=2, seed=0)
        >>> it = iter(loader)
        >>> first = next(it)
        >>> position = loader.state_dict()
        >>> resumed = resumable_loader(torch.arange(6), batch_size=2, seed=0)
        >>> resumed.load_state_dict(position)
        >>> len(resumed)  # batches left in the interrupted epoch
        2
        >>> [b.tolist() for b in resumed] == [b.tolist() for b in it]
        True

        Sharded (here one process, so one rank; on 4 ranks each rank gets a quarter):

        >>> sharded = resumable_loader(torch.arange(6), batch_size=2, seed=0, shard=True)
        >>> it = iter(sharded)
        >>> first = next(it)
        >>> sharded.state_dict()["sharded"]["samples"]  # consumed by all ranks together
        2
    """
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ConfigError(
            f"resumable_loader(batch_size=...) received {describe(batch_size)}; it must be an "
            "int >= 1 (samples per batch), e.g. batch_size=32, or None when every item of the "
            "dataset is already a batch."
        )
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(
            f"resumable_loader(num_workers=...) received {describe(num_workers)}; it must be an "
            "int >= 0, e.g. num_workers=0 (load in the main process)."
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(
            f"resumable_loader(seed=...) received {describe(seed)}; pass an int, e.g. seed=0."
        )
    check_collate(collate_fn, num_workers)
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        # torch would say only "num_samples should be a positive integer value" (shuffled) or
        # train on nothing (not shuffled).
        raise ConfigError(
            f"resumable_loader(dataset) received an empty {type(dataset).__name__} (len 0): "
            "there is nothing to train on. Check the path, split or filter that built it, and "
            "pass a dataset with at least one sample."
        )
    sampler = share_sampler(shard, dataset, seed=seed, shuffle=shuffle)  # None: not shared
    loader = ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=shuffle and sampler is None,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )
    loader._built_for_ranks, loader._shard_unsaid = world_size(), shard is None
    return loader

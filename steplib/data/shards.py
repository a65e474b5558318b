"""Each epoch's global sample order shared out among the ranks, with a position that does not
depend on the number of ranks: a run resumed on another world size continues where an
uninterrupted run on that world size would be.

Rank ``r`` of ``w`` takes the places ``offset + r, offset + r + w, ...`` of the epoch's global
order (the permutation ``DistributedSampler`` draws: ``randperm`` seeded with ``seed + epoch``),
cut to a multiple of ``w`` so that every rank gets as many samples. After ``i`` batches of ``b``
samples on every rank, the ranks together have consumed ``offset + i * b * w`` samples of the
epoch, whatever ``w`` is. That count and the epoch are the position a checkpoint keeps. On
``w'`` ranks the rest of the epoch is shared out from that count on, which is what an
uninterrupted ``w'``-rank run yields from there, provided the count is a whole number of its
global batches (``b' * w'``): :meth:`ShardedSampler.check` refuses a position that is not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from steplib.data.own_states import COLLATE, DATASET
from steplib.errors import ConfigError, describe

# The key of a sharded position in ResumableLoader.state_dict(); it maps to plain ints and bools
# (what torch.load(weights_only=True) reads back).
SHARDED = "sharded"


class ShardedSampler(Sampler[int]):
    """This rank's share of every epoch. Build it through
    ``resumable_loader(dataset, ..., shard=True)``, whose loader moves it to the next epoch at
    every pass (:meth:`start_epoch`: no ``set_epoch`` to forget); ``iter()`` itself only reads
    the position, because a DataLoader may call it more than once per pass (with workers).

    With ``offset == 0`` rank ``rank`` gets exactly what
    ``DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
    seed=seed, drop_last=True)`` gives after ``set_epoch(epoch)``: the ``size % world_size``
    last samples of each shuffled epoch are left out, so that no sample counts twice.

    Args:
        size: the number of samples, ``len(dataset)``.
        rank: this process's rank, in ``[0, world_size)``.
        world_size: the number of ranks sharing the data.
        seed: the seed of the global order: the same on every rank.
        shuffle: a new permutation every epoch; ``False`` keeps the dataset's order.

    Attributes:
        epoch: the epoch ``iter()`` yields.
        offset: the samples of that epoch the ranks together had consumed when it (re)started.
        begun: a loader has begun a pass over this epoch (the next pass is the next epoch).

    Example:
        >>> from torch.utils.data import DistributedSampler
        >>> ours = [list(ShardedSampler(10, rank=r, world_size=4, seed=3)) for r in range(4)]
        >>> torch_s = [DistributedSampler(range(10), num_replicas=4, rank=r, seed=3,
        ...                               drop_last=True) for r in range(4)]
        >>> ours == [list(s) for s in torch_s]
        True
        >>> len(ours[0])  # 10 // 4: the 2 last samples of the epoch are left out
        2
    """

    def __init__(
        self, size: int, *, rank: int, world_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        for label, value, low in (("size", size, 0), ("world_size", world_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(
                    f"ShardedSampler({label}=...) received {describe(value)}; it must be an "
                    f"int >= {low}. Build it with resumable_loader(dataset, ..., shard=True)."
                )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(
                f"ShardedSampler(rank=...) received {describe(rank)} with world_size="
                f"{world_size}; a rank is an int in [0, world_size). Pass "
                "steplib.distributed.rank()."
            )
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch = 0
        self.offset = 0
        self.begun = False

    def order(self) -> torch.Tensor:
        """The global order of epoch ``self.epoch`` (every rank computes the same).

        Returns:
            A permutation of ``range(size)`` (or ``range(size)`` itself without shuffling).
        """
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )

    def __iter__(self) -> Iterator[int]:
        rest = self.order()[self.offset :]
        usable = len(rest) - len(rest) % self.world_size
        return iter(rest[self.rank : usable : self.world_size].tolist())

    def __len__(self) -> int:
        # What the next pass yields: the rest of a resumed epoch, or a whole one.
        return (self.size - (0 if self.begun else self.offset)) // self.world_size

    def start_epoch(self) -> None:
        """Move to the epoch that the loader's next pass yields: the following epoch from its
        start, unless no pass has begun this one yet (a new or resumed sampler)."""
        if self.begun:
            self.epoch, self.offset = self.epoch + 1, 0
        self.begun = True

    def worker_seed(self) -> int:
        """The seed of the loader's generator for this epoch's pass (its workers' base seed).

        Derived from the position alone, so that a resumed run's workers start as the
        uninterrupted run's would; the rank is part of it because torch would otherwise give
        every rank the same worker seeds (the same random augmentations on every rank).

        Returns:
            A non-negative int below ``2**63``.
        """
        return (self.seed * 0x9E3779B1 + self.rank * 0x85EBCA77 + self.epoch) % 2**63

    def position(
        self, *, batch_size: int, batches: int, finished: bool, drop_last: bool
    ) -> dict[str, Any]:
        """Where the ranks are, as plain data from which another world size can continue.

        Args:
            batch_size: samples per batch on each rank (1 when every item is a batch).
            batches: batches this rank has yielded in the current pass.
            finished: that epoch's iterator has ended (the loop has counted the epoch).
            drop_last: the loader drops the last, smaller batch of an epoch.

        Returns:
            ``{"epoch", "samples", "uncounted_epoch_end", "world_size", "batch_size", "size",
            "seed", "shuffle"}``: the next sample to train on is place ``samples`` of epoch
            ``epoch``'s global order; ``uncounted_epoch_end``: every batch of the epoch was
            yielded but the loop has not counted the epoch yet.

        Example:
            >>> sampler = ShardedSampler(12, rank=0, world_size=2, seed=0)
            >>> sampler.start_epoch()  # a loader's first pass
            >>> where = sampler.position(batch_size=2, batches=1, finished=False, drop_last=False)
            >>> where["epoch"], where["samples"]  # 1 batch of 2 on each of 2 ranks
            (0, 4)
        """
        epoch, samples, uncounted = self.epoch, self.offset, False
        if self.begun:
            per_rank = (self.size - self.offset) // self.world_size
            in_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
            if finished or batches >= in_epoch:
                epoch, samples, uncounted = epoch + 1, 0, not finished
            else:
                samples = self.offset + batches * batch_size * self.world_size
        return {
            "epoch": epoch,
            "samples": samples,
            "uncounted_epoch_end": uncounted,
            "world_size": self.world_size,
            "batch_size": batch_size,
            "size": self.size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def check(self, position: Any, *, batch_size: int) -> None:
        """Raise unless this rank can continue from ``position`` (from :meth:`position`, of
        any world size) exactly where an uninterrupted run on this world size would be.

        Args:
            position: what :meth:`position` returned when the checkpoint was taken.
            batch_size: samples per batch on each rank, here.

        Raises:
            ConfigError: ``position`` is not a sharded position; it is of another dataset
                size, seed or shuffling (another global order); or its sample count is not a
                whole number of this world size's global batches (``batch_size x
                world_size``), so no uninterrupted run on this world size stops there.

        Example:
            >>> saved = ShardedSampler(48, rank=0, world_size=4)
            >>> saved.start_epoch()
            >>> position = saved.position(batch_size=2, batches=3, finished=False,
            ...                           drop_last=False)
            >>> position["samples"]  # 3 batches of 2 on 4 ranks
            24
            >>> ShardedSampler(48, rank=1, world_size=2).check(position, batch_size=4)
            >>> try:
            ...     ShardedSampler(48, rank=1, world_size=2).check(position, batch_size=5)
            ... except ConfigError as err:
            ...     print(str(err)[:62])
            the data position was saved after 24 samples of epoch 0 (4 ran
        """
        keys = ("epoch", "samples", "uncounted_epoch_end", "world_size", "batch_size", "size")
        if not isinstance(position, Mapping) or not all(k in position for k in keys):
            raise ConfigError(
                f"ShardedSampler received the data position {describe(position)}, which is not "
                "a sharded position. Save and resume with the same kind of loader: "
                "resumable_loader(dataset, ..., shard=True) in both runs."
            )
        saved = (position["size"], position["seed"], position["shuffle"])
        here = (self.size, self.seed, self.shuffle)
        if saved != here:
            raise ConfigError(
                "the data position was saved by a loader over (dataset size, seed, shuffle) = "
                f"{saved}; this one has {here}, so its global order differs and the position "
                "means other samples. Build the loader as the saving run did: the same "
                f"dataset, resumable_loader(dataset, seed={position['seed']}, "
                f"shuffle={position['shuffle']}, shard=True)."
            )
        samples, ranks = position["samples"], position["world_size"]
        global_batch = batch_size * self.world_size
        if samples % global_batch:
            saved_global = position["batch_size"] * ranks
            fix = (
                f"keep the global batch: batch_size={saved_global // self.world_size} on "
                f"{self.world_size} ranks"
                if saved_global % self.world_size == 0
                else f"resume on a number of ranks that divides {saved_global}"
            )
            raise ConfigError(
                f"the data position was saved after {samples} samples of epoch "
                f"{position['epoch']} ({ranks} ranks x batch_size={position['batch_size']}); "
                f"here {self.world_size} ranks x batch_size={batch_size} = {global_batch} "
                f"samples per batch, and {samples} is not a multiple of {global_batch}, so no "
                f"uninterrupted run on {self.world_size} ranks stops there. Either {fix}, or "
                f"resume on {ranks} ranks."
            )

    def resume(self, position: Mapping[str, Any], *, batch_size: int) -> bool:
        """Continue from ``position`` (see :meth:`check`): the next pass yields this rank's
        share of the rest of that epoch.

        Args:
            position: what :meth:`position` returned, on this or another world size.
            batch_size: samples per batch on each rank, here.

        Returns:
            Whether the position was the end of an epoch that the loop had not counted yet.

        Raises:
            ConfigError: see :meth:`check`.

        Example:
            >>> four = [ShardedSampler(16, rank=r, world_size=4, seed=1) for r in range(4)]
            >>> for s in four:
            ...     s.start_epoch()
            >>> position = four[0].position(batch_size=1, batches=2, finished=False,
            ...                             drop_last=False)
            >>> resumed = ShardedSampler(16, rank=0, world_size=2, seed=1)
            >>> resumed.resume(position, batch_size=2)
            False
            >>> list(resumed) == list(ShardedSampler(16, rank=0, world_size=2, seed=1))[4:]
            True
        """
        self.check(position, batch_size=batch_size)
        self.epoch, self.offset = int(position["epoch"]), int(position["samples"])
        self.begun = False
        return bool(position["uncounted_epoch_end"])


def check_new_world(
    data: Any,
    position: Any,
    *,
    saved_world_size: int,
    world_size: int,
    checkpoint: str,
    saver: int | None = None,
) -> None:
    """Raise unless ``data`` can continue, on ``world_size`` ranks, from ``position``: the data
    position in a checkpoint written by ``saved_world_size`` ranks (rank 0's), or by rank
    ``saver`` of as many alone (its own position, loaded on another rank).

    Args:
        data: the loader to resume (``load(data=...)``).
        position: the saved ``data.state_dict()``.
        saved_world_size: the number of ranks of the run that wrote the checkpoint.
        world_size: the number of ranks loading it.
        checkpoint: the checkpoint's URL, for the message.
        saver: the one rank that wrote it, loaded here on another rank of as many.

    Raises:
        ConfigError: ``data`` or the saved position is not sharded (``shard=True``), whose
            per-rank positions another world size cannot continue; or see
            :meth:`ShardedSampler.check`.

    Example:
        >>> import torch
        >>> from steplib.data import resumable_loader
        >>> old = resumable_loader(torch.arange(8), batch_size=2, shard=True)
        >>> new = resumable_loader(torch.arange(8), batch_size=2, shard=True)
        >>> check_new_world(new, old.state_dict(), saved_world_size=2, world_size=1,
        ...                 checkpoint="memory://ckpt")
    """
    where = (
        f"load(data=...): checkpoint {checkpoint} was written by {saved_world_size} ranks and "
        f"is loaded on {world_size}"
        if saver is None
        else f"load(data=...): checkpoint {checkpoint} was written by rank {saver} of "
        f"{saved_world_size} alone and is loaded on another rank"
    )
    again = (
        f"Resume on {saved_world_size} ranks"
        if saver is None
        else "Save on every rank (save(state) with its DDP model keeps each rank's position)"
    )
    sampler = getattr(data, "sampler", None)
    saved_sharded = isinstance(position, Mapping) and SHARDED in position
    if isinstance(sampler, ShardedSampler) and saved_sharded:
        try:
            sampler.check(position[SHARDED], batch_size=getattr(data, "batch_size", None) or 1)
        except ConfigError as err:
            raise ConfigError(f"{where}; {err}") from None
        # The dataset's and collate_fn's own states are the saving rank's: loaded on every
        # rank, each would draw what that one rank drew (the same mixup on every split).
        owned = [key for key in (DATASET, COLLATE) if position.get(key) is not None]
        if owned:
            raise ConfigError(
                f"{where}; its data position holds the {' and '.join(owned)}'s own state "
                "(state_dict()) of one saving rank, which would go to every rank here and make "
                f"each draw the same. {again}, or give the "
                f"{' and '.join(owned)} no state_dict() (a generator seeded per rank instead)."
            )
        return
    if saved_sharded:
        raise ConfigError(
            f"{where}; its data position is sharded (resumable_loader(..., shard=True)) but "
            f"the loader given here (a {type(data).__name__}) is not. Pass "
            "data=resumable_loader(dataset, ..., shard=True) built as the saving run did."
        )
    raise ConfigError(
        f"{where}; its data position is per rank (the loader had no shard=True, so each rank "
        "iterated its whole dataset: its own share where the data is split by rank, the same "
        "batches as every rank under tensor or pipeline parallelism, which a position does not "
        f"tell apart), one per saving rank, and none maps onto another rank: no rank "
        f"knows where to continue. {again}. For data-parallel runs "
        "that may change their number of ranks, build the loader with resumable_loader("
        "dataset, ..., shard=True) over the whole dataset, the same seed on every rank. "
        "(data=None loads the model and optimizer and starts the data over at its first batch "
        "while state.step goes on.)"
    )

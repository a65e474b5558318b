"""Data loaders whose position and shuffle order are part of a checkpoint: a resumed run sees
the batches of the uninterrupted one, in the same order, across epoch boundaries too.

Why a subclass of torchdata's ``StatefulDataLoader``: in torchdata 0.11 a plain one resumes the
current epoch but shuffles the later ones differently (its restore replays the epoch's
permutation from the generator, not the worker base seed drawn after it).
:class:`ResumableLoader` saves the generator itself and sets it back after torchdata's restore;
its ``len()`` is what the next pass yields, so that the last accumulation window of a resumed
epoch closes on its last batch; and it keeps what torchdata does not: a sharded position, the
workers' generators, and the state of a dataset that lives in the main process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from steplib.data.order_rng import check_order_rng
from steplib.data.own_states import check_collate, load_own_states, own_states
from steplib.data.rank_share import check_still_shared, share_sampler
from steplib.data.shards import SHARDED, ShardedSampler
from steplib.data.torchdata_state import FINISHED, batches_yielded
from steplib.data.worker_rng import WORKERS, WorkerRng, worker_states
from steplib.distributed.process_group import world_size
from steplib.errors import ConfigError, describe


class ResumableLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` that resumes the data order exactly, epochs after the current
    one included. Build it with :func:`resumable_loader`.

    ``len(loader)`` is the number of batches the next pass yields: the rest of an interrupted
    epoch right after :meth:`load_state_dict`, a full epoch otherwise; ``resumed_at`` is then
    the batches that epoch had yielded before (0 when the next pass starts an epoch), where
    ``run`` counts the pass's ``batch_index`` from, with no second ``epoch_start``.

    With worker processes, ``loader.dataset`` is the given dataset wrapped in a
    :class:`~steplib.data.worker_rng.WorkerRng` (``loader.dataset.dataset`` is yours): each
    worker's generators are then part of the position, so random augmentations drawn in the
    workers resume where they were.

    Args:
        *args, **kwargs: a ``StatefulDataLoader``'s, with a ``generator`` and without
            ``persistent_workers`` (:func:`resumable_loader` sets them right).
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        workers = kwargs.get("num_workers", args[4] if len(args) > 4 else 0)
        if workers and not isinstance(dataset, IterableDataset):
            # The workers' generators (random augmentations) then resume where they were,
            # instead of from their seeds again (see steplib.data.worker_rng).
            dataset = WorkerRng(dataset)
        # torchdata calls the deprecated torch.set_vital in its constructor; the warning is
        # about torchdata's code, not the caller's, and would fail test suites that turn
        # warnings into errors.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
            super().__init__(dataset, *args, **kwargs)
        if self.persistent_workers and self.num_workers > 0:
            # Persistent workers reuse one iterator across epochs, so an epoch's start (the
            # generator state the order derives from) cannot be captured.
            raise ConfigError(
                "ResumableLoader received persistent_workers=True, whose epochs cannot be "
                "resumed in the same order. Leave persistent_workers=False."
            )
        generator = check_order_rng(self.generator, self.sampler, self.batch_sampler)
        self._epoch_start_rng: torch.Tensor = generator.get_state()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_left: int | None = None
        self.resumed_at = 0
        self.epoch_completed_on_load = False
        # Set by resumable_loader, for steplib.data.rank_share.check_still_shared.
        self._built_for_ranks: int | None = None
        self._shard_unsaid = False

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch and the generator states (plain data).

        Returns:
            ``{"loader": torchdata's state, "generator": the generator now,
            "epoch_start_generator": the generator before this epoch's iterator drew from it,
            "layout": the dataset size, batch size and sampler the position counts in}``;
            with a :class:`~steplib.data.shards.ShardedSampler`, ``{"sharded": the position
            in the global order}`` (see ``ShardedSampler.position``), which any world size
            can continue from, ``"workers": the state of each worker process}`` (mid-epoch,
            with workers; loaded on the same world size, batch size and ``num_workers``).
            Both hold ``"dataset"`` and ``"collate"``: without workers, the dataset's and the
            ``collate_fn``'s own ``state_dict()`` (``None`` when it has none; a sharded one is
            loaded on the same world size).
        """
        if isinstance(self.sampler, ShardedSampler):
            return {**self._sharded_state(), **own_states(self)}
        loader_state = super().state_dict()  # may create the epoch's iterator (and draw)
        return {
            "loader": loader_state,
            "generator": self.generator.get_state(),
            "epoch_start_generator": self._epoch_start_rng.clone(),
            "layout": self._layout(),
            **own_states(self),
        }

    def _layout(self) -> dict[str, Any]:
        # What the position's batch count and sample order mean: loaded into a loader that
        # differs here, it would skip other samples or count the epoch's batches wrongly.
        # num_workers too: torchdata keeps a position per worker, and loads none into another
        # number of them (its bare AssertionError).
        size = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        sampler, workers = type(self.sampler).__name__, self.num_workers
        return {"size": size, "batch_size": self.batch_size, "sampler": sampler, "workers": workers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position returned by :meth:`state_dict`.

        A position at the end of an epoch (every batch yielded, the epoch not yet ended) is
        resumed at the start of the next epoch; ``epoch_completed_on_load`` is then True, so
        that the caller can count the epoch as complete.

        A sharded position (``shard=True``) may come from another world size: the data then
        continues from the samples the saving ranks consumed together (see
        :meth:`~steplib.data.shards.ShardedSampler.check` for when that is refused).

        Raises:
            ConfigError: ``state_dict`` was not made by a ``ResumableLoader`` of the same kind
                (sharded or not); a position inside an epoch, saved by a loader over another
                dataset size, batch size, shuffling or number of workers; or a sharded one
                cannot continue here.
        """
        sharded = isinstance(self.sampler, ShardedSampler)
        if sharded or (isinstance(state_dict, Mapping) and SHARDED in state_dict):
            self._load_sharded(state_dict)
            return
        if not isinstance(state_dict, Mapping) or "loader" not in state_dict:
            raise ConfigError(
                f"ResumableLoader.load_state_dict received {describe(state_dict)}, which is not "
                "a ResumableLoader position (it has no 'loader' key). Save the position with "
                "the same kind of loader: steplib.data.resumable_loader(...)."
            )
        loader_state = state_dict["loader"]
        yielded = batches_yielded(loader_state)
        finished = bool(loader_state.get(FINISHED, False))
        # After an ended epoch a loader built otherwise may start the next one; before, not.
        saved = state_dict.get("layout")
        if saved is not None and saved != self._layout() and not finished:
            raise ConfigError(
                f"ResumableLoader.load_state_dict received a position saved by a loader over "
                f"{saved}; this one has {self._layout()}, so the position would skip other "
                "samples or miscount the epoch's batches. Build the loader as the saving run "
                "did (the same dataset, batch_size, shuffle and num_workers); to resume with "
                "another batch size, use resumable_loader(..., shard=True) in both runs."
            )
        load_own_states(self, state_dict)
        # Unsized data (an IterableDataset without __len__) tells its epoch's end by ending.
        full = super().__len__() if hasattr(self.dataset, "__len__") else None
        ended = full is not None and yielded is not None and yielded >= full
        self.epoch_completed_on_load = ended and not finished
        if self.epoch_completed_on_load or finished:
            # Nothing is left of that epoch: start the next one from the generator as it was,
            # which is what a fresh iterator of the uninterrupted run draws from.
            super().load_state_dict({})
            self.generator.set_state(state_dict["generator"])
            self._pending, self._pending_left, self.resumed_at = None, None, 0
            return
        super().load_state_dict(loader_state)
        self.resumed_at = yielded or 0
        self._pending = (state_dict["epoch_start_generator"], state_dict["generator"])
        self._pending_left = None if yielded is None or full is None else full - yielded

    def _sharded_state(self) -> dict[str, Any]:
        assert isinstance(self.sampler, ShardedSampler)
        batch_size = self.batch_size or 1
        if self._iterator is None:  # no epoch begun since built or resumed: no iterator made
            position = self.sampler.position(
                batch_size=batch_size, batches=0, finished=False, drop_last=self.drop_last
            )
            return {SHARDED: position, WORKERS: getattr(self.dataset, "resume_states", None)}
        loader_state = super().state_dict()
        yielded = batches_yielded(loader_state)
        if yielded is None:
            raise ConfigError(
                "ResumableLoader(shard=True).state_dict: this torchdata version's state does "
                "not say how many batches were yielded, so the position cannot be saved. "
                "Install torchdata 0.10 or 0.11."
            )
        position = self.sampler.position(
            batch_size=batch_size,
            batches=yielded,
            finished=bool(loader_state.get(FINISHED, False)),
            drop_last=self.drop_last,
        )
        # Within the epoch, its workers go on; a next epoch's start from their seeds.
        within = position["epoch"] == self.sampler.epoch and self.num_workers > 0
        return {SHARDED: position, WORKERS: worker_states(loader_state) if within else None}

    def _load_sharded(self, state_dict: Any) -> None:
        if not isinstance(self.sampler, ShardedSampler):
            raise ConfigError(
                "ResumableLoader.load_state_dict received a sharded position (saved by "
                "resumable_loader(..., shard=True)) but this loader is not sharded. Build it "
                "as the saving run did: resumable_loader(dataset, ..., shard=True)."
            )
        position = state_dict.get(SHARDED) if isinstance(state_dict, Mapping) else None
        position = position if position is not None else state_dict
        self.epoch_completed_on_load = self.sampler.resume(
            position, batch_size=self.batch_size or 1
        )
        # This world size's batches that the samples all ranks consumed together make.
        per_batch = self.sampler.world_size * (self.batch_size or 1)
        self.resumed_at = 0 if self.epoch_completed_on_load else position["samples"] // per_batch
        super().load_state_dict({})  # a fresh iterator: the sampler starts at the position
        # Only the same ranks, batch size and workers make the batches the saved workers
        # made; elsewhere the workers start from their seeds (not carried over).
        states = state_dict.get(WORKERS) if isinstance(state_dict, Mapping) else None
        if isinstance(self.dataset, WorkerRng):
            saved = states and [position["world_size"], position["batch_size"], len(states)]
            here = [self.sampler.world_size, self.batch_size or 1, self.num_workers]
            self.dataset.resume_states = states if saved == here else None
        if position["world_size"] == self.sampler.world_size:  # each rank's dataset its own
            load_own_states(self, state_dict)

    def _get_iterator(self) -> Any:
        # Called for every new epoch iterator (by __iter__ and by state_dict before a pass).
        check_still_shared(
            self._built_for_ranks,
            sharded=isinstance(self.sampler, ShardedSampler),
            unsaid=self._shard_unsaid,
        )
        if isinstance(self.sampler, ShardedSampler):
            self.sampler.start_epoch()
            self.generator.manual_seed(self.sampler.worker_seed())
            iterator = super()._get_iterator()
            if isinstance(self.dataset, WorkerRng):
                self.dataset.resume_states = None  # the pass's workers hold their copies
            return iterator
        if self._pending is None:
            self._epoch_start_rng = self.generator.get_state()
            return super()._get_iterator()
        start, now = self._pending
        self._pending = None  # _pending_left: until the pass begins (__iter__), see __len__
        # From the epoch's starting state, the restored iterator draws what the original one
        # drew (the permutation, then the worker base seed); torchdata then rewinds to replay
        # the permutation, and the generator is finally set to where the saved run was.
        self.generator.set_state(start)
        iterator = super()._get_iterator()
        self.generator.set_state(now)
        self._epoch_start_rng = start
        return iterator

    def __iter__(self) -> Any:
        # The resumed pass begins: the next one is a full epoch. Not in _get_iterator, which
        # state_dict() also calls (a save right after the resume, before the loop reads len).
        iterator = super().__iter__()
        self._pending_left, self.resumed_at = None, 0
        return iterator

    def __len__(self) -> int:
        full = super().__len__()
        return full if self._pending_left is None else self._pending_left


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

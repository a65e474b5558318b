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

import itertools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from steplib.data.order_rng import check_order_rng, epoch_samplers
from steplib.data.own_states import load_own_states, own_states
from steplib.data.rank_share import check_still_shared
from steplib.data.shards import SHARDED, ShardedSampler
from steplib.data.torchdata_state import FINISHED, batches_yielded
from steplib.data.worker_rng import WORKERS, WorkerRng, worker_states
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
        self._epoch_samplers = epoch_samplers(self.sampler, self.batch_sampler)
        self._epoch_start_rng: torch.Tensor = generator.get_state()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_left: int | None = None
        self.resumed_at = 0
        self.epoch_completed_on_load = False
        # Set by resumable_loader (expect_ranks), for rank_share.check_still_shared.
        self._built_for_ranks: int | None = None
        self._shard_unsaid = False
        # Set by continue_pass: (batches to yield first, batches left in the pass after them).
        self._continued: tuple[list[Any], int | None] | None = None
        self._pass: Any = None  # what __iter__ returned last: the pass a run may leave

    def expect_ranks(self, ranks: int, *, shard_unsaid: bool) -> None:
        """Refuse a pass on another number of ranks than ``ranks`` (a loader built before
        ``init_distributed()``), and any pass on several ranks when ``shard_unsaid``
        (:func:`~steplib.data.resumable.resumable_loader` calls it)."""
        self._built_for_ranks, self._shard_unsaid = ranks, shard_unsaid

    def continue_pass(
        self, passing: Iterator[Any], untrained: Sequence[Any] = (), *, at: int, left: int | None
    ) -> None:
        """Make the next pass go on with the current one, which a run left part-way (a stop,
        a ``break``, an error): ``run`` and ``iterate`` call it, so that a next run on the
        state the run ended with sees the batches of the uninterrupted run.

        The next pass yields ``untrained`` first (batches this pass yielded that the run's
        step raised on, so never trained), then the rest of this pass, from the same iterator:
        the same order, the workers' random augmentations drawn where they were: none when
        the run raised after the pass's last batch (the loop then ends that epoch). A
        :meth:`load_state_dict` (a resume) replaces it.

        Args:
            passing: what ``iter(loader)`` returned for that pass. Another pass begun since
                (a generator of ``iterate`` closed late, after a next run began) is left as
                it is.
            untrained: batches to yield again first, in order.
            at: the batches of the epoch yielded so far (``untrained`` included): the next
                pass is ``resumed_at`` the epoch's batch ``at - len(untrained)``.
            left: the batches of this pass after the last one yielded (``None``: unsized).
        """
        if passing is self._pass:
            self._continued = (list(untrained), left)
            self.resumed_at = at - len(untrained)

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch and the generator states (plain data).

        Returns:
            ``{"loader": torchdata's state, "generator": the generator now,
            "epoch_start_generator": the generator before this epoch's iterator drew from it,
            "layout": the dataset size, batch size and sampler the position counts in,
            "sampler_epochs": the epoch of each sampler with ``set_epoch``}``;
            with a :class:`~steplib.data.shards.ShardedSampler`, ``{"sharded": the position
            in the global order}`` (see ``ShardedSampler.position``), which any world size
            can continue from, ``"workers": the state of each worker process}`` (mid-epoch,
            with workers; loaded on the same world size, batch size and ``num_workers``).
            Both hold ``"dataset"`` and ``"collate"``: without workers, the dataset's and the
            ``collate_fn``'s own ``state_dict()`` (``None`` when it has none; a sharded one is
            loaded on the same world size).
        """
        if self._continued is not None and self._continued[0]:
            raise ConfigError(
                "ResumableLoader.state_dict: the last batch this loader yielded was not "
                "trained (the run's step raised on it) and is held for the next pass, so no "
                "position describes where the data is. Run on first (state = run(step, state, "
                "loader, ...)): its first step trains that batch, and a save after it holds the "
                "position. Or go back to a saved one: load(url, state, data=loader)."
            )
        if isinstance(self.sampler, ShardedSampler):
            return {**self._sharded_state(), **own_states(self)}
        loader_state = super().state_dict()  # may create the epoch's iterator (and draw)
        return {
            "loader": loader_state,
            "generator": self.generator.get_state(),
            "epoch_start_generator": self._epoch_start_rng.clone(),
            "layout": self._layout(),
            "sampler_epochs": [int(one.epoch) for one in self._epoch_samplers],
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
        # A loaded position replaces a pass a run left part-way, also for a run that leaves it
        # later (an iterate generator closed late).
        self._continued, self._pass = None, None
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
        # The order the position counts in: no epoch_start (so no set_epoch handler) runs
        # before the rest of an epoch that the position continues. (A position saved before
        # steplib held the epochs has none.)
        epochs = state_dict.get("sampler_epochs", ())
        for one, epoch in zip(self._epoch_samplers, epochs, strict=False):
            one.set_epoch(int(epoch))
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
        # This world size's batches that the samples all ranks consumed together make: a whole
        # number (resume refused a count that is not), so the division rounds nothing.
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
        if self._continued is not None:  # the pass a run left part-way goes on
            untrained, self._continued = self._continued[0], None
            self._pass, self.resumed_at = itertools.chain(untrained, self._iterator), 0
            return self._pass
        # The resumed pass begins: the next one is a full epoch. Not in _get_iterator, which
        # state_dict() also calls (a save right after the resume, before the loop reads len).
        self._pass = super().__iter__()
        self._pending_left, self.resumed_at = None, 0
        return self._pass

    def __len__(self) -> int:
        full = super().__len__()  # raises TypeError for unsized data, continued or not
        if self._continued is not None and self._continued[1] is not None:
            return len(self._continued[0]) + self._continued[1]
        return full if self._pending_left is None else self._pending_left

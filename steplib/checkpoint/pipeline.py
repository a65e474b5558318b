"""The one pipeline every checkpoint goes through, given its inputs once (:class:`Checkpoints`):
a save is plan -> snapshot (async only) -> :func:`write` (files, manifest last, commit); a load
is manifest -> verify -> check against the state -> apply. Back-ends: ``torch.save`` files, or
DCP for a sharded state (``dcp``, imported on use: ~0.8 s), where every rank writes its part
and rank 0 commits."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from steplib import errors
from steplib.checkpoint import storage
from steplib.checkpoint.contents import (
    DISTRIBUTION_WRAPPERS,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    check_arguments,
    check_metrics,
    gather,
    is_sharded,
    is_stateful,
    read_tree,
    settle_schedulers,
)
from steplib.checkpoint.manifest import (
    MANIFEST,
    SHARDED,
    SINGLE,
    Key,
    Manifest,
    newest_valid,
    read_manifest,
    sort_key,
)
from steplib.checkpoint.restore import apply, check_fingerprint
from steplib.checkpoint.storage import Location, StorageOptions
from steplib.errors import CheckpointError, ConfigError, CorruptCheckpointError
from steplib.events import Event
from steplib.state import TrainState


def check_options(given: Checkpoints, caller: str, *, sharded: bool = False) -> None:
    """``ConfigError`` for a non-bool ``durable`` / ``trainable_only``, or the latter sharded."""
    durable = "durable=True (fsync'ed: a power loss cannot lose it) or durable=False (faster)"
    errors.boolean(caller, "durable", given.durable, durable)
    whole = "False (the whole model; for a sharded state the only choice)"
    if sharded and given.trainable_only is True:
        raise ConfigError(
            f"{caller}(trainable_only=...) received True for a sharded state (DDP, FSDP2, "
            f"DTensor), which DCP writes whole; pass {whole}."
        )
    adapters = f"True (the trainable parameters and buffers alone: adapters) or {whole}"
    errors.boolean(caller, "trainable_only", given.trainable_only, adapters)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one process writes for a save (live tensors), and how (``given``)."""

    given: Checkpoints
    directory: Location  # ``given.directory``, resolved
    files: dict[str, Any]  # file name -> tree, written with torch.save
    tensors: dict[str, Any] | None  # DCP's, for a sharded checkpoint
    manifest: Manifest  # its ``files`` are filled in by ``write``

    @property
    def url(self) -> str:
        return self.directory.child(self.manifest.name).url


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoints:
    """A directory of checkpoints and the arguments of each ``save`` and ``load`` of it."""

    directory: str
    data: Any = None
    extras: Mapping[str, Any] | None = None
    step: Any = None
    storage_options: StorageOptions = None
    durable: bool = True
    trainable_only: bool = False

    def plan(self, state: TrainState, *, metrics: Any, caller: str) -> Plan:
        """Check the inputs and gather what this process writes (``ConfigError``)."""
        extras = check_arguments(caller, state, data=self.data, extras=self.extras, step=self.step)
        directory = storage.resolve(self.directory, self.storage_options, caller=caller)
        numbers = check_metrics(metrics, caller)
        settle_schedulers(self.step, state, caller)
        sharded = is_sharded(state)
        check_options(self, caller, sharded=sharded)
        tensors, layout, world = None, SINGLE, 1
        if sharded:
            from steplib.checkpoint import dcp

            files, tensors = dcp.gather(state, data=self.data, extras=extras, caller=caller)
            layout, world = SHARDED, dist.get_world_size()
        else:
            files = gather(state, data=self.data, extras=extras, trainable_only=self.trainable_only)
        manifest = Manifest.of(state, metrics=numbers, step=self.step, layout=layout, world=world)
        return Plan(self, directory, files, tensors, manifest)

    def for_run(self, event: Event) -> Checkpoints:
        """These with the run's stateful loader (unless ``data`` is given: ``ConfigError`` if
        the run draws from another) and its step(s), if Steps (recorded and settled)."""
        if self.data is not None and is_stateful(event.data) and event.data is not self.data:
            # A loader built again (a notebook cell run again) beside a handler built before:
            # the position saved and loaded would be the old loader's, the run's would restart.
            raise ConfigError(
                f"checkpoint_every / resume_from received data= a {type(self.data).__name__}, "
                f"but the run draws its batches from another {type(event.data).__name__}, whose "
                "position would not be saved: a resume would start its epoch over. Pass the "
                "loader the run draws from, or leave data= out to use the run's."
            )
        data = event.data if self.data is None and is_stateful(event.data) else self.data
        step = event.train_step
        ones = step.values() if isinstance(step, Mapping) else (step,)
        steps = all(callable(getattr(one, "settle", None)) for one in ones)
        return dataclasses.replace(self, data=data, step=step if steps else None)

    def save(self, state: TrainState, *, metrics: Any = None) -> str:
        return write(self.plan(state, metrics=metrics, caller="save"))

    def load(self, url: str, state: TrainState) -> TrainState:
        extras = check_arguments("load", state, data=self.data, extras=self.extras, step=self.step)
        state.fence.wait()  # an async save may still be copying what we overwrite
        location = storage.resolve(url, self.storage_options, caller="load")
        manifest = read_manifest(location)
        sharded = manifest.layout == SHARDED
        # Either back-end resumes on another number of ranks, distributed otherwise.
        check_fingerprint(
            manifest.fingerprint, self.step, checkpoint=location.url, ignore=DISTRIBUTION_WRAPPERS
        )
        if sharded:  # written by DCP; loads into any world size
            from steplib.checkpoint import dcp

            return dcp.load(location, manifest, state, self, extras)
        trees = read_trees(location, manifest)
        return apply(trees, state, data=self.data, extras=extras, checkpoint=location.url)

    def load_newest(self, state: TrainState, *, group: Any = None) -> tuple[str, TrainState] | None:
        """``(url, state)`` from the newest valid checkpoint (the corrupt skipped, warned about),
        or ``None``; with ``group``, ranks that each save their own (pipeline stages) load the
        newest every rank holds, and return alike or raise the same error."""
        location = storage.resolve(self.directory, self.storage_options, caller="resume_from")
        loaded: list[tuple[str, TrainState]] = []

        def newest(upto: Key | None) -> str | None:
            found = newest_valid(location, lambda c, _: self.load(c.url, state), upto=upto)
            if isinstance(found, tuple):
                loaded[:] = [found]
                return found[0].rsplit("/", 1)[-1]
            if found:
                # Starting fresh would silently throw the run away: a person should decide.
                raise CorruptCheckpointError(
                    f"every checkpoint in {location.url} is corrupt ({', '.join(found)}; the "
                    "warnings say why). Restore them from a copy, or move them away to start fresh."
                )
            return None

        upto: Key | None = None
        while True:  # a rank's newest may be missing on another: the newest older one
            names = _agreed(functools.partial(newest, upto), group, group is not None)
            if len(set(names)) == 1:
                return loaded[0] if names[0] is not None else None
            if None in names:
                held = ", ".join(
                    f"rank {rank}: {name or 'none'}" for rank, name in enumerate(names)
                )
                raise CheckpointError(
                    f"resume_from({location.url!r}): the ranks hold no checkpoint in common (the "
                    f"newest of {held}): they would resume apart. Restore the missing ones from "
                    "a copy, or move every rank's away to start fresh."
                )
            upto = min(filter(None, map(sort_key, names)))


def read_trees(
    location: Location, manifest: Manifest, *, only: str | None = None, mmap: bool = False
) -> dict[str, Any]:
    """Every file of a checkpoint, or ``only`` that one, verified first (``mmap``: if local)."""
    missing = ({only} if only else {MODEL, OPTIMIZER, TRAIN_STATE}) - manifest.files.keys()
    if missing:
        raise CorruptCheckpointError(
            f"checkpoint {location.url}: its manifest lists no {', '.join(sorted(missing))}: "
            "not written by steplib's save. Use another checkpoint."
        )
    url, files = location.url, {only: manifest.files[only]} if only else manifest.files
    if not location.is_local:  # each file read once, verified, then parsed
        return {n: read_tree(storage.verify(location, n, r), url, n) for n, r in files.items()}
    # torch.load reads a path several times faster than bytes; the checksums are computed
    # meanwhile in a thread (both release the GIL), and all pass before anything is applied.
    with ThreadPoolExecutor(1, thread_name_prefix="steplib-verify") as pool:
        checks = [pool.submit(storage.verify, location, n, r) for n, r in files.items()]
        try:
            trees = {n: read_tree(location.child(n).path, url, n, mmap=mmap) for n in files}
        finally:  # a failed checksum is the better explanation of a failed load
            for check in checks:
                check.result()
    return trees


def _agreed(
    action: Callable[[], Any], group: Any, sharded: bool, *, here: bool = True
) -> list[Any]:
    """``[action()]``; sharded, every rank's result (``here``: whether this rank runs it), or the
    same ``CheckpointError`` on every rank: none is left waiting in a collective."""
    if not sharded:
        return [action()]
    outcome: tuple[Any, str | None] = (None, None)
    if here:
        try:
            outcome = (action(), None)
        except Exception as err:  # reported to every rank, raised on every rank
            outcome = (None, f"rank {dist.get_rank(group)}: {type(err).__name__}: {err}")
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, outcome, group=group)
    if failures := [failure for _, failure in outcomes if failure is not None]:
        raise CheckpointError("; ".join(failures))
    return [result for result, _ in outcomes]


class GlooGroup:
    """A gloo group of its owner's own, made once per default group (a collective). Both held
    weakly: held here, they outlived ``destroy_process_group`` and could abort the job's exit."""

    def __init__(self) -> None:
        self._group: Callable[[], Any] = lambda: None
        self._of: Callable[[], Any] = lambda: None

    def get(self) -> Any:
        group = self._group()
        if group is None or self._of() is not dist.group.WORLD:
            group = dist.new_group(backend="gloo")
            self._group, self._of = weakref.ref(group), weakref.ref(dist.group.WORLD)
        return group


def write(plan: Plan, *, group: Any = None) -> str:
    """Write ``plan``, commit it, return its URL; sharded, every rank of ``group`` calls it and
    returns the same URL or raises the same ``CheckpointError`` (nothing committed)."""
    sharded, fsync, name = plan.tensors is not None, plan.given.durable, plan.manifest.name
    first = not sharded or dist.get_rank(group) == 0  # rank 0 opens and commits alone
    staging: Location | None = None
    try:
        begun = _agreed(
            lambda: storage.begin(plan.directory, name).name, group, sharded, here=first
        )
        staging = plan.directory.child(begun[0])
        records: dict[str, storage.FileRecord] = {}
        if sharded:
            from steplib.checkpoint import dcp

            records = dcp.write(plan, staging, group=group)  # DCP agrees on its failures

        def write_files() -> dict[str, storage.FileRecord]:
            for file, tree in plan.files.items():
                records[file] = storage.write_tensors(staging.child(file), tree, fsync=fsync)
            return records

        written = _agreed(write_files, group, sharded)

        def commit() -> str:
            files = dict(sorted(item for rank in written for item in rank.items()))
            manifest = dataclasses.replace(plan.manifest, files=files)
            storage.write_bytes(staging.child(MANIFEST), manifest.to_json(), fsync=fsync)
            return storage.commit(plan.directory, staging, name, fsync=fsync).url

        return str(_agreed(commit, group, sharded, here=first)[0])
    except Exception as err:
        # Sharded: only failures every rank agreed on, so every rank is here; the barrier makes
        # "save raised" mean "the staging directory is gone" on every rank.
        if not isinstance(err, CheckpointError if sharded else OSError):
            raise
        if staging is not None and staging.is_local and first:
            storage.remove(staging)
        if sharded:
            dist.barrier(group=group)
        detail = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"save could not write the checkpoint {plan.url} ({detail}); nothing was committed. "
            "Pass a directory every rank can write (its path, permissions, free space and "
            "credentials; one shared filesystem or object store for all nodes)."
        ) from err


def save(
    state: TrainState,
    directory: str,
    *,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    metrics: Mapping[str, Any] | None = None,
    storage_options: StorageOptions = None,
    durable: bool = True,
    trainable_only: bool = False,
) -> str:
    """Write a checkpoint of ``state`` into ``directory`` and commit it atomically. A sharded
    state (DDP, FSDP2 or DTensor parameters) is saved through DCP: call it on every rank.

    Args:
        state: the TrainState to save (``docs/checkpoints.md`` lists what it holds).
        directory: a local path or fsspec URL of the directory of checkpoints.
        data: the loader whose position to save (``steplib.data.resumable_loader``).
        extras: more objects with ``state_dict()`` to save, by name (an EMA, a metric).
        step: the Step that trains ``state``; ``load`` checks its composition.
        metrics: numbers recorded in the manifest (what ``keep_best`` ranks by).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).
        durable: fsync before returning (``False``: still atomic and checksummed, but a power
            loss soon after may lose it; resuming then skips it).
        trainable_only: the trainable parameters alone (adapters), with a digest of the
            frozen rest that ``load`` checks.

    Returns:
        The checkpoint's URL: ``<directory>/step-<step>`` (``...-micro-<n>`` mid-window).

    Raises:
        ConfigError: a bad argument, or a value a weights-only load could not read back.
        CheckpointError: the directory cannot be written, or its filesystem is not installed.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> save(state, "memory://doctest-save/ckpt")
        'memory://doctest-save/ckpt/step-00000000'
    """
    given = Checkpoints(directory, data, extras, step, storage_options, durable, trainable_only)
    return given.save(state, metrics=metrics)


def load(
    url: str,
    state: TrainState,
    *,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    storage_options: StorageOptions = None,
) -> TrainState:
    """Load the checkpoint at ``url`` into the objects of ``state``; return the resumed state.
    Every file is verified and the checkpoint checked against ``state`` before anything
    changes (``weights_only=True``). A sharded one loads into any number of ranks.

    Args:
        url: a checkpoint, as returned by :func:`save` or ``latest``.
        state: a TrainState built like the saved one (model, optimizer, scheduler, scaler).
        data, extras: what was given to ``save``, to load into (the same names).
        step: the Step you resume with, compared with the saved composition.
        storage_options: passed to fsspec.

    Returns:
        The state at the saved counters (an epoch that ended at the save: the next one).

    Raises:
        CheckpointError: no checkpoint at ``url`` (never committed, or a directory of them).
        CorruptCheckpointError: a file is truncated, altered or missing (the error names it).
        ConfigError: the checkpoint does not fit ``state`` or was trained by another step.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> load(save(state.replace(step=7), "memory://doctest-load/ckpt"), state).step
        7
    """
    return Checkpoints(url, data, extras, step, storage_options).load(url, state)

"""``save`` and ``load``: checkpoints of a TrainState through fsspec (a local path,
``file://``, ``memory://``, ``s3://``, ...).

A checkpoint is a directory named after the counters (``step-00000120``) inside the directory
you pass to :func:`save`; see ``storage`` for how it is committed atomically, ``contents`` for
what it holds and ``listing`` for how the newest is found.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import torch

from steplib.checkpoint import sharded, storage
from steplib.checkpoint.contents import (
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    apply,
    check_arguments,
    check_fingerprint,
    check_metrics,
    gather,
)
from steplib.checkpoint.errors import CheckpointError, CorruptCheckpointError
from steplib.checkpoint.listing import (
    StorageOptions,
    candidates,
    committed_manifest,
    read_manifest,
    warn_skipped,
)
from steplib.checkpoint.manifest import (
    MANIFEST,
    SHARDED,
    Manifest,
    checkpoint_name,
    library_versions,
)
from steplib.checkpoint.storage import FileRecord, Location
from steplib.errors import ConfigError, describe
from steplib.state import TrainState


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan:
    """Everything a save writes, gathered at one moment (the trees may be live tensors)."""

    directory: Location
    name: str
    trees: dict[str, Any]
    manifest: Manifest  # its ``files`` and ``versions`` are filled in by ``write``

    @property
    def url(self) -> str:
        return self.directory.child(self.name).url


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
) -> str:
    """Write a checkpoint of ``state`` into ``directory`` and commit it atomically.

    With a DDP or FSDP2 model, or one holding DTensor parameters (``apply_tp``), and an
    initialised process group it is a sharded checkpoint
    (torch.distributed.checkpoint): call it on every rank at the same update (it is a
    collective); each rank writes its shard, rank 0 the manifest. See ``sharded.py``.

    ``durable=False`` skips the fsyncs of the files and directories on a local disk (a plain
    ``torch.save`` does none either); the save stays atomic and checksummed. What is lost is
    only this: if the machine loses power, its kernel crashes or it is reset within the
    kernel's write-back delay after ``save`` returned (about 30 s by default on Linux), the
    newest checkpoint may be missing, or have truncated or zeroed files. Such a checkpoint
    fails its checksums (or has no manifest), and ``latest`` / ``resume_from`` skip it with a
    warning and resume from the newest valid one. If only the process dies (an exception,
    SIGKILL, the OOM killer), nothing is lost: the kernel still writes the data back. Keep
    more than one checkpoint (``keep_last >= 2``): with one, the checkpoint to fall back to
    may have been pruned for a newest one that never reached the disk. Object stores
    (``s3://``) and ``memory://`` have no fsync: there ``durable`` changes nothing.

    Args:
        state: the TrainState to save: model, optimizer, scheduler, scaler, every counter, the
            accumulation window (with its gradients when one is open) and ``state.extras``.
        directory: a local path or fsspec URL of the directory that holds the checkpoints.
        data: the data loader whose position to save (e.g. ``steplib.data.resumable_loader``).
        extras: more objects to save by name, each with ``state_dict()`` (an EMA, a metric).
        step: the Step that trains ``state``; its composition is saved and checked by ``load``.
        metrics: numbers to record in the manifest (what ``keep_best`` ranks checkpoints by).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).
        durable: fsync the checkpoint before returning (``True``, the default), or leave the
            write-back to the kernel (``False``: faster; see above for what may be lost).

    Returns:
        The URL of the new checkpoint: ``<directory>/step-<step>`` (or
        ``.../step-<step>-micro-<micro_step>`` inside an open accumulation window).

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
    check_durable(durable, "save")
    # A DDP, FSDP2 or DTensor state with a process group: a sharded (DCP) checkpoint, written
    # by every rank together; see sharded.py.
    if sharded.is_sharded(state):
        sharded_plan = sharded.prepare_sharded(
            state,
            directory,
            data=data,
            extras=extras,
            step=step,
            metrics=metrics,
            storage_options=storage_options,
            caller="save",
        )
        return sharded.write_sharded(sharded_plan, fsync=durable)
    plan = prepare(
        state,
        directory,
        data=data,
        extras=extras,
        step=step,
        metrics=metrics,
        storage_options=storage_options,
        caller="save",
    )
    return write(plan, fsync=durable)


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

    Every file is verified against its checksum and the checkpoint is checked against
    ``state`` before anything changes. Then the parameters, optimizer, scheduler and scaler of
    ``state`` are loaded in place, the accumulation window's gradients are restored, the data
    position is loaded into ``data``, the global RNG states (torch, CUDA, numpy, ``random``)
    are set, and a new state with the saved counters and extras is returned. Files are read
    with ``torch.load(..., weights_only=True)``: loading never runs pickled code.

    A sharded checkpoint (saved by DDP, FSDP2 or tensor-parallel ranks) loads into any number
    of ranks and into a plain module (DCP reshards); such a state loads it on every rank
    together.
    DCP reads its own ``.metadata`` file with pickle, after its checksum has passed.

    Args:
        url: a checkpoint URL, as returned by :func:`save` or :func:`latest`.
        state: a TrainState built like the saved one (same model, optimizer, scheduler, scaler).
        data: the loader to continue from the saved position (the one given to ``save``).
        extras: the objects given to ``save(extras=...)``, by the same names, to load into.
        step: the Step you resume with: compared with the saved composition.
        storage_options: passed to fsspec.

    Returns:
        The state at the saved counters. A checkpoint taken after the last batch of an epoch,
        before the loop counted it, resumes at the start of the next epoch (``epoch + 1``).

    Raises:
        CheckpointError: no checkpoint at ``url`` (never committed, or a directory of them).
        CorruptCheckpointError: a file is truncated, altered or missing (the error names it).
        ConfigError: the checkpoint does not fit ``state`` (other parameter names, optimizer,
            scheduler, scaler or extras) or was trained by another step composition.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> url = save(state.replace(step=7), "memory://doctest-load/ckpt")
        >>> load(url, state).step
        7
    """
    extras = check_arguments("load", state, data=data, extras=extras, step=step)
    state.fence.wait()  # an async save may still be copying what we overwrite
    location = storage.resolve(url, storage_options, caller="load")
    manifest = read_manifest(location)
    if manifest.layout == SHARDED:  # written by DCP (sharded.py); loads into any world size
        from steplib.checkpoint.sharded_load import load_sharded  # DCP: imported on use

        return load_sharded(
            location,
            manifest,
            state,
            data=data,
            extras=extras,
            step=step,
            storage_options=storage_options,
        )
    check_fingerprint(manifest.fingerprint, step, checkpoint=location.url)
    trees = _read_trees(location, manifest)
    return apply(trees, state, data=data, extras=extras, checkpoint=location.url)


def prepare(
    state: TrainState,
    directory: str,
    *,
    data: Any,
    extras: Mapping[str, Any] | None,
    step: Any,
    metrics: Mapping[str, Any] | None,
    storage_options: StorageOptions,
    caller: str,
) -> SavePlan:
    """Check the arguments and gather what a save writes (live tensors, not yet copied)."""
    extras = check_arguments(caller, state, data=data, extras=extras, step=step)
    location = storage.resolve(directory, storage_options, caller=caller)
    numbers = check_metrics(metrics, caller)
    # As JSON values (tuples become lists, odd settings strings), as load will compare them.
    fingerprint = None if step is None else orjson.loads(orjson.dumps(step.describe(), default=str))
    trees = gather(state, data=data, extras=extras)
    name = checkpoint_name(state.step, state.micro_step, state.window_size)
    manifest = Manifest(
        name=name,
        step=state.step,
        micro_step=state.micro_step,
        epoch=state.epoch,
        window_size=state.window_size,
        time=time.time(),
        metrics=numbers,
        fingerprint=fingerprint,
        versions={},  # filled in by write: not read while an async save's caller waits
        files={},
    )
    return SavePlan(location, name, trees, manifest)


def check_durable(durable: Any, caller: str) -> None:
    """Refuse a ``durable`` that is not a bool (``"no"`` or ``0`` would read as intended).

    Raises:
        ConfigError: ``durable`` is not ``True`` or ``False``.
    """
    if not isinstance(durable, bool):
        raise ConfigError(
            f"{caller}(durable=...) received {describe(durable)}; it says whether the "
            "checkpoint is fsync'ed to disk before the save counts as done and must be True or "
            "False. Pass durable=True (the default: a power loss cannot lose a finished save) "
            "or durable=False (faster; a power loss soon after may lose the newest checkpoint, "
            "and resuming falls back to the previous one)."
        )


def write(plan: SavePlan, *, fsync: bool = True) -> str:
    """Write and commit a :class:`SavePlan`; return the checkpoint's URL. ``fsync=False``:
    not durable (no fsync of files or directories), still atomic and checksummed.

    Raises:
        CheckpointError: any I/O error (what was written so far stays uncommitted).
    """
    staging = None
    try:
        staging = storage.begin(plan.directory, plan.name)
        records = {
            file_name: storage.write_tensors(staging.child(file_name), tree, fsync=fsync)
            for file_name, tree in plan.trees.items()
        }
        manifest = dataclasses.replace(plan.manifest, files=records, versions=library_versions())
        storage.write_bytes(staging.child(MANIFEST), manifest.to_json(), fsync=fsync)
        final = storage.commit(plan.directory, staging, plan.name, fsync=fsync)
    except OSError as err:
        if staging is not None and staging.is_local:
            storage.remove(staging)
        raise CheckpointError(
            f"save could not write the checkpoint {plan.url} ({type(err).__name__}: {err}). "
            f"Pass a directory you can write to (check the path, its permissions, free space "
            "and credentials); nothing was committed and older checkpoints are intact."
        ) from err
    return final.url


def load_newest(
    directory: str,
    state: TrainState,
    *,
    data: Any,
    extras: Mapping[str, Any] | None,
    step: Any,
    storage_options: StorageOptions,
) -> tuple[str, TrainState] | None:
    """Load the newest valid checkpoint of ``directory``, skipping corrupt ones with a warning.

    Each file is read once (verified while loading), unlike ``load(latest(...))``.

    Returns:
        ``(url, state)``, or ``None`` when ``directory`` holds no committed checkpoint.

    Raises:
        CorruptCheckpointError: there are committed checkpoints, and every one is corrupt.
    """
    location = storage.resolve(directory, storage_options, caller="resume_from")
    corrupt: list[str] = []
    for checkpoint in candidates(location, newest_first=True):
        try:
            if committed_manifest(checkpoint) is None:
                continue
            loaded = load(
                checkpoint.url,
                state,
                data=data,
                extras=extras,
                step=step,
                storage_options=storage_options,
            )
            return checkpoint.url, loaded
        except CorruptCheckpointError as err:
            warn_skipped(err)
            corrupt.append(checkpoint.name)
    if corrupt:
        # Starting fresh here would silently throw the run away (and retention would then
        # delete the evidence): a person should decide.
        raise CorruptCheckpointError(
            f"every checkpoint in {location.url} is corrupt ({', '.join(corrupt)}; the "
            "warnings say why), so there is nothing valid to resume from. Restore them from a "
            "copy, or move them away to start the run fresh."
        )
    return None


def _read_trees(location: Location, manifest: Manifest) -> dict[str, Any]:
    missing = {MODEL, OPTIMIZER, TRAIN_STATE} - manifest.files.keys()
    if missing:
        raise CorruptCheckpointError(
            f"checkpoint {location.url}: its manifest lists no {', '.join(sorted(missing))}; it "
            "was not written by steplib's save. Use another checkpoint."
        )
    if location.is_local:
        return _read_local_trees(location, manifest)
    trees = {}
    for file_name, record in manifest.files.items():
        data = storage.read_verified(location.child(file_name), record, checkpoint=location.url)
        trees[file_name] = _torch_load(io.BytesIO(data), location, file_name)
    return trees


def _read_local_trees(location: Location, manifest: Manifest) -> dict[str, Any]:
    # torch.load reads a path with its own C++ reader, several times faster than from bytes
    # in memory; the checksums are computed meanwhile in a thread (zlib and file reads release
    # the GIL). Nothing is applied to the state before every checksum has passed.
    with ThreadPoolExecutor(1, thread_name_prefix="steplib-verify") as pool:
        checks = [
            pool.submit(_verify, location.child(name), record, location.url)
            for name, record in manifest.files.items()
        ]
        trees = {}
        try:
            for file_name in manifest.files:
                trees[file_name] = _torch_load(location.child(file_name).path, location, file_name)
        except CorruptCheckpointError:
            for check in checks:
                check.result()  # a failed checksum is the better explanation of a failed load
            raise
        for check in checks:
            check.result()
    return trees


def _verify(location: Location, record: FileRecord, checkpoint: str) -> None:
    storage.verify_local(location, record, checkpoint=checkpoint)


def _torch_load(source: Any, location: Location, file_name: str) -> Any:
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint {location.url}: its file {file_name} is missing although the manifest "
            "lists it. Use an older checkpoint (latest() and resume_from() skip this one)."
        ) from None
    except Exception as err:  # any failure to parse the file: UnpicklingError, RuntimeError...
        raise CorruptCheckpointError(
            f"checkpoint {location.url}: its file {file_name} cannot be read by "
            f"torch.load(weights_only=True) ({err}). If its checksum passes, it was written by "
            "another program or torch version: load it with that version or use another "
            "checkpoint."
        ) from err

"""``save``: a checkpoint of a TrainState through fsspec (a local path, ``file://``,
``memory://``, ``s3://``, ...), committed atomically.

A checkpoint is a directory named after the counters (``step-00000120``) inside the directory
you pass to :func:`save`; see ``storage`` for how it is committed atomically, ``contents`` for
what it holds, ``loading`` for how it is read back and ``listing`` for how the newest is found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from steplib.checkpoint import checksummed, storage
from steplib.checkpoint.contents import check_arguments, check_metrics, gather
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.manifest import MANIFEST, Manifest, library_versions
from steplib.checkpoint.sharded.layout import is_sharded
from steplib.checkpoint.sharded.save import prepare_sharded, write_sharded
from steplib.checkpoint.storage import Location
from steplib.errors import CheckpointError, ConfigError, describe
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
    collective); each rank writes its shard, rank 0 the manifest. See
    ``steplib.checkpoint.sharded``.

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
    # by every rank together; see steplib.checkpoint.sharded.
    arguments: dict[str, Any] = {"data": data, "extras": extras, "step": step}
    arguments.update(metrics=metrics, storage_options=storage_options, caller="save")
    if is_sharded(state):
        return write_sharded(prepare_sharded(state, directory, **arguments), fsync=durable)
    return write(prepare(state, directory, **arguments), fsync=durable)


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
    trees = gather(state, data=data, extras=extras)
    manifest = Manifest.of(state, metrics=numbers, step=step)
    name = manifest.name
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
            file_name: checksummed.write_tensors(staging.child(file_name), tree, fsync=fsync)
            for file_name, tree in plan.trees.items()
        }
        manifest = dataclasses.replace(plan.manifest, files=records, versions=library_versions())
        checksummed.write_bytes(staging.child(MANIFEST), manifest.to_json(), fsync=fsync)
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

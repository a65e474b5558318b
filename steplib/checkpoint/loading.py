"""``load``: a checkpoint back into a TrainState, every file verified against its checksum
and the checkpoint checked against the state before anything changes (``restore``); and
``load_newest``, which falls back past corrupt checkpoints.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from steplib.checkpoint import checksummed, storage
from steplib.checkpoint.checksummed import FileRecord
from steplib.checkpoint.contents import MODEL, OPTIMIZER, TRAIN_STATE, check_arguments, read_tree
from steplib.checkpoint.listing import StorageOptions, newest_valid, read_manifest
from steplib.checkpoint.manifest import SHARDED, Manifest
from steplib.checkpoint.restore import apply, check_fingerprint
from steplib.checkpoint.storage import Location
from steplib.errors import CorruptCheckpointError
from steplib.state import TrainState


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
        >>> from steplib.checkpoint import save
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
    if manifest.layout == SHARDED:  # written by DCP (sharded/); loads into any world size
        from steplib.checkpoint.sharded.load import load_sharded  # DCP: imported on use

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

    def read(checkpoint: Location, manifest: Manifest) -> TrainState:
        return load(
            checkpoint.url,
            state,
            data=data,
            extras=extras,
            step=step,
            storage_options=storage_options,
        )

    found = newest_valid(location, read)
    if isinstance(found, tuple):
        return found
    if found:
        # Starting fresh here would silently throw the run away (and retention would then
        # delete the evidence): a person should decide.
        raise CorruptCheckpointError(
            f"every checkpoint in {location.url} is corrupt ({', '.join(found)}; the "
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
        data = checksummed.read_verified(location.child(file_name), record, checkpoint=location.url)
        trees[file_name] = read_tree(io.BytesIO(data), location.url, file_name)
    return trees


def _read_local_trees(location: Location, manifest: Manifest) -> dict[str, Any]:
    # torch.load reads a path with its own C++ reader, several times faster than from bytes
    # in memory; the checksums are computed meanwhile in a thread (xxhash and file reads release
    # the GIL). Nothing is applied to the state before every checksum has passed.
    with ThreadPoolExecutor(1, thread_name_prefix="steplib-verify") as pool:
        checks = [
            pool.submit(_verify, location.child(name), record, location.url)
            for name, record in manifest.files.items()
        ]
        trees = {}
        try:
            for file_name in manifest.files:
                trees[file_name] = read_tree(
                    location.child(file_name).path, location.url, file_name
                )
        except CorruptCheckpointError:
            for check in checks:
                check.result()  # a failed checksum is the better explanation of a failed load
            raise
        for check in checks:
            check.result()
    return trees


def _verify(location: Location, record: FileRecord, checkpoint: str) -> None:
    checksummed.verify_local(location, record, checkpoint=checkpoint)

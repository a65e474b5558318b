"""Which checkpoints a directory holds: ``latest`` and ``list_checkpoints``, and the scan
that retention uses.

A checkpoint exists once its manifest does (it is written last); names sort in training order,
so the newest is found without reading every manifest.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from steplib.checkpoint import checksummed, storage
from steplib.checkpoint.manifest import MANIFEST, Manifest, sort_key
from steplib.checkpoint.storage import Location
from steplib.errors import CheckpointError, CheckpointWarning, CorruptCheckpointError

StorageOptions = Mapping[str, Any] | None
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint, as listed by :func:`list_checkpoints`.

    Attributes:
        url: pass it to ``steplib.checkpoint.load``.
        name: its directory name (``step-00000120``).
        step, micro_step, epoch: the counters it was taken at.
        time: when it was taken (unix seconds).
        metrics: the numbers saved with it.
    """

    url: str
    name: str
    step: int
    micro_step: int
    epoch: int
    time: float
    metrics: Mapping[str, float]


def latest(
    directory: str, *, verify: bool = True, storage_options: StorageOptions = None
) -> str | None:
    """The newest valid checkpoint in ``directory``, or ``None`` when there is none.

    Only committed checkpoints count (a save that did not finish is invisible). With
    ``verify`` every file of the candidate is read and checked; a corrupt checkpoint is
    skipped with a :class:`CheckpointWarning` that names the file, and the next older one is
    tried.

    Args:
        directory: the directory given to ``steplib.checkpoint.save``.
        verify: check the checksums (reads every file of the newest checkpoint); ``False``
            only checks that its manifest is readable.
        storage_options: passed to fsspec.

    Returns:
        The checkpoint's URL, or ``None`` (also when ``directory`` does not exist).

    Raises:
        CheckpointError: the filesystem of ``directory`` is not installed.

    Example:
        >>> latest("memory://doctest-latest/nothing-here") is None
        True
    """
    location = storage.resolve(directory, storage_options, caller="latest")

    def check(checkpoint: Location, manifest: Manifest) -> None:
        if verify:  # else a readable manifest is enough
            for file_name, record in manifest.files.items():
                checksummed.verify(checkpoint.child(file_name), record, checkpoint=checkpoint.url)

    found = newest_valid(location, check)
    return found[0] if isinstance(found, tuple) else None


def list_checkpoints(
    directory: str, *, storage_options: StorageOptions = None
) -> list[CheckpointInfo]:
    """The committed checkpoints in ``directory``, oldest first (files are not verified).

    A checkpoint whose manifest cannot be read is left out with a :class:`CheckpointWarning`.

    Args:
        directory: the directory given to ``steplib.checkpoint.save``.
        storage_options: passed to fsspec.

    Returns:
        One :class:`CheckpointInfo` per checkpoint (none when ``directory`` does not exist).

    Raises:
        CheckpointError: the filesystem of ``directory`` is not installed.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> from steplib.checkpoint import save
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> for s in (1, 2):
        ...     _ = save(state.replace(step=s), "memory://doctest-list/ckpt", metrics={"loss": s})
        >>> [(c.name, c.metrics["loss"]) for c in list_checkpoints("memory://doctest-list/ckpt")]
        [('step-00000001', 1.0), ('step-00000002', 2.0)]
    """
    location = storage.resolve(directory, storage_options, caller="list_checkpoints")
    infos = []
    for checkpoint in candidates(location, newest_first=False):
        try:
            manifest = committed_manifest(checkpoint)
        except CorruptCheckpointError as err:
            warn_skipped(err)
            continue
        if manifest is not None:
            infos.append(_info(checkpoint, manifest))
    return infos


def scan(location: Location) -> tuple[list[CheckpointInfo], list[Location]]:
    """Committed checkpoints (oldest first) and everything else that looks like a checkpoint
    directory but is not a valid committed one (uncommitted, corrupt manifest, staging)."""
    infos: list[CheckpointInfo] = []
    other: list[Location] = []
    for name in storage.list_names(location):
        if name.startswith((storage.STAGING_PREFIX, storage.TRASH_PREFIX)):
            other.append(location.child(name))
    for checkpoint in candidates(location, newest_first=False):
        try:
            manifest = committed_manifest(checkpoint)
        except CorruptCheckpointError:
            manifest = None
        if manifest is None:
            other.append(checkpoint)
        else:
            infos.append(_info(checkpoint, manifest))
    return infos, other


def read_manifest(location: Location) -> Manifest:
    manifest = committed_manifest(location)
    if manifest is not None:
        return manifest
    if any(sort_key(name) for name in storage.list_names(location)):
        raise CheckpointError(
            f"load received {location.url!r}, a directory of checkpoints, not one "
            "checkpoint. Load the newest with load(latest(url), state), or use "
            "resume_from(url) as a fit_start handler."
        )
    raise CheckpointError(
        f"load received {location.url!r}, where there is no checkpoint (no {MANIFEST}): "
        "it does not exist, or its save never finished (the manifest is written last). "
        "Pick one with latest(directory) or list_checkpoints(directory)."
    )


def committed_manifest(location: Location) -> Manifest | None:
    """The checkpoint's manifest, or ``None`` when it has none (never committed)."""
    try:
        data = storage.read_bytes(location.child(MANIFEST))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return Manifest.from_json(data, checkpoint=location.url)


def candidates(location: Location, *, newest_first: bool) -> Iterator[Location]:
    keyed = [(key, name) for name in storage.list_names(location) if (key := sort_key(name))]
    for _, name in sorted(keyed, reverse=newest_first):
        yield location.child(name)


def newest_valid(
    location: Location, read: Callable[[Location, Manifest], T]
) -> tuple[str, T] | list[str]:
    """``(url, read(checkpoint, manifest))`` for the newest committed checkpoint of
    ``location`` that ``read`` gets through without a :class:`CorruptCheckpointError`; each
    corrupt one on the way is skipped with a :class:`CheckpointWarning`.

    Returns:
        The URL and what ``read`` returned; else the names of the corrupt checkpoints skipped
        (an empty list: ``location`` holds no committed checkpoint).
    """
    corrupt: list[str] = []
    for checkpoint in candidates(location, newest_first=True):
        try:
            manifest = committed_manifest(checkpoint)
            if manifest is not None:
                return checkpoint.url, read(checkpoint, manifest)
        except CorruptCheckpointError as err:
            warn_skipped(err, stacklevel=4)  # for latest(): the line that called it
            corrupt.append(checkpoint.name)
    return corrupt


def warn_skipped(err: CorruptCheckpointError, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{err} Skipped; falling back to the previous checkpoint.",
        CheckpointWarning,
        stacklevel=stacklevel,
    )


def _info(location: Location, manifest: Manifest) -> CheckpointInfo:
    return CheckpointInfo(
        url=location.url,
        name=location.name,
        step=manifest.step,
        micro_step=manifest.micro_step,
        epoch=manifest.epoch,
        time=manifest.time,
        metrics=dict(manifest.metrics),
    )

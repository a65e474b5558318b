"""``manifest.json``, the last file of a checkpoint (its commit and table of contents, with a
CRC32 of its own), and which checkpoints a directory holds, by names that sort in training
order: ``step-00000120``, ``step-00000120-micro-00000483`` mid-window."""

from __future__ import annotations

import dataclasses
import math
import re
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from importlib import metadata
from platform import python_version
from typing import Any, TypeVar

import orjson
import torch

from steplib.checkpoint import storage
from steplib.checkpoint.storage import XXH3_64, FileRecord, Location, StorageOptions
from steplib.errors import (
    CheckpointError,
    CheckpointWarning,
    ConfigError,
    CorruptCheckpointError,
    describe,
)

T = TypeVar("T")
FORMAT = "steplib-checkpoint"
# Format 5: steplib 0.2. Older ones (1 and 2: steplib 0.1; 3, 4: 0.2's development) are refused.
VERSION = 5
MANIFEST = "manifest.json"
SINGLE, SHARDED = "single", "sharded"  # layouts: torch files, DCP
_NAME = re.compile(r"^step-(\d{8,})(?:-micro-(\d{8,}))?$")


Key = tuple[int, int]  # a checkpoint's place in training order


def sort_key(name: str) -> Key | None:
    """``(step, micro_step or -1)`` of a checkpoint name, or ``None`` if it is not one."""
    match = _NAME.match(name)
    return None if match is None else (int(match[1]), int(match[2]) if match[2] else -1)


def checkpoint_key(state: Any) -> Key:
    """Where a checkpoint of ``state`` sorts (its micro-step only inside a window)."""
    return state.step, state.micro_step if state.window.size else -1


def checkpoint_name(state: Any) -> str:
    step, micro = checkpoint_key(state)
    return f"step-{step:08d}" + (f"-micro-{micro:08d}" if micro >= 0 else "")


def fingerprint(step: Any, *, caller: str = "save") -> list[dict[str, Any]] | None:
    """The composition of ``step`` (a Step, or steps by name: their wrappers named ``"D:clip"``)
    as JSON values, as ``load`` compares it, or ``None``; ``ConfigError`` for anything else."""
    if step is None:
        return None
    several = isinstance(step, Mapping)
    for one in step.values() if several else (step,):
        if not callable(getattr(one, "describe", None)):
            raise ConfigError(
                f"{caller}(step=...) received {describe(step)}, which is not a Step. Pass the "
                'step you train with, the steps by name ({"D": d_step, "G": g_step}), or None.'
            )
    if several:
        described = [{"wrapper": "steps", "names": list(step)}] + [
            {**d, "wrapper": f"{name}:{d['wrapper']}"}
            for name, one in step.items()
            for d in one.describe()
        ]
    else:
        described = step.describe()
    return list(orjson.loads(orjson.dumps(described, default=_same_in_every_process)))


def _same_in_every_process(value: Any) -> str:
    """A setting JSON cannot hold as text another process computes alike: ``str(value)``, or,
    where that holds a memory address (``<function f at 0x...>``), the function's or type's name."""
    text = str(value)
    if " at 0x" not in text:
        return text
    named = value if isinstance(getattr(value, "__qualname__", None), str) else type(value)
    return f"{named.__module__}.{named.__qualname__}"


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """The contents of ``manifest.json`` (``files``: each file's record by its path)."""

    name: str
    step: int
    micro_step: int
    epoch: int
    window_size: int
    time: float
    metrics: Mapping[str, float]
    fingerprint: list[dict[str, Any]] | None
    versions: Mapping[str, str]
    files: Mapping[str, FileRecord]
    layout: str  # SINGLE or SHARDED
    world_size: int

    @classmethod
    def of(cls, state: Any, *, metrics: Any, step: Any, layout: str, world: int) -> Manifest:
        """A checkpoint of ``state`` now (``files``: filled in by ``write``)."""
        name = checkpoint_name(state)
        counters = (state.step, state.micro_step, state.epoch, state.window.size)
        try:
            steplib = metadata.version("steplib")
        except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
            steplib = "unknown"
        versions = {"steplib": steplib, "torch": torch.__version__, "python": python_version()}
        described = fingerprint(step)
        return cls(name, *counters, time.time(), metrics, described, versions, {}, layout, world)

    def to_json(self) -> bytes:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body.update(
            format=FORMAT,
            version=VERSION,
            # NaN/inf are not JSON; a metric that diverged ranks last anyway.
            metrics={k: (v if math.isfinite(v) else None) for k, v in self.metrics.items()},
            files={k: {"bytes": r.size, XXH3_64: r.checksum} for k, r in self.files.items()},
        )
        body["manifest_crc32"] = _body_crc(body)
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes, *, checkpoint: str) -> Manifest:
        """Parse and check a manifest (``CorruptCheckpointError``: not one, or altered)."""
        try:
            body = orjson.loads(data)
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise ValueError("not a steplib checkpoint manifest")
            stored, crc = body.pop("manifest_crc32", None), _body_crc(body)
            if stored != crc:
                raise ValueError(f"its CRC32 is {crc}, it says {stored}: it was altered")
            if body["version"] != VERSION:
                raise ValueError(_other_version(body["version"], checkpoint))
            fields = {f.name: body[f.name] for f in dataclasses.fields(cls)}
            metrics = {k: math.nan if v is None else v for k, v in body["metrics"].items()}
            files = {k: FileRecord(v["bytes"], v[XXH3_64]) for k, v in body["files"].items()}
            return cls(**{**fields, "metrics": metrics, "files": files})
        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint}: its file {MANIFEST} cannot be read ({err}). Use "
                "another checkpoint (latest() and resume_from() skip this one)."
            ) from None


def _body_crc(body: Mapping[str, Any]) -> str:
    return f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"


def _other_version(version: int, checkpoint: str) -> str:
    if version > VERSION:
        return f"format version {version} is newer than this steplib reads ({VERSION}); upgrade"
    return (
        f"format version {version} was written by an earlier steplib (0.1 wrote 1 and 2), which "
        "this one no longer reads; resume it with that steplib, or start from the weights of a "
        f"single-process one: load_weights(model, '{checkpoint}/model.pt')"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint, as :func:`list_checkpoints` lists it.

    Attributes:
        url: for ``load``; name: its directory's; step, micro_step, epoch: its counters;
        time: when taken (unix seconds); metrics: the numbers saved with it.
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
    """The newest valid checkpoint in ``directory``; a corrupt one is skipped with a
    ``CheckpointWarning`` naming the file.

    Args:
        directory: the directory given to ``save``.
        verify: check the checksums (``False``: only that the manifest is readable).
        storage_options: passed to fsspec.

    Returns:
        Its URL, or ``None`` (none there, or no such directory).

    Example:
        >>> latest("memory://doctest-latest/nothing-here") is None
        True
    """
    location = storage.resolve(directory, storage_options, caller="latest")
    found = newest_valid(location, lambda c, m: storage.verify_all(c, m.files) if verify else None)
    return found[0] if isinstance(found, tuple) else None


def list_checkpoints(
    directory: str, *, storage_options: StorageOptions = None
) -> list[CheckpointInfo]:
    """The committed checkpoints in ``directory``, not verified (one whose manifest cannot be
    read is left out with a ``CheckpointWarning``).

    Args:
        directory: the directory given to ``save``.
        storage_options: passed to fsspec.

    Returns:
        A :class:`CheckpointInfo` per checkpoint, oldest first.

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
    return scan(location, warn=True)[0]


def scan(location: Location, *, warn: bool = False) -> tuple[list[CheckpointInfo], list[Location]]:
    """Committed checkpoints (oldest first), and the debris: uncommitted, corrupt (warned about
    with ``warn``) or staging directories."""
    names = storage.list_names(location)
    prefixes = (storage.STAGING_PREFIX, storage.TRASH_PREFIX)
    debris = [location.child(name) for name in names if name.startswith(prefixes)]
    infos = []
    for checkpoint in candidates(location, names):
        try:
            manifest = committed_manifest(checkpoint)
        except CorruptCheckpointError as err:
            if warn:
                warn_skipped(err)
            manifest = None
        if manifest is None:
            debris.append(checkpoint)
        else:
            at = (manifest.step, manifest.micro_step, manifest.epoch, manifest.time)
            infos.append(CheckpointInfo(checkpoint.url, checkpoint.name, *at, {**manifest.metrics}))
    return infos, debris


def read_manifest(location: Location) -> Manifest:
    manifest = committed_manifest(location)
    if manifest is not None:
        return manifest
    if any(sort_key(name) for name in storage.list_names(location)):
        raise CheckpointError(
            f"load received {location.url!r}, a directory of checkpoints, not one. Load the "
            "newest with load(latest(url), state), or use resume_from(url)."
        )
    raise CheckpointError(
        f"load received {location.url!r}, where there is no checkpoint (no {MANIFEST}): never "
        "saved, or not finished. Pick one with latest(directory)."
    )


def committed_manifest(location: Location) -> Manifest | None:
    try:
        data = storage.read_bytes(location.child(MANIFEST))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return Manifest.from_json(data, checkpoint=location.url)


def candidates(location: Location, names: list[str], upto: Key | None = None) -> list[Location]:
    """The checkpoints among ``names`` (committed or not; none newer than ``upto``), oldest
    first."""
    keyed = sorted(
        (key, name) for name in names if (key := sort_key(name)) and (upto is None or key <= upto)
    )
    return [location.child(name) for _, name in keyed]


def newest_valid(
    location: Location, read: Callable[[Location, Manifest], T], *, upto: Key | None = None
) -> tuple[str, T] | list[str]:
    """``(url, read(checkpoint, manifest))`` of the newest checkpoint (none newer than
    ``upto``) ``read`` takes without a ``CorruptCheckpointError`` (each skipped warned about);
    else the corrupt ones' names."""
    corrupt: list[str] = []
    for checkpoint in reversed(candidates(location, storage.list_names(location), upto)):
        try:
            manifest = committed_manifest(checkpoint)
            if manifest is not None:
                return checkpoint.url, read(checkpoint, manifest)
        except CorruptCheckpointError as err:
            warn_skipped(err)
            corrupt.append(checkpoint.name)
    return corrupt


def warn_skipped(err: CorruptCheckpointError) -> None:
    # stacklevel 4: the line that called latest() or list_checkpoints()
    message = f"{err} Skipped; falling back to the previous checkpoint."
    warnings.warn(message, CheckpointWarning, stacklevel=4)

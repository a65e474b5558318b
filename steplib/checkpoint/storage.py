"""Where checkpoints live (fsspec URLs), how a directory of files is committed atomically (local:
a staging directory renamed into place; object stores: ``manifest.json`` written last), and
how each file is written and read back checksummed (XXH3-64)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import IO, Any

import fsspec
import torch
import torch.distributed as dist
import xxhash
from fsspec.implementations.local import LocalFileSystem

from steplib.errors import CheckpointError, ConfigError, CorruptCheckpointError, describe

StorageOptions = Mapping[str, Any] | None
STAGING_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
XXH3_64 = "xxh3_64"  # the checksum a manifest records
CHUNK_BYTES = 8 << 20  # read and checksummed at a time


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    """A directory or file: the URL as the user wrote it, and its fsspec filesystem and path."""

    url: str
    fs: Any
    path: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> Location:
        return Location(f"{self.url}/{name}", self.fs, f"{self.path}/{name}")


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    """Size and XXH3-64 (hex digits) of one file of a checkpoint."""

    size: int
    checksum: str


def resolve(url: Any, storage_options: StorageOptions, *, caller: str) -> Location:
    """A local path or URL as a :class:`Location`: ``ConfigError`` for a bad one,
    ``CheckpointError`` (naming what to install) for a filesystem not installed."""
    if not isinstance(url, str | os.PathLike) or not os.fspath(url):
        raise ConfigError(
            f"{caller} received the location {describe(url)}; pass a local path or an fsspec "
            "URL as a string, e.g. 'runs/exp1/checkpoints' or 's3://bucket/exp1/checkpoints'."
        )
    text = str(os.fspath(url))
    protocol = text.split("://", 1)[0] if "://" in text else "file"
    try:
        fs, path = fsspec.core.url_to_fs(text.rstrip("/") or text, **dict(storage_options or {}))
    except ImportError as err:  # fsspec's message names the package; s3 has a steplib extra
        extra = " (pip install 'steplib[s3]')" if protocol in ("s3", "s3a") else ""
        raise CheckpointError(
            f"{caller} received {text!r}, whose {protocol}:// filesystem is not installed: "
            f"{err}{extra}."
        ) from err
    except ValueError as err:
        raise ConfigError(
            f"{caller} received {text!r}, whose protocol {protocol!r} fsspec does not know "
            f"({err}). Use a local path or a protocol of fsspec.available_protocols()."
        ) from err
    return Location(text.rstrip("/") or text, fs, path.rstrip("/") or path)


def read_bytes(location: Location) -> bytes:
    return bytes(location.fs.cat_file(location.path))  # bytes already: no copy, typed


def list_names(directory: Location) -> list[str]:
    directory.fs.invalidate_cache(directory.path)  # another process may have written since
    try:
        entries = directory.fs.ls(directory.path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [name for entry in entries if (name := str(entry).rstrip("/").rsplit("/", 1)[-1])]


def check_writable(directory: Location, *, caller: str) -> None:
    """Create ``directory``, write and remove a probe file: fail at the start, not at a save."""
    probe = directory.child(f".steplib-write-test-{uuid.uuid4().hex[:8]}")
    try:
        directory.fs.makedirs(directory.path, exist_ok=True)
        write_bytes(probe, b"steplib", fsync=False)  # as a checkpoint's files are written
        directory.fs.rm(probe.path)
    except Exception as err:  # any filesystem's own error type: all mean "cannot save here"
        raise CheckpointError(
            f"{caller} cannot write checkpoints into {directory.url!r} ({type(err).__name__}: "
            f"{err}); nothing was trained yet. Pass a directory this process can write (its "
            "permissions, free space; an object store's storage_options)."
        ) from err


def begin(directory: Location, name: str) -> Location:
    """Create the directory ``name``'s files are written into: on a local disk a staging one
    (see :func:`commit`), elsewhere the final one, uncommitted first."""
    if directory.is_local:
        staging = directory.child(f"{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(staging.path)
        return staging
    final = directory.child(name)
    with contextlib.suppress(FileNotFoundError):
        directory.fs.rm(final.child("manifest.json").path)
    directory.fs.makedirs(final.path, exist_ok=True)
    return final


def commit(directory: Location, staging: Location, name: str, *, fsync: bool = True) -> Location:
    """Make the checkpoint written into ``staging`` visible under ``name``; return it."""
    final = directory.child(name)
    if not directory.is_local:
        return final  # the manifest, written last, was the commit
    if fsync:
        _fsync_dir(staging.path)
    # The same name saved again: moved aside, not deleted, so the rename is the only gap.
    trash = _move_aside(final) if os.path.exists(final.path) else None
    os.rename(staging.path, final.path)
    if fsync:
        _fsync_dir(directory.path)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def remove(location: Location) -> None:
    """Delete a checkpoint directory, uncommitted before any file goes."""
    if not location.is_local:
        with contextlib.suppress(FileNotFoundError):
            location.fs.rm(location.child("manifest.json").path)
        with contextlib.suppress(FileNotFoundError):
            location.fs.rm(location.path, recursive=True)
    elif os.path.exists(location.path):
        leftover = location.name.startswith((STAGING_PREFIX, TRASH_PREFIX))
        shutil.rmtree(location.path if leftover else _move_aside(location), ignore_errors=True)


def _move_aside(location: Location) -> str:
    # Renamed (atomic: the checkpoint disappears at once) to a name prune removes if we die.
    parent = location.path.rsplit("/", 1)[0]
    trash = f"{parent}/{TRASH_PREFIX}{location.name}-{uuid.uuid4().hex[:8]}"
    os.rename(location.path, trash)
    return trash


def _fsync_dir(path: str) -> None:
    # A rename is durable only once its directory is on disk; not possible on every OS.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


class ChecksumFile:
    """A write-only file that checksums and counts the bytes on their way to ``raw``."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.hasher, self.size = raw, xxhash.xxh3_64(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hasher.update(view)
        self.raw.write(view)
        self.size += view.nbytes
        return view.nbytes

    def __getattr__(self, name: str) -> Any:  # what else a writer asks for (DCP: tell, fileno)
        return getattr(self.raw, name)

    def record(self) -> FileRecord:
        return FileRecord(self.size, self.hasher.hexdigest())


def write_tensors(location: Location, tree: Any, *, fsync: bool) -> FileRecord:
    return _write(location, lambda file: torch.save(tree, file), fsync=fsync)


def write_bytes(location: Location, data: bytes, *, fsync: bool) -> FileRecord:
    return _write(location, lambda file: file.write(data), fsync=fsync)


def _write(location: Location, fill: Callable[[ChecksumFile], Any], *, fsync: bool) -> FileRecord:
    """Write ``location`` through a :class:`ChecksumFile`, fsync'ed with ``fsync`` (local)."""
    local = location.is_local
    with open(location.path, "wb") if local else location.fs.open(location.path, "wb") as raw:
        file = ChecksumFile(raw)
        fill(file)
        if fsync and local:
            raw.flush()
            os.fsync(raw.fileno())
    return file.record()


def file_digest(path: str) -> str:
    """The XXH3-64 of a local file, read in chunks."""
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as raw:
        while chunk := raw.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify(checkpoint: Location, name: str, record: FileRecord) -> str | io.BytesIO:
    """``CorruptCheckpointError`` unless the file ``name`` of ``checkpoint`` is as recorded;
    else what ``torch.load`` reads: its local path (checksummed as a stream) or its bytes."""
    file, data = checkpoint.child(name), b""
    try:
        if file.is_local:
            size = os.path.getsize(file.path)
            found = file_digest(file.path) if size == record.size else ""
        else:
            data = read_bytes(file)  # read once: verified, then parsed
            size, found = len(data), xxhash.xxh3_64_hexdigest(data)
    except FileNotFoundError:
        size, found = None, ""
    if size is None:
        problem = "is missing although the manifest lists it"
    elif size != record.size:
        problem = f"has {size} bytes, the manifest says {record.size}: truncated or overwritten"
    elif found != record.checksum:
        problem = f"has checksum xxh3_64 {found}, the manifest says {record.checksum}: altered"
    else:
        return file.path if file.is_local else io.BytesIO(data)
    raise CorruptCheckpointError(
        f"checkpoint {checkpoint.url}: its file {name} {problem}. Use an older checkpoint "
        "(latest() and resume_from() skip this one)."
    )


def verify_all(
    location: Location, files: Mapping[str, FileRecord], *, me: int = 0, world: int = 1
) -> None:
    """Verify every file, each of ``world`` ranks a share (a collective when ``world > 1``);
    every rank raises the same ``CorruptCheckpointError``."""
    error = None
    try:
        for name in sorted(files)[me::world]:
            verify(location, name, files[name])
    except CorruptCheckpointError as err:
        error = str(err)
    errors: list[Any] = [error] * world
    if world > 1:
        dist.all_gather_object(errors, error)
    if found := [e for e in errors if e is not None]:
        raise CorruptCheckpointError(found[0])

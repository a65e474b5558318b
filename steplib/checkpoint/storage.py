"""Where checkpoints live (fsspec URLs), how a directory of files is committed atomically, and
how each file is written and read back checksummed.

On a local disk the files go into a hidden staging directory (``.tmp-<name>-<random>``), each
fsync'ed, which is renamed to its final name (atomic) and its parent fsync'ed (``fsync=False``,
``durable=False``: no fsyncs, still atomic and checksummed). On object stores and others,
where a rename is a copy, the files are written in place and ``manifest.json`` last: a
directory without one is not a checkpoint. Checksums are ``xxh3_64`` of the bytes as written
(``crc32`` in checkpoints before steplib 0.2.0, still verified): they catch truncated and
altered files, not deliberate forgery."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import types
import uuid
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any

import fsspec
import torch
import torch.distributed as dist
import xxhash
from fsspec.implementations.local import LocalFileSystem

from steplib.errors import CheckpointError, ConfigError, CorruptCheckpointError, describe

StorageOptions = Mapping[str, Any] | None
# protocol -> (package that implements it, what to pip install)
_PACKAGES = types.MappingProxyType(
    {
        **dict.fromkeys(("s3", "s3a"), ("s3fs", "steplib[s3]")),
        **dict.fromkeys(("gs", "gcs"), ("gcsfs", "gcsfs")),
        **dict.fromkeys(("az", "abfs", "abfss", "adl"), ("adlfs", "adlfs")),
        "hf": ("huggingface_hub", "huggingface_hub"),
        **dict.fromkeys(("sftp", "ssh"), ("paramiko", "paramiko")),
        **dict.fromkeys(("http", "https"), ("aiohttp", "aiohttp")),
    }
)
STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
XXH3_64 = "xxh3_64"  # what new checkpoints record
CRC32 = "crc32"  # what checkpoints written before steplib 0.2.0 record
ALGORITHMS = (XXH3_64, CRC32)
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
    """Size and checksum (hex digits) of one file of a checkpoint, and the algorithm."""

    size: int
    checksum: str
    algorithm: str = XXH3_64


def resolve(url: Any, storage_options: StorageOptions, *, caller: str) -> Location:
    """Turn a local path or URL into a :class:`Location`: ``ConfigError`` for a bad one,
    ``CheckpointError`` (naming the package to install) for a filesystem not installed."""
    if not isinstance(url, str | os.PathLike) or not os.fspath(url):
        raise ConfigError(
            f"{caller} received the location {describe(url)}; pass a local path or an fsspec "
            "URL as a string, e.g. 'runs/exp1/checkpoints' or 's3://bucket/exp1/checkpoints'."
        )
    text = str(os.fspath(url))
    protocol = text.split("://", 1)[0] if "://" in text else "file"
    try:
        fs, path = fsspec.core.url_to_fs(text.rstrip("/") or text, **dict(storage_options or {}))
    except ImportError as err:
        package, extra = _PACKAGES.get(protocol, (None, None))
        hint = (
            f"install it with: pip install '{extra}' (the package {package})"
            if extra
            else "install the fsspec implementation it names"
        )
        raise CheckpointError(
            f"{caller} received {text!r}, whose {protocol}:// filesystem is not installed "
            f"({err}); {hint}."
        ) from err
    except ValueError as err:
        raise ConfigError(
            f"{caller} received {text!r}, whose protocol {protocol!r} fsspec does not know "
            f"({err}). Use a local path, file://, memory://, s3://, gs:// or another protocol "
            "listed by fsspec.available_protocols()."
        ) from err
    return Location(text.rstrip("/") or text, fs, path.rstrip("/") or path)


def read_bytes(location: Location) -> bytes:
    """All bytes of a file (``FileNotFoundError`` when there is none)."""
    data: bytes = location.fs.cat_file(location.path)
    return data


def list_names(directory: Location) -> list[str]:
    """Names of the entries of ``directory`` (none when it does not exist)."""
    directory.fs.invalidate_cache(directory.path)  # another process may have written since
    try:
        entries = directory.fs.ls(directory.path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [name for entry in entries if (name := str(entry).rstrip("/").rsplit("/", 1)[-1])]


def exists(location: Location) -> bool:
    return bool(location.fs.exists(location.path))


def check_writable(directory: Location, *, caller: str) -> None:
    """Create ``directory`` and write and remove a probe file, so that a directory that cannot
    be written fails when a run starts (``CheckpointError``), not at its first checkpoint."""
    probe = directory.child(f".steplib-write-test-{uuid.uuid4().hex[:8]}")
    try:
        directory.fs.makedirs(directory.path, exist_ok=True)
        with directory.fs.open(probe.path, "wb") as file:
            file.write(b"steplib")
        directory.fs.rm(probe.path)
    except Exception as err:  # any filesystem's own error type: all mean "cannot save here"
        raise CheckpointError(
            f"{caller} cannot write checkpoints into {directory.url!r} "
            f"({type(err).__name__}: {err}); nothing was trained yet. Pass a directory this "
            "process can create and write (check its permissions, free space and, for an "
            "object store, the credentials in storage_options)."
        ) from err


def begin(directory: Location, name: str) -> Location:
    """Create the directory the files of checkpoint ``name`` are written into, and return it:
    a hidden staging directory on a local disk (renamed by :func:`commit`); elsewhere the final
    directory, uncommitted first (its old manifest removed) before its files are overwritten."""
    if directory.is_local:
        staging = directory.child(f"{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(staging.path)
        return staging
    final = directory.child(name)
    if exists(final.child("manifest.json")):
        directory.fs.rm(final.child("manifest.json").path)
    directory.fs.makedirs(final.path, exist_ok=True)
    return final


def commit(directory: Location, staging: Location, name: str, *, fsync: bool = True) -> Location:
    """Make the checkpoint written into ``staging`` visible under ``name``; return it. With
    ``fsync`` the staging directory and, after the rename, its parent are fsync'ed."""
    final = directory.child(name)
    if not directory.is_local:
        return final  # the manifest, written last, was the commit
    if fsync:
        _fsync_dir(staging.path)
    trash = None
    if os.path.exists(final.path):
        # The same name saved again (at an epoch end after the same update): moved aside, not
        # deleted first, so that the rename stays the only gap.
        trash = directory.child(f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
        os.rename(final.path, trash.path)
    os.rename(staging.path, final.path)
    if fsync:
        _fsync_dir(directory.path)
    if trash is not None:
        shutil.rmtree(trash.path, ignore_errors=True)
    return final


def remove(location: Location) -> None:
    """Delete a checkpoint directory so that it is uncommitted before any file goes."""
    if location.is_local:
        if not os.path.exists(location.path):
            return
        trash = location.path
        if not location.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            parent = location.path.rsplit("/", 1)[0]
            trash = f"{parent}/{TRASH_PREFIX}{location.name}-{uuid.uuid4().hex[:8]}"
            os.rename(location.path, trash)  # atomic: the checkpoint disappears at once
        shutil.rmtree(trash, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        location.fs.rm(location.child("manifest.json").path)
    with contextlib.suppress(FileNotFoundError):
        location.fs.rm(location.path, recursive=True)


def _fsync_dir(path: str) -> None:
    # A rename is durable only once its directory is on disk; not possible on every OS.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


class _Crc32:
    """``zlib.crc32`` with the ``update`` / ``hexdigest`` of a ``hashlib`` hasher."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: Any, /) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        return f"{self.crc:08x}"


def hasher(algorithm: str = XXH3_64) -> Any:
    """A new hasher of ``algorithm``: ``xxh3_64`` or ``crc32``.

    Example:
        >>> h = hasher(); h.update(b"steplib"); len(h.hexdigest())
        16
    """
    if algorithm == XXH3_64:
        return xxhash.xxh3_64()
    if algorithm == CRC32:
        return _Crc32()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def digest(data: Any, algorithm: str = XXH3_64) -> str:
    """The checksum of ``data`` (bytes-like) as hex digits."""
    h = hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())


def file_digest(path: str, size: int, algorithm: str = XXH3_64) -> tuple[str, int]:
    """The checksum of the first ``size`` bytes of ``path``, and how many there were."""
    h, read = hasher(algorithm), 0
    view = memoryview(bytearray(min(CHUNK_BYTES, max(size, 1))))
    with open(path, "rb", buffering=0) as raw:
        while read < size and (count := raw.readinto(view[: min(len(view), size - read)])):
            h.update(view[:count])
            read += count
    return h.hexdigest(), read


class ChecksumFile:
    """A write-only file object that checksums and counts the bytes on their way to ``raw``
    (xxhash releases the GIL: a background writer does not hold up training).
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.hasher, self.size = raw, hasher(), 0

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


@contextlib.contextmanager
def open_write(location: Location, *, fsync: bool) -> Iterator[ChecksumFile]:
    """A :class:`ChecksumFile` writing ``location``; fsync'ed on close with ``fsync`` (local)."""
    local = location.is_local
    with open(location.path, "wb") if local else location.fs.open(location.path, "wb") as raw:
        file = ChecksumFile(raw)
        yield file
        if fsync and local:
            raw.flush()
            os.fsync(raw.fileno())


def write_tensors(location: Location, tree: Any, *, fsync: bool) -> FileRecord:
    """``torch.save`` ``tree`` to ``location``, checksummed on the way."""
    with open_write(location, fsync=fsync) as file:
        torch.save(tree, file)
    return file.record()


def write_bytes(location: Location, data: bytes, *, fsync: bool) -> FileRecord:
    """Write ``data`` to ``location``, checksummed."""
    with open_write(location, fsync=fsync) as file:
        file.write(data)
    return file.record()


def read_verified(location: Location, record: FileRecord, *, checkpoint: str) -> bytes:
    """The bytes of one file, checked against its record (``CorruptCheckpointError``)."""
    try:
        data = read_bytes(location)
    except FileNotFoundError:
        raise _missing(location, checkpoint) from None
    _check(location, record, len(data), digest(data, record.algorithm), checkpoint=checkpoint)
    return data


def verify(location: Location, record: FileRecord, *, checkpoint: str) -> None:
    """Check one file against its record, streamed from a local disk, read whole from
    elsewhere (``CorruptCheckpointError``: missing, another size or checksum)."""
    if not location.is_local:
        read_verified(location, record, checkpoint=checkpoint)
        return
    try:
        size = os.path.getsize(location.path)
        if size != record.size:
            _check(location, record, size, "", checkpoint=checkpoint)
        found, size = file_digest(location.path, size, record.algorithm)
    except FileNotFoundError:
        raise _missing(location, checkpoint) from None
    _check(location, record, size, found, checkpoint=checkpoint)


def verify_all(
    location: Location, files: Mapping[str, FileRecord], *, me: int = 0, world: int = 1
) -> None:
    """Verify every file of a checkpoint, each of ``world`` ranks a share (a collective when
    ``world > 1``); every rank raises the same ``CorruptCheckpointError``."""
    error = None
    for name in sorted(files)[me::world]:
        try:
            verify(location.child(name), files[name], checkpoint=location.url)
        except CorruptCheckpointError as err:
            error = str(err)
            break
    errors: list[Any] = [None] * world if world > 1 else [error]
    if world > 1:
        dist.all_gather_object(errors, error)
    if found := [e for e in errors if e is not None]:
        raise CorruptCheckpointError(found[0])


def _label(location: Location, checkpoint: str) -> str:
    # The file's path inside the checkpoint: sharded checkpoints have a subdirectory (dcp/).
    prefix = checkpoint.rstrip("/") + "/"
    return location.url[len(prefix) :] if location.url.startswith(prefix) else location.name


_OLDER = "Use an older checkpoint (latest() and resume_from() skip this one)."


def _missing(location: Location, checkpoint: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} is missing although the "
        f"manifest lists it; the checkpoint was damaged after it was written. {_OLDER}"
    )


def _check(
    location: Location, record: FileRecord, size: int, found: str, *, checkpoint: str
) -> None:
    if size != record.size:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} has {size} "
            f"bytes, the manifest says {record.size}: it was truncated or overwritten after "
            f"the commit. {_OLDER}"
        )
    if found != record.checksum:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} has checksum "
            f"{record.algorithm} {found}, the manifest says {record.checksum}: its bytes were "
            f"altered after the commit (disk or transfer corruption). {_OLDER}"
        )

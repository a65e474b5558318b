"""Where checkpoints live, and how a directory of them is committed atomically.

Locations are fsspec URLs (a local path, ``file://``, ``memory://``, ``s3://``, ...). A
checkpoint is a directory of files plus ``manifest.json``, always written last. How it is
committed depends on the filesystem:

* **local disks**: everything is written into a hidden staging directory
  (``.tmp-<name>-<random>``), each file is fsync'ed, then the directory is renamed to its
  final name (a rename is atomic) and the parent directory is fsync'ed.
* **object stores and other filesystems** (``s3://``, ``memory://``, ...), where a rename is a
  copy: the files are written in place and the manifest last. A directory without a manifest is
  not a checkpoint (``latest`` ignores it), so a crash mid-save leaves nothing visible.

On a local disk the fsyncs make a commit *durable*: on the disk when ``save`` returns, so a
power loss cannot lose it. ``fsync=False`` (``save(..., durable=False)``) skips them (the
files' and the directories') and keeps everything else: the staging directory, the rename and
the checksums. The commit stays atomic, and a checkpoint that a power loss caught before the
kernel had written it back is detected by its checksums (or has no manifest) and skipped.

Each file is written and read back checksummed by ``checksummed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import types
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from steplib.errors import CheckpointError, ConfigError, describe

# protocol -> (package that implements it, what to pip install)
_PACKAGES = types.MappingProxyType(  # read-only: which package implements a protocol
    {
        "s3": ("s3fs", "steplib[s3]"),
        "s3a": ("s3fs", "steplib[s3]"),
        "gs": ("gcsfs", "gcsfs"),
        "gcs": ("gcsfs", "gcsfs"),
        "az": ("adlfs", "adlfs"),
        "abfs": ("adlfs", "adlfs"),
        "abfss": ("adlfs", "adlfs"),
        "adl": ("adlfs", "adlfs"),
        "hf": ("huggingface_hub", "huggingface_hub"),
        "sftp": ("paramiko", "paramiko"),
        "ssh": ("paramiko", "paramiko"),
        "http": ("aiohttp", "aiohttp"),
        "https": ("aiohttp", "aiohttp"),
    }
)

STAGING_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


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


def resolve(url: Any, storage_options: Mapping[str, Any] | None, *, caller: str) -> Location:
    """Turn a local path or URL into a :class:`Location`.

    Raises:
        ConfigError: ``url`` is not a string or path, or its protocol is unknown to fsspec.
        CheckpointError: the protocol's filesystem package is not installed (names the extra).
    """
    if not isinstance(url, str | os.PathLike) or not os.fspath(url):
        raise ConfigError(
            f"{caller} received the location {describe(url)}; pass a local path or an fsspec "
            "URL as a string, e.g. 'runs/exp1/checkpoints' or 's3://bucket/exp1/checkpoints'."
        )
    text = str(os.fspath(url))
    stripped = text.rstrip("/") or text
    protocol = text.split("://", 1)[0] if "://" in text else "file"
    try:
        fs, path = fsspec.core.url_to_fs(stripped, **dict(storage_options or {}))
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
    return Location(stripped, fs, path.rstrip("/") or path)


def read_bytes(location: Location) -> bytes:
    """All bytes of a file (``FileNotFoundError`` when there is none)."""
    data: bytes = location.fs.cat_file(location.path)
    return data


def list_names(directory: Location) -> list[str]:
    """Names of the entries of ``directory`` (none when it does not exist)."""
    fs = directory.fs
    # Object-store filesystems cache listings; another process may have written since.
    fs.invalidate_cache(directory.path)
    try:
        entries = fs.ls(directory.path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]
    return [name for name in names if name]


def exists(location: Location) -> bool:
    return bool(location.fs.exists(location.path))


def check_writable(directory: Location, *, caller: str) -> None:
    """Create ``directory`` and write and remove a small file in it, so that a directory that
    cannot be written fails when a run starts, not at its first (or, saved in the background,
    second) checkpoint.

    Raises:
        CheckpointError: it cannot be created or written (the message names the OS error).
    """
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
    """Create the directory the files of checkpoint ``name`` are written into, and return it.

    Local: a hidden staging directory renamed by :func:`commit`. Elsewhere: the final
    directory, from which an old manifest of the same name is removed first, so that the old
    checkpoint is uncommitted before its files are overwritten.
    """
    if directory.is_local:
        staging = directory.child(f"{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(staging.path)
        return staging
    final = directory.child(name)
    manifest = final.child("manifest.json")
    if exists(manifest):
        directory.fs.rm(manifest.path)
    directory.fs.makedirs(final.path, exist_ok=True)
    return final


def commit(directory: Location, staging: Location, name: str, *, fsync: bool = True) -> Location:
    """Make the checkpoint written into ``staging`` visible under ``name``; return it.

    With ``fsync`` the staging directory (its entries) and, after the rename, the parent
    directory are fsync'ed, so that the rename is on disk when this returns.
    """
    final = directory.child(name)
    if not directory.is_local:
        return final  # the manifest, written last, was the commit
    if fsync:
        _fsync_dir(staging.path)
    trash = None
    if os.path.exists(final.path):
        # Same name saved again (e.g. at epoch end after the last step of the epoch): the new
        # one replaces it. Moved aside, not deleted first, so the rename stays the only gap.
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
        parent = location.path.rsplit("/", 1)[0]
        trash = f"{parent}/{TRASH_PREFIX}{location.name}-{uuid.uuid4().hex[:8]}"
        if not location.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            os.rename(location.path, trash)  # atomic: the checkpoint disappears at once
        else:
            trash = location.path
        shutil.rmtree(trash, ignore_errors=True)
        return
    manifest = location.child("manifest.json")
    with contextlib.suppress(FileNotFoundError):
        location.fs.rm(manifest.path)
    with contextlib.suppress(FileNotFoundError):
        location.fs.rm(location.path, recursive=True)


def _fsync_dir(path: str) -> None:
    # A rename is durable only once its directory is on disk; not possible on every OS.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""One file of a checkpoint: written with its size and checksum computed on the way, and read
back verified against them.

Checksums (``xxh3_64``, see ``checksum``) are of the bytes as written, computed while they
stream to the file (no second pass over the data); they catch truncated and altered files, not
deliberate forgery. Files of checkpoints written before steplib 0.2.0 are verified against
their ``crc32``. With
``fsync`` a local file is on the disk when its write returns (its write-back started early, as
it grows); without, the kernel writes it back later (see ``storage`` for what the commit adds).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch

from steplib.checkpoint.checksum import XXH3_64, digest, file_digest, hasher
from steplib.checkpoint.storage import Location, read_bytes
from steplib.errors import CorruptCheckpointError


@dataclasses.dataclass(frozen=True, slots=True)
class FileRecord:
    """Size and checksum (hex digits) of one file of a checkpoint, and the checksum's
    algorithm: ``"xxh3_64"``, or ``"crc32"`` in checkpoints written before steplib 0.2.0."""

    size: int
    checksum: str
    algorithm: str = XXH3_64


# Writes at least this large (a tensor's bytes) are checksummed in a helper thread while the
# writing thread hands the same bytes to the file.
OVERLAP_BYTES = 1 << 20


class _ChecksumWriter:
    """A write-only file object that checksums and counts the bytes on their way to ``raw``.

    The checksum of a large write runs in a helper thread while this thread writes the same
    bytes to the file: both release the GIL, so a write takes the longer of the two instead of
    their sum (~17 ms of XXH3 for 192 MiB here, ~60 ms with CRC32). The helper
    is started by the thread that writes, so it inherits that thread's CPU priority (the
    background saver's is the lowest).
    """

    def __init__(
        self,
        raw: IO[bytes],
        on_first_write: Callable[[], None] | None = None,
        syncer: _EarlyWriteback | None = None,
    ) -> None:
        self.raw = raw
        self.hasher = hasher()
        self.size = 0
        self._on_first_write = on_first_write
        self._syncer = syncer
        self._helper: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        if self._on_first_write is not None:
            self._on_first_write()
            self._on_first_write = None
        view = memoryview(data)
        if view.nbytes >= OVERLAP_BYTES:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="steplib-checksum")
            hashed = self._helper.submit(self.hasher.update, view)
            try:
                self.raw.write(view)
            finally:  # the caller may free the bytes once this returns: the hash must be done
                hashed.result()
        else:
            self.hasher.update(view)
            self.raw.write(view)
        self.size += view.nbytes
        if self._syncer is not None:
            self._syncer.written(self.size)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def close_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None

    def record(self) -> FileRecord:
        return FileRecord(self.size, self.hasher.hexdigest())


def _sync_file_range() -> Callable[[int, int, int], int] | None:
    """Linux's ``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)``, or ``None``.

    It starts the write-back of a range of a file to the disk and returns without waiting for
    it, without a journal commit or a disk cache flush (an ``fdatasync`` does both, and waits).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, length: int) -> int:
        return int(function(fd, offset, length, write))  # ctypes releases the GIL

    return start


_START_WRITEBACK = _sync_file_range()


class _EarlyWriteback:
    """Starts the disk write-back of a file while it is still being written.

    A final fsync after a large write waits for all of it to reach the disk. Starting the
    write-back of what is written so far, as the file grows, overlaps it with the rest of the
    serialisation, so that the final fsync only waits for the tail (and commits the journal
    once). On Linux, ``sync_file_range`` starts it every ``every`` bytes without waiting (a
    failure there only loses the head start: the final fsync is what makes the file durable).
    Elsewhere an ``fdatasync`` of what is written so far runs in a thread every 64 MiB.
    """

    def __init__(self, raw: IO[bytes], every: int = 8 << 20) -> None:
        self.raw = raw
        self.start = _START_WRITEBACK
        self.every = every if self.start is not None else 64 << 20
        self._next = self.every
        self._started = 0  # bytes whose write-back was started
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def written(self, size: int) -> None:
        if size < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        self._next = size + self.every
        self.raw.flush()  # the kernel can only write back what left Python's buffer
        if self.start is not None:
            self.start(self.raw.fileno(), self._started, size - self._started)
            self._started = size
            return
        self._thread = threading.Thread(target=self._sync, name="steplib-fdatasync")
        self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.raw.fileno())
        except OSError as err:  # a write-back error is reported once: keep it for finish()
            self._error = err

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error


# torch.save computes a CRC32 of every record for the zip format, which torch.load never checks
# (a flipped byte in tensor data loads silently). Our checksum covers the whole file, so torch's
# is switched off for the duration of our torch.save: one pass instead of two keeps our
# serialisation as fast as a plain torch.save. The switch is torch's global config, so it is
# turned back on at the first byte written (torch reads it only when it opens the writer), and
# our saves take it under a lock.
_TORCH_CRC_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_torch_zip_crc() -> Iterator[Callable[[], None]]:
    with _TORCH_CRC_LOCK:
        previous = torch.serialization.get_crc32_options()
        restored = False

        def restore() -> None:
            nonlocal restored
            if not restored:
                torch.serialization.set_crc32_options(previous)
                restored = True

        torch.serialization.set_crc32_options(False)
        try:
            yield restore
        finally:
            restore()


@contextlib.contextmanager
def _open_write(
    location: Location, *, fsync: bool, on_first_write: Callable[[], None] | None = None
) -> Iterator[_ChecksumWriter]:
    if location.is_local:
        with open(location.path, "wb") as raw:
            early = _START_WRITEBACK is not None or hasattr(os, "fdatasync")
            syncer = _EarlyWriteback(raw) if fsync and early else None
            writer = _ChecksumWriter(raw, on_first_write, syncer=syncer)
            try:
                yield writer
            finally:
                writer.close_helper()
                if syncer is not None:
                    syncer.finish()  # joins the thread even when the write failed
            raw.flush()
            if fsync:
                os.fsync(raw.fileno())
    else:
        with location.fs.open(location.path, "wb") as raw:
            writer = _ChecksumWriter(raw, on_first_write)
            try:
                yield writer
            finally:
                writer.close_helper()


def write_tensors(location: Location, tree: Any, *, fsync: bool) -> FileRecord:
    """``torch.save`` ``tree`` to ``location``, checksummed on the way."""
    with (
        _without_torch_zip_crc() as restore,
        _open_write(location, fsync=fsync, on_first_write=restore) as writer,
    ):
        torch.save(tree, writer)  # type: ignore[arg-type]
    return writer.record()


def write_bytes(location: Location, data: bytes, *, fsync: bool) -> FileRecord:
    """Write ``data`` to ``location``, checksummed."""
    with _open_write(location, fsync=fsync) as writer:
        writer.write(data)
    return writer.record()


def read_verified(location: Location, record: FileRecord, *, checkpoint: str) -> bytes:
    """The bytes of one checkpoint file, checked against its manifest record.

    Raises:
        CorruptCheckpointError: the file is missing, has another size or another checksum.
    """
    try:
        data = read_bytes(location)
    except FileNotFoundError:
        raise _missing(location, checkpoint) from None
    _check(location, record, len(data), digest(data, record.algorithm), checkpoint=checkpoint)
    return data


def verify(location: Location, record: FileRecord, *, checkpoint: str) -> None:
    """Check one checkpoint file against its record (streamed from a local disk, read whole
    from elsewhere).

    Raises:
        CorruptCheckpointError: the file is missing, has another size or another checksum.
    """
    if location.is_local:
        verify_local(location, record, checkpoint=checkpoint)
    else:
        read_verified(location, record, checkpoint=checkpoint)


def verify_local(location: Location, record: FileRecord, *, checkpoint: str) -> None:
    """Check a local checkpoint file against its record without holding it in memory.

    Raises:
        CorruptCheckpointError: the file is missing, has another size or another checksum.
    """
    try:
        size = os.path.getsize(location.path)
        if size != record.size:
            _check(location, record, size, "", checkpoint=checkpoint)
        found, size = file_digest(location.path, size, record.algorithm)
    except FileNotFoundError:
        raise _missing(location, checkpoint) from None
    _check(location, record, size, found, checkpoint=checkpoint)


def _label(location: Location, checkpoint: str) -> str:
    # The file's path inside the checkpoint: sharded checkpoints have a subdirectory (dcp/).
    prefix = checkpoint.rstrip("/") + "/"
    return location.url[len(prefix) :] if location.url.startswith(prefix) else location.name


def _missing(location: Location, checkpoint: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} is missing although the "
        "manifest lists it; the checkpoint was damaged after it was written. Use an older "
        "checkpoint (latest() and resume_from() skip this one)."
    )


def _check(
    location: Location, record: FileRecord, size: int, found: str, *, checkpoint: str
) -> None:
    if size != record.size:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} has {size} "
            f"bytes, the manifest says {record.size}: it was truncated or overwritten after "
            "the commit. Use an older checkpoint (latest() and resume_from() skip this one)."
        )
    if found != record.checksum:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {_label(location, checkpoint)} has checksum "
            f"{record.algorithm} {found}, the manifest says {record.checksum}: its bytes were "
            "altered after the commit (disk or transfer corruption). Use an older checkpoint "
            "(latest() and resume_from() skip this one)."
        )

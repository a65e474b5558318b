"""The shared base of the sinks that write one file through fsspec (JSONL, CSV).

Opening when the sink is built (so that a bad destination fails before training), flushing each
write (so that a crash loses at most the record being written), dropping the records a resumed
run writes again, and the error messages that name the URL are written once, here.
"""

from __future__ import annotations

import logging
import warnings
from typing import IO, Any

import fsspec

from steplib.distributed import is_main
from steplib.errors import ConfigError, LogWriteError, describe
from steplib.handlers.logging.base import Record, Sink
from steplib.handlers.logging.continued import Continuation, first_update

_log = logging.getLogger("steplib.logging")


class FileSink(Sink):
    """Base of the sinks that append bytes to one file through fsspec, flushing each write
    (:class:`~steplib.handlers.logging.jsonl.JsonlLogger`,
    :class:`~steplib.handlers.logging.csv.CSVLogger`).

    A subclass calls :meth:`open_file` from its constructor, and :meth:`continue_at` then
    :meth:`write_bytes` from its ``write``; ``close`` and ``repr`` are shared. The file is opened
    when the sink is built, so a bad destination fails before training starts.

    A file continued (``append=True``) by a run resumed from a checkpoint holds the records the
    killed run wrote after that checkpoint: the resumed run writes those steps again. So the
    first record a sink writes drops the records the file holds that the resumed run writes
    again (:func:`~steplib.handlers.logging.continued.written_again`: from its step on, and the
    interval means from the first update it covers on), logged (``logging``,
    ``steplib.logging``, INFO) with how many. A run started afresh into a file of an earlier
    run therefore replaces it from its first record on, with a warning: pass ``append=False``
    to say so, or another file to keep the earlier one.

    Attributes:
        url: the destination, a local path or fsspec URL.
        active: whether this rank writes (rank 0, or every rank with ``rank_zero_only=False``).

    Example:
        >>> class TextSink(FileSink):
        ...     def __init__(self, url):
        ...         self.open_file(url, append=False, rank_zero_only=True, example="log.txt")
        ...     def write(self, record):
        ...         self.write_bytes(f"{record}\\n".encode(), record)
        >>> with TextSink("memory://doc/log.txt") as sink:
        ...     sink.write({"step": 1})
        >>> sink
        TextSink('memory://doc/log.txt', closed)
    """

    _file: IO[bytes] | None

    def open_file(self, url: Any, *, append: bool, rank_zero_only: bool, example: str) -> None:
        """Check ``url`` and open it for appending (or writing) on the ranks that write.

        Args:
            url: a local path (parent directories are created) or fsspec URL.
            append: keep what the file holds; ``False`` starts it afresh.
            rank_zero_only: open and write on rank 0 only.
            example: a file name for the error message's example.

        Raises:
            ConfigError: ``url`` is not a non-empty string.
            LogWriteError: the destination cannot be opened.
        """
        name = type(self).__name__
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"{name}(url) received {describe(url)}; pass a path or fsspec URL, e.g. "
                f"{name}('runs/exp/{example}') or {name}('memory://{example}')."
            )
        self.url = url
        self.active = is_main() or not rank_zero_only
        self._file = None
        self._continuation = Continuation(continuing=append)
        self._starts_after: int | None = None  # told by a Log at fit_start; else unknown
        if not self.active:
            return
        try:
            self._fs, self._path = fsspec.core.url_to_fs(url)
            parent = self._fs._parent(self._path)
            if parent:
                self._fs.makedirs(parent, exist_ok=True)
            self.before_open(append)
            self._file = self._fs.open(self._path, "ab" if append else "wb")
        except Exception as error:
            raise LogWriteError(
                f"{name} could not open {url!r} for writing: {error!r}. Check that the "
                "location exists and is writable (and, for a remote URL, that its filesystem "
                "supports appending, or pass append=False)."
            ) from error

    def before_open(self, append: bool) -> None:
        """Read what the sink needs from an existing file (a CSV header) before appending."""

    def continue_at(self, record: Record) -> None:
        """At the first record of an appending sink, drop the file's records that the resumed
        run writes again (:func:`~steplib.handlers.logging.continued.written_again`), logging how
        many; later records do nothing.

        Raises:
            LogWriteError: the file cannot be read or rewritten; the message names the URL.
        """
        step = first_update(record)
        if self._file is None or not isinstance(step, int):
            return
        means_only = self._continuation.judge(record)
        if means_only is None:
            return
        kept, dropped = self.records_before(self.read_all(record), record, means_only=means_only)
        if not dropped:
            return
        # A run from the start: the file is an earlier run's. Its first record alone cannot
        # tell: an interval's means from update 1 are also a run's resumed from update 1 (a
        # checkpoint inside the first interval), so the run's start is asked where known.
        start = first_update(record) - 1 if self._starts_after is None else self._starts_after
        if start <= 0 and not means_only:
            warnings.warn(
                f"{type(self).__name__}({self.url!r}) replaces the {dropped} record(s) an "
                f"earlier run wrote there from step {step} on (append=True, and this run starts "
                "at its beginning). Pass append=False to start the file afresh, or another path "
                "to keep them.",
                stacklevel=2,
            )
        self.replace_contents(kept, record)
        _log.info(
            "%s(%r) dropped %d record(s) at step %d or later from the file it continues: "
            "this run writes those steps again",
            type(self).__name__,
            self.url,
            dropped,
            step,
        )

    def start_run(self, *, step: int = 0) -> None:
        """At the run's first record, drop the records it writes again (:meth:`continue_at`),
        as at this sink's first: a run resumed in the same process writes again what the
        crashed or stopped run wrote after the checkpoint. ``step``: the update the run starts
        after (a resume's checkpoint step), which says whether it starts at its beginning."""
        self._continuation.start_run()
        self._starts_after = step

    def records_before(
        self, data: bytes, first: Record, *, means_only: bool = False
    ) -> tuple[bytes, int]:
        """The part of the file's ``data`` written before a resumed run whose first record is
        ``first`` (without the records it writes again: ``written_again``, with
        ``means_only``), and the number of records left out."""
        raise NotImplementedError

    def read_all(self, record: Record) -> bytes:
        """What the file holds (after flushing this sink's own writes)."""
        self.write_bytes(b"", record)  # the closed check (with its message) and a flush
        try:
            with self._fs.open(self._path, "rb") as file:
                return bytes(file.read())
        except Exception as error:
            raise LogWriteError(
                f"{type(self).__name__} could not read back {self.url!r} before writing "
                f"{record!r}: {error!r}. Check that the location is readable, or pass "
                "append=False."
            ) from error

    def replace_contents(self, data: bytes, record: Record) -> None:
        """Replace the file with ``data`` (through a temporary file, then moved over it, so a
        failure leaves the old file whole) and reopen it for appending.

        Raises:
            LogWriteError: the rewrite fails; the message names the URL.
        """
        self.write_bytes(b"", record)  # the closed check, with its message
        temporary = f"{self._path}.rewrite-tmp"
        try:
            assert self._file is not None
            self._file.close()
            self._file = None
            with self._fs.open(temporary, "wb") as file:
                file.write(data)
            self._fs.mv(temporary, self._path)
            self._file = self._fs.open(self._path, "ab")
        except Exception as error:
            raise LogWriteError(
                f"{type(self).__name__} could not rewrite {self.url!r} before writing "
                f"{record!r}: {error!r}. The records written before are kept; check that the "
                "location is writable."
            ) from error

    def write_bytes(self, data: bytes, record: Record) -> None:
        """Append ``data`` (the encoding of ``record``) and flush it.

        Args:
            data: the bytes to append.
            record: the record they encode, named in the error message.

        Raises:
            LogWriteError: the sink is closed, or the write fails; the message names the URL.
        """
        if self._file is None:
            raise LogWriteError(
                f"{type(self).__name__}({self.url!r}) is closed; it cannot write {record!r}. "
                f"Create a new logger, or keep the `with {type(self).__name__}(...)` block open "
                "around the run."
            )
        try:
            self._file.write(data)
            self._file.flush()
        except Exception as error:
            raise LogWriteError(
                f"{type(self).__name__} could not write to {self.url!r}: {error!r}. Check that "
                "the location is still writable (disk space, permissions, network); the lines "
                "written before are kept."
            ) from error

    def close(self) -> None:
        """Flush and close the file; calling it again does nothing.

        Raises:
            LogWriteError: the final flush or close fails; the message names the URL.
        """
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()
        except Exception as error:
            raise LogWriteError(
                f"{type(self).__name__} could not close {self.url!r}: {error!r}; the last lines "
                "may be lost. Check that the location is still writable."
            ) from error

    @property
    def closed(self) -> bool:
        """The file was closed (``close``, or the end of the sink's ``with`` block)."""
        return self.active and self._file is None

    def __repr__(self) -> str:
        status = "inactive" if not self.active else "closed" if self._file is None else "open"
        return f"{type(self).__name__}({self.url!r}, {status})"

"""A sink that writes one JSON object per line (orjson), through fsspec."""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from steplib.errors import LogWriteError
from steplib.handlers.logging.base import Record, check_keys, select
from steplib.handlers.logging.continued import written_again
from steplib.handlers.logging.file_sink import FileSink


class JsonlLogger(FileSink):
    """Append one JSON object per line (orjson) to ``url``, through fsspec.

    The file is opened when the logger is built, so a bad destination fails before training
    starts, and each line is flushed as it is written, so a crash loses at most the line being
    written. ``url`` is anything fsspec opens: a local path (parent directories are created),
    ``memory://...``, ``file://...``, or a remote filesystem that supports appending. JSON has
    no NaN or infinity: a diverged loss is written as ``null`` (``CSVLogger`` writes ``nan`` and
    ``inf``, TensorBoard keeps the float).

    Args:
        url: where to write.
        append: keep the lines already there (a resumed run continues its log: the lines at
            the step of its first record and after, which the killed run wrote after the
            checkpoint, and the interval means it covers again, are dropped, and logged;
            ``written_again``); ``False`` starts the file afresh.
        keys: the names to write (and ``step``); ``None``: every name of the record, as for
            every sink and ``ProgressBar``.
        rank_zero_only: write on rank 0 only (other ranks open nothing and write nothing).

    Raises:
        ConfigError: ``url`` is not a non-empty string.
        LogWriteError: the destination cannot be opened, written or closed; the message names
            the URL.

    Example:
        >>> import fsspec, orjson
        >>> with JsonlLogger("memory://doc/metrics.jsonl", append=False) as log:
        ...     log.write({"step": 1, "loss": 2.0})
        >>> orjson.loads(fsspec.open("memory://doc/metrics.jsonl").open().readline())
        {'step': 1, 'loss': 2.0}
    """

    def __init__(
        self,
        url: str,
        *,
        append: bool = True,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        self.keys = check_keys("JsonlLogger", keys)
        self.open_file(url, append=append, rank_zero_only=rank_zero_only, example="metrics.jsonl")

    def write(self, record: Record) -> None:
        """Write ``record`` as one JSON line and flush it.

        Raises:
            LogWriteError: the logger is closed, a value is not JSON-serialisable, or the write
                fails; the message names the URL.
        """
        if not self.active:
            return
        record = select(record, self.keys)
        try:
            line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        except TypeError as error:
            raise LogWriteError(
                f"JsonlLogger({self.url!r}) cannot write a value of {record!r} as JSON: {error}. "
                "Log numbers, strings, lists or tensors' .item() values."
            ) from error
        self.continue_at(record)
        self.write_bytes(line, record)

    def records_before(
        self, data: bytes, first: Record, *, means_only: bool = False
    ) -> tuple[bytes, int]:
        """The lines of ``data`` that a resumed run whose first record is ``first`` does not
        write again (lines that are not records are kept)."""
        kept: list[bytes] = []
        dropped = 0
        for line in data.splitlines(keepends=True):
            try:
                written = orjson.loads(line)
            except orjson.JSONDecodeError:  # not a record: not ours to judge
                written = None
            if isinstance(written, dict) and written_again(first, written, means_only=means_only):
                dropped += 1
            else:
                kept.append(line)
        return b"".join(kept), dropped

"""A sink that writes CSV rows, widening the header when a record brings a new name.

The module is named for the format it writes; ``import csv`` below is the standard library's
(absolute imports).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

import orjson

from steplib.errors import LogWriteError
from steplib.handlers.logging.base import Record, check_keys, select
from steplib.handlers.logging.file_sink import FileSink


class CSVLogger(FileSink):
    """Write records as CSV rows (a header line, then one row per record) through fsspec.

    The columns are the names in the order first seen; a record with a name not in the header
    makes the logger rewrite the file with a wider header (to a temporary file, then moved over
    the old one, so a failure leaves the old file whole). Rows without a value for a column
    leave the cell empty, so train and evaluation records can share one file.

    Args:
        url: a local path or fsspec URL (parent directories are created).
        append: continue an existing file (its header is read back); ``False`` starts afresh.
        keys: the names to write (and ``step``); ``None``: every name of the record, as for
            every sink and ``ProgressBar``.
        rank_zero_only: write on rank 0 only.

    Raises:
        ConfigError: ``url`` is not a non-empty string.
        LogWriteError: the destination cannot be opened, written, rewritten or closed.

    Example:
        >>> import fsspec
        >>> with CSVLogger("memory://doc/metrics.csv", append=False) as log:
        ...     log.write({"step": 1, "loss": 2.5})
        ...     log.write({"step": 2, "val_loss": 3.0})
        >>> print(fsspec.open("memory://doc/metrics.csv", "r").open().read(), end="")
        step,loss,val_loss
        1,2.5,
        2,,3.0
    """

    def __init__(
        self,
        url: str,
        *,
        append: bool = True,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        self.keys = check_keys("CSVLogger", keys)
        self.fields: list[str] = []
        self.open_file(url, append=append, rank_zero_only=rank_zero_only, example="metrics.csv")

    def before_open(self, append: bool) -> None:
        if append and self._fs.exists(self._path):
            with self._fs.open(self._path, "rb") as file:
                header = file.readline().decode()
            self.fields = next(csv.reader([header]), []) if header.strip() else []

    def write(self, record: Record) -> None:
        """Write ``record`` as one row (widening the header first if it has new names).

        Raises:
            LogWriteError: closed, or the write or rewrite fails; the message names the URL.
        """
        if not self.active:
            return
        record = select(record, self.keys)
        new = [name for name in record if name not in self.fields]
        if new and self.fields:
            self._rewrite([*self.fields, *new], record)
        elif new:
            self.fields = list(record)
            self.write_bytes(_csv_line(self.fields), record)
        self.write_bytes(_csv_line([_cell(record.get(name)) for name in self.fields]), record)

    def _rewrite(self, fields: list[str], record: Record) -> None:
        self.write_bytes(b"", record)  # the closed check, with its message
        temporary = f"{self._path}.rewrite-tmp"
        try:
            assert self._file is not None
            self._file.close()
            self._file = None
            with self._fs.open(self._path, "rb") as file:
                rows = list(csv.reader(io.StringIO(file.read().decode())))[1:]
            width = len(fields)
            lines = [
                _csv_line(fields),
                *(_csv_line(row + [""] * (width - len(row))) for row in rows),
            ]
            with self._fs.open(temporary, "wb") as file:
                file.write(b"".join(lines))
            self._fs.mv(temporary, self._path)
            self._file = self._fs.open(self._path, "ab")
        except Exception as error:
            raise LogWriteError(
                f"CSVLogger could not rewrite {self.url!r} with the new column(s) "
                f"{fields[len(self.fields) :]}: {error!r}. The rows written before are kept; "
                "check that the location is writable, or give this record its own CSVLogger."
            ) from error
        self.fields = fields


def _csv_line(cells: Sequence[Any]) -> bytes:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue().encode()


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    if isinstance(value, list | tuple | dict):
        return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    return value

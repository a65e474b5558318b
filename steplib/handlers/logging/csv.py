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

from steplib.handlers.logging.base import Record, check_keys, select
from steplib.handlers.logging.continued import written_again
from steplib.handlers.logging.file_sink import FileSink


class CSVLogger(FileSink):
    """Write records as CSV rows (a header line, then one row per record) through fsspec.

    The columns are the names in the order first seen; a record with a name not in the header
    makes the logger rewrite the file with a wider header (to a temporary file, then moved over
    the old one, so a failure leaves the old file whole). Rows without a value for a column
    leave the cell empty, so train and evaluation records can share one file.

    Args:
        url: a local path or fsspec URL (parent directories are created).
        append: continue an existing file (its header is read back; the rows at the step of
            the first record and after, which a killed run wrote after the checkpoint this run
            resumed from, and the interval means it covers again, are dropped, and logged;
            ``written_again``); ``False`` starts afresh.
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
        self.continue_at(record)
        new = [name for name in record if name not in self.fields]
        if new and self.fields:
            self._rewrite([*self.fields, *new], record)
        elif new:
            self.fields = list(record)
            self.write_bytes(_csv_line(self.fields), record)
        self.write_bytes(_csv_line([_cell(record.get(name)) for name in self.fields]), record)

    def _rewrite(self, fields: list[str], record: Record) -> None:
        rows = self._rows(self.read_all(record))
        width = len(fields)
        lines = [_csv_line(fields), *(_csv_line(row + [""] * (width - len(row))) for row in rows)]
        self.replace_contents(b"".join(lines), record)
        self.fields = fields

    def records_before(
        self, data: bytes, first: Record, *, means_only: bool = False
    ) -> tuple[bytes, int]:
        """The header and the rows of ``data`` that a resumed run whose first record is
        ``first`` does not write again."""
        if "step" not in self.fields:
            return data, 0
        rows = self._rows(data)
        kept = [
            row
            for row in rows
            if not written_again(first, self._numbers(row), means_only=means_only)
        ]
        lines = [_csv_line(self.fields), *(_csv_line(row) for row in kept)]
        return b"".join(lines), len(rows) - len(kept)

    def _numbers(self, row: list[str]) -> Record:
        """The ``step`` and ``updates`` of a row, as ints (``None`` where empty or not one)."""
        cells = dict(zip(self.fields, row, strict=False))
        return {name: _int(cells.get(name)) for name in ("step", "updates")}

    @staticmethod
    def _rows(data: bytes) -> list[list[str]]:
        return list(csv.reader(io.StringIO(data.decode())))[1:]


def _int(cell: str | None) -> int | None:
    try:
        return int(cell)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # empty, absent or not a count: kept as no number
        return None


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

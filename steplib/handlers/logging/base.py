"""Metric logs as event handlers: one record per event, written to one or more sinks.

A logger is a plain callable of one :class:`~steplib.events.Event`, registered like any other
handler::

    with JsonlLogger("runs/exp/metrics.jsonl") as log:
        events.on("step_end", log, every=10)
        state = run(step, state, loader, events=events, max_steps=1_000)

Reading a tensor (``.item()``) is a host sync. It happens here, in the handler, and only on the
events the logger is registered for (``every=...``), never inside a step. :func:`event_record`
turns an event into a flat ``{name: number}`` record; a sink only decides where the record goes,
by implementing ``write`` and ``close``: :class:`JsonlLogger` (JSON lines through fsspec),
:class:`CSVLogger`, :class:`TensorBoardLogger` (extra ``tb``) and :class:`ConsoleLogger`.

:class:`Log` writes one record to several sinks, built from several *sources* (functions of
the event returning values: :func:`event_record`, ``TrainMetrics.read``, ``Throughput.read``,
...), so that a line holds the running means and the throughput of the same interval.

Every sink writes on rank 0 only (``rank_zero_only=True``): on other ranks it opens nothing and
writes nothing, so build it after the process group is initialised. A sink flushes each record
as it writes it, so a crash or a failing destination loses at most the record being written;
a failure raises :class:`LogWriteError` naming the destination.

Imports ``events``, ``errors``, ``distributed`` and ``handlers.terminal`` (handlers never import
``loop`` or ``step``).
"""

from __future__ import annotations

import csv
import io
import math
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, TypeVar

import fsspec
import orjson
import torch

from steplib.distributed import is_main
from steplib.errors import ConfigError, StepLibError, describe
from steplib.events import Event
from steplib.handlers.terminal import tqdm_class

Record = dict[str, Any]
Source = Callable[[Event], Mapping[str, Any]]

# The keys every record may hold; an aux value with one of these names is written as "aux.<name>".
_RESERVED = ("step", "epoch", "micro_step", "time", "loss", "lr", "grad_norm", "num_targets")


class LogWriteError(StepLibError, OSError):
    """A logger could not open, write or close its destination."""


def event_record(event: Event) -> Record:
    """The numbers of one event as a flat, JSON-ready record.

    Reads every tensor of ``event.output`` (a host sync): call it from a handler, not per step.

    Args:
        event: a step event (``step_end``, ``micro_step_end``) or any other event, whose record
            then holds only the counters and the time.

    Returns:
        ``{"step", "epoch", "micro_step", "time"}`` (``time`` in unix seconds) and, when the
        event carries a ``StepOutput``: ``loss``, ``lr``, ``num_targets``, ``grad_norm`` (when
        measured), ``skipped`` (when an update was skipped) and each aux value by its name
        (``aux.<name>`` if the name is one of the keys above). A one-element tensor becomes a
        number, a larger one a (nested) list.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> def loss_fn(model, batch):
        ...     return model(batch).pow(2).sum(), 8, {"acc": torch.tensor(0.75)}
        >>> state, out = make_train_step(loss_fn)(state, torch.ones(8, 2))
        >>> record = event_record(Event("step_end", state, output=out, step=state.step))
        >>> record["step"], record["lr"], record["num_targets"], record["acc"]
        (1, 0.1, 8, 0.75)
    """
    record = event_counters(event)
    out = event.output
    if out is None:
        return record
    record["loss"] = _number(out.loss)
    record["lr"] = _number(out.lr)
    targets = _number(out.num_targets)
    # Target counts are whole numbers carried in a float tensor; write 4096, not 4096.0.
    record["num_targets"] = int(targets) if float(targets).is_integer() else targets
    if out.grad_norm is not None:
        record["grad_norm"] = _number(out.grad_norm)
    if _number(out.skipped):
        record["skipped"] = True
    for name, value in out.aux.items():
        record[f"aux.{name}" if name in _RESERVED or name == "skipped" else name] = _number(value)
    return record


def event_counters(event: Event) -> Record:
    """The counters of ``event`` and the time, the part of a record every record has.

    Reads no tensor, so a handler can call it on any rank at any event without a host sync.

    Args:
        event: any event.

    Returns:
        ``{"step", "epoch", "micro_step", "time"}``; ``time`` is in unix seconds.

    Example:
        >>> record = event_counters(Event("epoch_end", state=None, step=4, micro_step=8, epoch=1))
        >>> record["step"], record["epoch"], record["micro_step"]
        (4, 1, 8)
    """
    return {
        "step": event.step,
        "epoch": event.epoch,
        "micro_step": event.micro_step,
        "time": time.time(),
    }


def _number(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        return value.tolist()
    number = value.item()
    if value.dtype in _SHORT_FLOATS:
        return _shortest_float32(number)
    return number


_SHORT_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _shortest_float32(number: float) -> float:
    # A float32 read as a Python float prints as e.g. 0.10000000149011612; write the shortest
    # decimal that is the same float32 (0.1), as numpy prints it. Non-finite values pass as is
    # (orjson writes NaN and inf as null).
    if not math.isfinite(number):
        return number
    exact = struct.pack("<f", number)
    for digits in range(6, 10):
        short = float(f"{number:.{digits}g}")
        if struct.pack("<f", short) == exact:
            return short
    return number


_L = TypeVar("_L", bound="Logger")


class Logger:
    """Base of the sinks: a handler that writes :func:`event_record` of each event it gets.

    A sink implements :meth:`write` and :meth:`close`; the handler call, the context manager and
    the record format are shared, so every sink logs the same fields.
    """

    def __call__(self, event: Event) -> None:
        self.write(event_record(event))

    def write(self, record: Record) -> None:
        """Write one record (a flat mapping of names to numbers)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the destination; calling it twice is harmless."""
        raise NotImplementedError

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class Log:
    """A handler that writes one record per call to every sink: the event's counters, then the
    values of each source, merged in order (a later source wins on a shared name).

    Sources are called on every rank (a source may all-reduce, which every rank must join);
    the record is written on rank 0 only. If a sink fails, the others still get the record and
    the first error is raised after.

    Args:
        sinks: one :class:`Logger` or a sequence of them.
        sources: functions ``source(event) -> {name: value}``; the default writes the step's
            own values (:func:`event_record`). Typical: ``[train.read, speed.read]`` for a
            :class:`~steplib.handlers.TrainMetrics` and a :class:`~steplib.handlers.Throughput`.

    Raises:
        ConfigError: a sink that is not a :class:`Logger`, or a source that is not callable.

    Example:
        >>> import fsspec, orjson
        >>> from steplib import Event
        >>> log = Log(JsonlLogger("memory://doc/log.jsonl", append=False),
        ...           sources=[lambda event: {"answer": 42}])
        >>> log(Event("step_end", state=None, step=3))
        >>> log.close()
        >>> line = orjson.loads(fsspec.open("memory://doc/log.jsonl").open().readline())
        >>> line["step"], line["answer"]
        (3, 42)
    """

    def __init__(
        self, sinks: Logger | Sequence[Logger], *, sources: Sequence[Source] = (event_record,)
    ) -> None:
        sinks = [sinks] if isinstance(sinks, Logger) else list(sinks)
        for sink in sinks:
            if not isinstance(sink, Logger):
                raise ConfigError(
                    f"Log(sinks) received {describe(sink)}, which is not a Logger. Pass sinks "
                    "such as JsonlLogger('runs/exp/metrics.jsonl') or CSVLogger(...)."
                )
        for source in sources:
            if not callable(source):
                raise ConfigError(
                    f"Log(sources=...) received {describe(source)}, which is not callable. Pass "
                    "functions of the event, e.g. sources=[event_record, train_metrics.read]."
                )
        self.sinks = sinks
        self.sources = tuple(sources)

    def __call__(self, event: Event) -> None:
        record = event_counters(event)
        for source in self.sources:
            record.update(source(event))
        if is_main():
            self.write(record)

    def write(self, record: Record) -> None:
        """Write ``record`` to every sink.

        Raises:
            LogWriteError: a sink failed (after every sink was tried).
        """
        failure: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.write(record)
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Close every sink (each is tried; the first error is raised after)."""
        failure: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:
                failure = failure or error
        if failure is not None:
            raise failure

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _FileSink(Logger):
    """A sink that appends bytes to one file through fsspec, flushing each write."""

    _file: IO[bytes] | None

    def _open(self, url: Any, *, append: bool, rank_zero_only: bool, example: str) -> None:
        name = type(self).__name__
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"{name}(url) received {describe(url)}; pass a path or fsspec URL, e.g. "
                f"{name}('runs/exp/{example}') or {name}('memory://{example}')."
            )
        self.url = url
        self.active = is_main() or not rank_zero_only
        self._file = None
        if not self.active:
            return
        try:
            self._fs, self._path = fsspec.core.url_to_fs(url)
            parent = self._fs._parent(self._path)
            if parent:
                self._fs.makedirs(parent, exist_ok=True)
            self._before_open(append)
            self._file = self._fs.open(self._path, "ab" if append else "wb")
        except Exception as error:
            raise LogWriteError(
                f"{name} could not open {url!r} for writing: {error!r}. Check that the "
                "location exists and is writable (and, for a remote URL, that its filesystem "
                "supports appending, or pass append=False)."
            ) from error

    def _before_open(self, append: bool) -> None:
        """Read what the sink needs from an existing file (a CSV header) before appending."""

    def _write_bytes(self, data: bytes, record: Record) -> None:
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

    def __repr__(self) -> str:
        status = "inactive" if not self.active else "closed" if self._file is None else "open"
        return f"{type(self).__name__}({self.url!r}, {status})"


class JsonlLogger(_FileSink):
    """Append one JSON object per line (orjson) to ``url``, through fsspec.

    The file is opened when the logger is built, so a bad destination fails before training
    starts, and each line is flushed as it is written, so a crash loses at most the line being
    written. ``url`` is anything fsspec opens: a local path (parent directories are created),
    ``memory://...``, ``file://...``, or a remote filesystem that supports appending.

    Args:
        url: where to write.
        append: keep the lines already there (a resumed run continues its log); ``False``
            starts the file afresh.
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

    def __init__(self, url: str, *, append: bool = True, rank_zero_only: bool = True) -> None:
        self._open(url, append=append, rank_zero_only=rank_zero_only, example="metrics.jsonl")

    def write(self, record: Record) -> None:
        """Write ``record`` as one JSON line and flush it.

        Raises:
            LogWriteError: the logger is closed, a value is not JSON-serialisable, or the write
                fails; the message names the URL.
        """
        if not self.active:
            return
        try:
            line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        except TypeError as error:
            raise LogWriteError(
                f"JsonlLogger({self.url!r}) cannot write a value of {record!r} as JSON: {error}. "
                "Log numbers, strings, lists or tensors' .item() values."
            ) from error
        self._write_bytes(line, record)


class CSVLogger(_FileSink):
    """Write records as CSV rows (a header line, then one row per record) through fsspec.

    The columns are the names in the order first seen; a record with a name not in the header
    makes the logger rewrite the file with a wider header (to a temporary file, then moved over
    the old one, so a failure leaves the old file whole). Rows without a value for a column
    leave the cell empty, so train and evaluation records can share one file.

    Args:
        url: a local path or fsspec URL (parent directories are created).
        append: continue an existing file (its header is read back); ``False`` starts afresh.
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

    def __init__(self, url: str, *, append: bool = True, rank_zero_only: bool = True) -> None:
        self.fields: list[str] = []
        self._open(url, append=append, rank_zero_only=rank_zero_only, example="metrics.csv")

    def _before_open(self, append: bool) -> None:
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
        new = [name for name in record if name not in self.fields]
        if new and self.fields:
            self._rewrite([*self.fields, *new], record)
        elif new:
            self.fields = list(record)
            self._write_bytes(_csv_line(self.fields), record)
        self._write_bytes(_csv_line([_cell(record.get(name)) for name in self.fields]), record)

    def _rewrite(self, fields: list[str], record: Record) -> None:
        self._write_bytes(b"", record)  # the closed check, with its message
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


# Counters that every record holds and a scalar plot does not need.
_NOT_PLOTTED = ("step", "micro_step", "time")


class TensorBoardLogger(Logger):
    """Write every number of a record as a TensorBoard scalar at the record's ``step``.

    Needs the ``tb`` extra (``pip install 'steplib[tb]'``, i.e. ``tensorboard``); the events are
    written by ``torch.utils.tensorboard.SummaryWriter`` and flushed after each record. ``step``,
    ``micro_step`` and ``time`` are not plotted (``time`` is the wall time of the points);
    non-numbers (lists, strings) are skipped.

    Args:
        log_dir: the run's directory (``tensorboard --logdir`` its parent).
        rank_zero_only: write on rank 0 only.

    Raises:
        ConfigError: ``log_dir`` is not a non-empty string, or tensorboard is not installed.
        LogWriteError: the directory cannot be created or written.

    Example:
        >>> import tempfile
        >>> with TensorBoardLogger(tempfile.mkdtemp()) as tb:
        ...     tb.write({"step": 1, "loss": 2.0})
    """

    def __init__(self, log_dir: str, *, rank_zero_only: bool = True) -> None:
        if not isinstance(log_dir, str) or not log_dir:
            raise ConfigError(
                f"TensorBoardLogger(log_dir) received {describe(log_dir)}; pass a directory, "
                "e.g. TensorBoardLogger('runs/exp/tb')."
            )
        self.log_dir = log_dir
        self.active = is_main() or not rank_zero_only
        self._writer: Any = None
        if not self.active:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                f"TensorBoardLogger needs the tensorboard package ({error}). Install the extra: "
                "pip install 'steplib[tb]' (or pip install tensorboard)."
            ) from error
        try:
            self._writer = SummaryWriter(log_dir=log_dir)
        except Exception as error:
            raise LogWriteError(
                f"TensorBoardLogger could not open {log_dir!r}: {error!r}. Check that the "
                "directory can be created and written."
            ) from error

    def write(self, record: Record) -> None:
        """Add each number of ``record`` as a scalar and flush.

        Raises:
            LogWriteError: closed, or the write fails; the message names the directory.
        """
        if not self.active:
            return
        if self._writer is None:
            raise LogWriteError(
                f"TensorBoardLogger({self.log_dir!r}) is closed; it cannot write {record!r}. "
                "Create a new logger, or keep the `with` block open around the run."
            )
        step = int(record.get("step", 0))
        wall_time = record.get("time")
        try:
            for name, value in record.items():
                if name in _NOT_PLOTTED or isinstance(value, bool):
                    continue
                if isinstance(value, int | float):
                    self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)
            self._writer.flush()
        except Exception as error:
            raise LogWriteError(
                f"TensorBoardLogger could not write to {self.log_dir!r}: {error!r}. Check that "
                "the directory is still writable; the records flushed before are kept."
            ) from error

    def close(self) -> None:
        """Flush and close the event file; calling it again does nothing."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except Exception as error:
            raise LogWriteError(
                f"TensorBoardLogger could not close {self.log_dir!r}: {error!r}."
            ) from error


class ConsoleLogger(Logger):
    """Print each record as one short line (above a progress bar, via ``tqdm.write``), and a
    summary of the last value of every name when closed.

    Args:
        file: the stream (stdout when ``None``).
        keys: the names to print (``None``: all but ``time`` and ``micro_step``).
        rank_zero_only: print on rank 0 only.

    Example:
        >>> console = ConsoleLogger(keys=["loss"])
        >>> console.write({"step": 10, "loss": 2.3456, "lr": 0.1})
        step 10  loss 2.346
        >>> console.write({"step": 20, "loss": 1.5})
        step 20  loss 1.5
        >>> console.close()
        summary after 2 records, at step 20: loss 1.5
    """

    def __init__(
        self,
        *,
        file: IO[str] | None = None,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        self.file = file
        self.keys = None if keys is None else tuple(keys)
        self.active = is_main() or not rank_zero_only
        self.last: Record = {}
        self.records = 0

    def write(self, record: Record) -> None:
        """Print ``record`` as ``step S  name value  ...``.

        Raises:
            LogWriteError: the stream cannot be written.
        """
        if not self.active:
            return
        self.records += 1
        self.last.update(record)
        self._print(f"step {record.get('step')}  {self._format(record)}".rstrip())

    def close(self) -> None:
        """Print the summary line once (nothing if no record was written)."""
        if not self.active or not self.records:
            return
        records, self.records = self.records, 0
        last = self.last
        self._print(
            f"summary after {records} records, at step {last.get('step')}: {self._format(last)}"
        )

    def _format(self, record: Record) -> str:
        shown = [
            f"{name} {_short(value)}"
            for name, value in record.items()
            if name not in ("step", "micro_step", "time")
            and (self.keys is None or name in self.keys)
        ]
        return "  ".join(shown)

    def _print(self, line: str) -> None:
        try:
            tqdm_class().write(line, file=self.file)
        except Exception as error:
            raise LogWriteError(f"ConsoleLogger could not print: {error!r}.") from error


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

"""Metric logs as event handlers: one record per event, written to a sink.

A logger is a plain callable of one :class:`~steplib.events.Event`, registered like any other
handler::

    with JsonlLogger("runs/exp/metrics.jsonl") as log:
        events.on("step_end", log, every=10)
        state = run(step, state, loader, events=events, max_steps=1_000)

Reading a tensor (``.item()``) is a host sync. It happens here, in the handler, and only on the
events the logger is registered for (``every=...``), never inside a step. :func:`event_record`
turns an event into a flat ``{name: number}`` record; a sink (:class:`JsonlLogger` now; CSV or
TensorBoard later) only decides where the record goes, by implementing ``write`` and ``close``.

Imports ``events`` and ``errors`` only (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import math
import struct
import time
from types import TracebackType
from typing import IO, Any, TypeVar

import fsspec
import orjson
import torch

from steplib.errors import ConfigError, StepLibError, describe
from steplib.events import Event

Record = dict[str, Any]

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
    record: Record = {
        "step": event.step,
        "epoch": event.epoch,
        "micro_step": event.micro_step,
        "time": time.time(),
    }
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
    """Base of the loggers: a handler that writes :func:`event_record` of each event it gets.

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


class JsonlLogger(Logger):
    """Append one JSON object per line (orjson) to ``url``, through fsspec.

    The file is opened when the logger is built, so a bad destination fails before training
    starts, and each line is flushed as it is written, so a crash loses at most the line being
    written. ``url`` is anything fsspec opens: a local path (parent directories are created),
    ``memory://...``, ``file://...``, or a remote filesystem that supports appending.

    Args:
        url: where to write.
        append: keep the lines already there (a resumed run continues its log); ``False``
            starts the file afresh.

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

    def __init__(self, url: str, *, append: bool = True) -> None:
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"JsonlLogger(url) received {describe(url)}; pass a path or fsspec URL, e.g. "
                "JsonlLogger('runs/exp/metrics.jsonl') or JsonlLogger('memory://metrics.jsonl')."
            )
        self.url = url
        try:
            fs, path = fsspec.core.url_to_fs(url)
            parent = fs._parent(path)
            if parent:
                fs.makedirs(parent, exist_ok=True)
            self._file: IO[bytes] | None = fs.open(path, "ab" if append else "wb")
        except Exception as error:
            raise LogWriteError(
                f"JsonlLogger could not open {url!r} for writing: {error!r}. Check that the "
                "location exists and is writable (and, for a remote URL, that its filesystem "
                "supports appending, or pass append=False)."
            ) from error

    def write(self, record: Record) -> None:
        """Write ``record`` as one JSON line and flush it.

        Raises:
            LogWriteError: the logger is closed, a value is not JSON-serialisable, or the write
                fails; the message names the URL.
        """
        if self._file is None:
            raise LogWriteError(
                f"JsonlLogger({self.url!r}) is closed; it cannot write {record!r}. Create a new "
                "logger, or keep the `with JsonlLogger(...)` block open around the run."
            )
        try:
            line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        except TypeError as error:
            raise LogWriteError(
                f"JsonlLogger({self.url!r}) cannot write a value of {record!r} as JSON: {error}. "
                "Log numbers, strings, lists or tensors' .item() values."
            ) from error
        try:
            self._file.write(line)
            self._file.flush()
        except Exception as error:
            raise LogWriteError(
                f"JsonlLogger could not write to {self.url!r}: {error!r}. Check that the "
                "location is still writable (disk space, permissions, network)."
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
                f"JsonlLogger could not close {self.url!r}: {error!r}; the last lines may be "
                "lost. Check that the location is still writable."
            ) from error

    def __repr__(self) -> str:
        status = "closed" if self._file is None else "open"
        return f"JsonlLogger({self.url!r}, {status})"

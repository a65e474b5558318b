"""Metric logs as event handlers: one record per event, written to one or more sinks.

A logger is a plain callable of one :class:`~steplib.events.Event`, registered like any other
handler::

    with JsonlLogger("runs/exp/metrics.jsonl") as log:
        events.on("step_end", log, every=10)
        state = run(step, state, loader, events=events, max_steps=1_000)

Reading a tensor (``.item()``) is a host sync. It happens here, in the handler, and only on the
events the logger is registered for (``every=...``), never inside a step. :func:`event_record`
turns an event into a flat ``{name: number}`` record; a :class:`Sink` only decides
where the record goes, by implementing ``write`` and ``close``. The sinks are the other modules
of this package: ``jsonl`` (JSON lines through fsspec), ``csv``, ``tensorboard`` (extra ``tb``),
``console`` and ``trackers`` (W&B, MLflow); ``file_sink`` is the base of the two file sinks.

:class:`Log` writes one record to several sinks, built from several *sources* (functions of
the event returning values: :func:`event_record`, ``TrainMetrics.read``, ``Throughput.read``,
...), so that a line holds the running means and the throughput of the same interval.

Every sink writes on rank 0 only (``rank_zero_only=True``): on other ranks it opens nothing and
writes nothing, so build it after the process group is initialised. A sink flushes each record
as it writes it, so a crash or a failing destination loses at most the record being written;
a failure raises :class:`LogWriteError` naming the destination.

Imports ``events``, ``errors`` and ``distributed`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import abc
import math
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch

from steplib.cadence import Batches, check_every, check_not_by_hand, due
from steplib.distributed import is_main
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, Handler
from steplib.output import update_outputs

Record = dict[str, Any]
Source = Callable[[Event], Mapping[str, Any]]

# The keys every record may hold; an aux value with one of these names is written as "aux.<name>".
_RESERVED = ("step", "epoch", "micro_step", "time", "loss", "lr", "grad_norm", "num_targets")


# Counters a record holds: the x axis, the timestamp and running counts. A plotting sink
# (TensorBoard, W&B, MLflow) draws them only when its keys= name them: as curves they are noise.
COUNTERS = ("step", "micro_step", "time", "epoch", "num_targets", "updates")


def check_keys(owner: str, keys: Any) -> tuple[str, ...] | None:
    """``keys`` as a tuple of names, or ``None`` (the sink's default).

    Raises:
        ConfigError: ``keys`` is a string or not a sequence of non-empty strings.
    """
    if keys is None:
        return None
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(
            f"{owner}(keys=...) received {describe(keys)}; pass a list of the names to write, "
            "e.g. keys=['loss', 'lr', 'val_loss'], or None for the default."
        )
    return tuple(keys)


def select(
    record: Record, keys: tuple[str, ...] | None, *, default_skip: Sequence[str] = ()
) -> Record:
    """The entries of ``record`` that a sink with ``keys`` writes: those named (and ``step``,
    the x axis of every sink), or, with ``keys=None``, all but ``default_skip``."""
    if keys is None:
        return {k: v for k, v in record.items() if k not in default_skip}
    return {k: v for k, v in record.items() if k in keys or k == "step"}


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
        (``aux.<name>`` if the name is one of the keys above): the output's own, so at an
        update with accumulation the loss is the window's and an aux value its last
        micro-batch's, and on several ranks the loss is over every rank and an aux value this
        rank's (``TrainMetrics`` averages aux over whole windows and ranks). A one-element
        tensor becomes a number, a larger one a (nested) list. In a run of several steps each
        step's values are under its name: ``D/loss``, ``G/loss``, ``G/lr``, ...; at a
        ``step_end``, only of the steps whose window closed on that batch (a step whose window
        is still open there reported one micro-batch, no update: it has no values in the
        record).

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
    if event.output is None:
        return record
    # Several steps (a GAN's D and G): each step's values under its name, "D/loss", "G/loss";
    # at an update, only those of a step whose window closed on this batch.
    for name, out in update_outputs(event).items():
        prefix = f"{name}/" if name else ""
        record[prefix + "loss"] = _number(out.loss)
        record[prefix + "lr"] = _number(out.lr)
        targets = _number(out.num_targets)
        # Target counts are whole numbers carried in a float tensor; write 4096, not 4096.0.
        record[prefix + "num_targets"] = int(targets) if float(targets).is_integer() else targets
        if out.grad_norm is not None:
            record[prefix + "grad_norm"] = _number(out.grad_norm)
        if out.skipped.any():  # a sweep's is one per copy
            record[prefix + "skipped"] = True
        for key, value in out.aux.items():
            reserved = key in _RESERVED or key == "skipped"
            record[prefix + (f"aux.{key}" if reserved else key)] = _number(value)
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


_L = TypeVar("_L", bound="Sink")


class Sink(abc.ABC):
    """Where records go (``JsonlLogger``, ``CSVLogger``, ...: each is a ``Sink``): also a
    handler that writes :func:`event_record` of each event it gets.

    A sink implements :meth:`write` and :meth:`close`; the handler call, the context manager and
    the record format are shared, so every sink logs the same fields.
    """

    def __call__(self, event: Event) -> None:
        self.write(event_record(event))

    @abc.abstractmethod
    def write(self, record: Record) -> None:
        """Write one record (a flat mapping of names to numbers)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the destination; calling it twice is harmless."""

    def start_run(self) -> None:
        """A run starts (a :class:`Log` calls it): drop what it writes again at its first."""
        return None

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# The 0.1 name of Sink, beside Log (the handler that writes to sinks): kept so that your own
# sinks (`class MySink(Logger)`) still work. Deprecated: write Sink; removed in 0.3.
Logger = Sink


class Log(Handler):
    """A handler that writes one record per call to every sink: the event's counters, then the
    values of each source, merged in order (a later source wins on a shared name).

    Sources are called on every rank (a source may all-reduce, which every rank must join);
    each sink writes the record on the ranks it writes on: rank 0, or every rank for a sink
    built with ``rank_zero_only=False`` (a sink of your own without an ``active`` attribute:
    rank 0). If a sink fails, the others still get the record and the first error is raised
    after.

    Args:
        sinks: one :class:`Sink` or a sequence of them.
        sources: functions ``source(event) -> {name: value}``; the default writes the step's
            own values (:func:`event_record`). A tensor value is read as :func:`event_record`
            reads one: a one-element tensor becomes a number, a larger one a list. Typical:
            ``[train.read, speed.read]`` for a :class:`~steplib.handlers.TrainMetrics` and a
            :class:`~steplib.handlers.Throughput`.
        every: write every this many updates when registered with :meth:`attach` (or in a
            list of handlers), or every n batches with ``Batches(n)``; ``None`` to register it
            yourself with ``events.on``. Attached, it also writes the run's last update at
            ``fit_end`` when that was not due (a stop, or a run of 105 updates with
            ``every=10``), so that the updates after the last interval are in the log (so it
            is refused registered by hand on a step event, where it would go unused).

    Raises:
        ConfigError: a sink that is not a :class:`Sink`, a source that is not callable, or
            ``every`` not a positive int.

    Example:
        >>> import fsspec, orjson
        >>> from steplib import Event
        >>> from steplib.handlers.logging import JsonlLogger
        >>> log = Log(JsonlLogger("memory://doc/log.jsonl", append=False),
        ...           sources=[lambda event: {"answer": 42}])
        >>> log(Event("step_end", state=None, step=3))
        >>> log.close()
        >>> line = orjson.loads(fsspec.open("memory://doc/log.jsonl").open().readline())
        >>> line["step"], line["answer"]
        (3, 42)
    """

    def __init__(
        self,
        sinks: Sink | Sequence[Sink],
        *,
        sources: Sequence[Source] = (event_record,),
        every: int | Batches | None = None,
    ) -> None:
        sinks = [sinks] if isinstance(sinks, Sink) else list(sinks)
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise ConfigError(
                    f"Log(sinks) received {describe(sink)}, which is not a Sink. Pass sinks "
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
        self.every = check_every("Log(every=...)", every)
        self._unwritten: Event | None = None  # the last step_end, when it was not due

    def on_attach(self, events: Events) -> None:
        """Refuse to be attached without ``every`` (close the sinks yourself, or use the
        ``Log`` as a context manager).

        Raises:
            ConfigError: built without ``every``.
        """
        if self.every is None:
            raise ConfigError(
                "Log(...) was built without every=, so it does not say how often to write. "
                "Pass Log(sinks, every=50), or register it: events.on('step_end', log, every=50)."
            )

    def on_fit_start(self, event: Event) -> None:
        """Tell each sink a run starts (one resumed in this process writes steps again)."""
        for sink in self.sinks:
            sink.start_run()

    def on_step_end(self, event: Event) -> None:
        """Write every ``every`` updates (or batches)."""
        self._unwritten = event
        if self.every is not None and due(self.every, event):
            self._unwritten = None
            self._record(event)

    def on_fit_end(self, event: Event) -> None:
        """Write the run's last update if it was not due: its sources hold what came after
        the last record (a stop's, or the run's last partial interval)."""
        unwritten, self._unwritten = self._unwritten, None
        if unwritten is not None:
            self._record(unwritten)

    def on_exception(self, event: Event) -> None:
        # Nothing written: a source may all-reduce, and the other ranks need not be here.
        self._unwritten = None

    def __call__(self, event: Event) -> None:
        """Write one record of ``event`` (registered with ``events.on``: on each call).

        Raises:
            ConfigError: a step event given to a ``Log`` built with ``every`` (unused there).
        """
        check_not_by_hand("Log", self.every, event, obj="log")
        self._record(event)

    def _record(self, event: Event) -> None:
        record = event_counters(event)
        for source in self.sources:
            # A tensor a source returns is read here, as event_record reads the step's: every
            # sink then gets a number (the CSV wrote "tensor(0.1235)", TensorBoard skipped it).
            record.update({name: _number(value) for name, value in source(event).items()})
        # Each sink's own rank choice: one built with rank_zero_only=False writes on every
        # rank, as it does registered alone (a sink without `active` writes on rank 0).
        main = is_main()
        self._write([sink for sink in self.sinks if getattr(sink, "active", main)], record)

    def write(self, record: Record) -> None:
        """Write ``record`` to every sink.

        Raises:
            LogWriteError: a sink failed (after every sink was tried).
        """
        self._write(self.sinks, record)

    @staticmethod
    def _write(sinks: Sequence[Sink], record: Record) -> None:
        failure: BaseException | None = None
        for sink in sinks:
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

"""The :class:`Log` handler: one record per call, the event's counters and its sources'
values, written to every sink. Imports ``base`` for the records and the :class:`Sink`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from steplib.cadence import Batches, check_every, check_not_by_hand, due
from steplib.distributed import is_main, world_size
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, Handler
from steplib.handlers.logging.base import (
    COUNTERS,
    Record,
    Sink,
    Source,
    event_counters,
    event_record,
    logged_number,
)

_log = logging.getLogger("steplib.logging")


class Log(Handler):
    """A handler that writes one record per call to every sink: the event's counters, then the
    values of each source, merged. Two sources that write one name (a counter such as
    ``updates`` aside) are refused at the first record, before it is written: the later's
    value would stand for both (``TrainMetrics``' ``lr``, the rate this update used, replaced
    by another source's ``lr``).

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
            ``every=10``), or at an error on one process (:meth:`on_exception`), so that the
            updates after the last interval are in the log (so it
            is refused registered by hand on a step event, where it would go unused).

    Raises:
        ConfigError: a sink that is not a :class:`Sink`, a source that is not callable, or
            ``every`` not a positive int; at a record, two sources that write one name.

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
        self._written_at: int | None = None  # the step of this run's last record

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
        """Refuse a closed sink (:meth:`check_open`), and tell each sink a run starts (one
        resumed in this process writes steps again).

        Raises:
            ConfigError: a sink is closed.
        """
        self.check_open()
        self._written_at = None
        for sink in self.sinks:
            sink.start_run(step=event.step)  # after resume_from (first): a resume's step

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
        """Write the updates since the last record (a loss diverging before the crash): the
        last update the run made, as ``fit_end`` writes it. On one process only: a source may
        all-reduce, and the other ranks need not be here. A failure to read or write is logged
        (``steplib.logging``, ERROR), never raised: the run's error stays the one raised (after
        a device error, a tensor read raises again)."""
        unwritten, self._unwritten = self._unwritten, None
        last = self._written_at
        nothing_new = unwritten is None and (last is None or event.step == last)
        if nothing_new or world_size() > 1:
            return
        # The unwritten update when the error came after its handlers (at its epoch's end: not
        # the error's next epoch, nor without the step's outputs); else the error's counters: a
        # handler before this one that raised at a step_end (an alarm) left that update unseen.
        at = unwritten if unwritten is not None and unwritten.step == event.step else event
        try:
            self._record(at)
        except Exception as error:
            _log.error(
                "Log could not write the record of update %s while the run was failing: %r",
                event.step,
                error,
            )

    def __call__(self, event: Event) -> None:
        """Write one record of ``event`` (registered with ``events.on``: on each call).

        Raises:
            ConfigError: a step event given to a ``Log`` built with ``every`` (unused there).
        """
        check_not_by_hand("Log", self.every, event, obj="log")
        self._record(event)

    def _record(self, event: Event) -> None:
        self._written_at = event.step
        record = event_counters(event)
        for source in self.sources:
            values = source(event)
            if shared := sorted(values.keys() & (record.keys() - COUNTERS)):
                raise ConfigError(
                    f"Log: the source {getattr(source, '__qualname__', repr(source))} writes "
                    f"{shared}, which an earlier source of this Log wrote: one value would stand "
                    "for both (nothing was written). Keep one of them, or rename the other's: "
                    "sources=[..., lambda e: {'next_' + k: v for k, v in source(e).items()}]."
                )
            # A tensor a source returns is read here, as event_record reads the step's: every
            # sink then gets a number (the CSV wrote "tensor(0.1235)", TensorBoard skipped it).
            record.update({name: logged_number(value) for name, value in values.items()})
        # Each sink's own rank choice: one built with rank_zero_only=False writes on every
        # rank, as it does registered alone (a sink without `active` writes on rank 0).
        main = is_main()
        self._write([sink for sink in self.sinks if getattr(sink, "active", main)], record)

    def check_open(self) -> None:
        """Refuse a closed sink before a run (at ``fit_start``), not at its first record,
        after the run's first updates: a sink used in a ``with`` block and given to a second
        run after the block.

        Raises:
            ConfigError: a sink is closed; the message names it.
        """
        for sink in self.sinks:
            # A sink tells by a ``closed`` attribute (the built-in file, TensorBoard and
            # tracker sinks; a user's own may set one): none, or False, is open.
            if getattr(sink, "closed", False) is True:
                name = type(sink).__name__
                raise ConfigError(
                    f"Log received {sink!r}, which is closed (its `with {name}(...)` block "
                    "ended, or close() was called): it cannot write this run's records, and "
                    f"would fail at the first. Build a new {name}(...) for this run (a file "
                    "sink with append=True continues its file), or keep the `with` block open "
                    "around every run that logs to it."
                )

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

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

:class:`~steplib.handlers.logging.log.Log` (module ``log``) writes one record to several
sinks, built from several *sources* (functions of the event returning values:
:func:`event_record`, ``TrainMetrics.read``, ``Throughput.read``, ...), so that a line holds
the running means and the throughput of the same interval.

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

from steplib.errors import ConfigError, describe
from steplib.events import Event
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


def plotted(record: Record, keys: tuple[str, ...] | None) -> dict[str, int | float]:
    """The numbers a sink that plots curves (TensorBoard, W&B, MLflow) writes of ``record``:
    those :func:`select` keeps but ``step`` and, with ``keys=None``, the counters; no booleans
    or text. A flat list of numbers (a sweep's value, one per copy) is one curve per element,
    ``loss/0``, ``loss/1``, ...: a point is one number, and dropping the list would leave a
    sweep with no curve at all. A nested list (a matrix) is not a curve and is left out.

    Example:
        >>> plotted({"step": 3, "loss": [0.5, 0.25], "lr": 0.1, "note": "x"}, None)
        {'loss/0': 0.5, 'loss/1': 0.25, 'lr': 0.1}
    """
    numbers: dict[str, int | float] = {}
    for name, value in select(record, keys, default_skip=COUNTERS).items():
        if name == "step":
            continue
        if _is_number(value):
            numbers[name] = value
        elif isinstance(value, list | tuple) and value and all(map(_is_number, value)):
            numbers.update({f"{name}/{i}": v for i, v in enumerate(value)})
    return numbers


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def event_record(event: Event) -> Record:
    """The numbers of one event as a flat, JSON-ready record.

    Reads every tensor of ``event.output`` (a host sync): call it from a handler, not per step.

    Args:
        event: a step event (``step_end``, ``micro_step_end``) or any other event, whose record
            then holds only the counters and the time.

    Returns:
        ``{"step", "epoch", "micro_step", "time"}`` (``time`` in unix seconds) and, when the
        event carries a ``StepOutput``: ``loss``, ``lr``, ``num_targets``, ``grad_norm`` (when
        measured), ``skipped`` (when an update was skipped: ``True``, or a sweep's one bool
        per copy) and each aux value by its name
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
        record[prefix + "loss"] = logged_number(out.loss)
        record[prefix + "lr"] = logged_number(out.lr)
        targets = logged_number(out.num_targets)
        # Target counts are whole numbers carried in a float tensor; write 4096, not 4096.0.
        record[prefix + "num_targets"] = int(targets) if float(targets).is_integer() else targets
        if out.grad_norm is not None:
            record[prefix + "grad_norm"] = logged_number(out.grad_norm)
        if out.skipped.any():  # a sweep's says which copies: one bool per copy
            record[prefix + "skipped"] = logged_number(out.skipped)
        for key, value in out.aux.items():
            reserved = key in _RESERVED or key == "skipped"
            record[prefix + (f"aux.{key}" if reserved else key)] = logged_number(value)
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


def logged_number(value: Any) -> Any:
    """``value`` as a record holds it: a one-element tensor as a number, a larger one a list."""
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

    def start_run(self, *, step: int = 0) -> None:
        """A run starts (a :class:`Log` calls it): drop what it writes again at its first.

        Args:
            step: the update the run starts after: 0, or the step of the checkpoint it resumed
                from (a file continued from its first record then replaces no earlier run's).
        """
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

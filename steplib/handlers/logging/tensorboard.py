"""A sink that writes each number of a record as a TensorBoard scalar (the ``tb`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from steplib.distributed import is_main
from steplib.errors import ConfigError, LogWriteError, describe
from steplib.handlers.logging.base import Record, Sink, check_keys, plotted


class TensorBoardLogger(Sink):
    """Write every number of a record as a TensorBoard scalar at the record's ``step``.

    Needs the ``tb`` extra (``pip install 'steplib[tb]'``, i.e. ``tensorboard``); the events are
    written by ``torch.utils.tensorboard.SummaryWriter`` and flushed after each record. The
    counters (``step``, ``micro_step``, ``time``, ``epoch``, ``num_targets``, ``updates``) are
    not plotted unless ``keys`` names them (``time`` is the wall time of the points); a flat
    list of numbers (a sweep's, one per copy) is one curve per element (``loss/0``, ``loss/1``,
    ...), and other non-numbers (strings, nested lists) are skipped. A name is written once per
    step: a second record at the same step (an evaluation's, the one at ``fit_end``) adds no
    duplicate point. The first record's step is the writer's ``purge_step``: the points a killed
    run wrote in this directory at that step and after, which a run resumed from an earlier
    checkpoint writes again, are hidden, so each step has one point. A purge hides every name at
    a step, so it starts at the first update the resumed run writes, not at the first its means
    cover: the killed run's evaluation at the checkpoint's update, which the resumed run does
    not run again, stays; so does the point of the means a stopped run wrote at ``fit_end``
    after that save (the files drop it), whose update the resumed run's first point covers
    again.

    Args:
        log_dir: the run's directory (``tensorboard --logdir`` its parent).
        keys: the names to plot (``None``: every number but the counters), as for every sink
            and ``ProgressBar``.
        rank_zero_only: write on rank 0 only.

    Raises:
        ConfigError: ``log_dir`` is not a non-empty string, ``keys`` not a list of names, or
            tensorboard is not installed.
        LogWriteError: the directory cannot be created or written.

    Example:
        >>> import tempfile
        >>> with TensorBoardLogger(tempfile.mkdtemp()) as tb:
        ...     tb.write({"step": 1, "loss": 2.0})
    """

    def __init__(
        self, log_dir: str, *, keys: Sequence[str] | None = None, rank_zero_only: bool = True
    ) -> None:
        if not isinstance(log_dir, str) or not log_dir:
            raise ConfigError(
                f"TensorBoardLogger(log_dir) received {describe(log_dir)}; pass a directory, "
                "e.g. TensorBoardLogger('runs/exp/tb')."
            )
        self.log_dir = log_dir
        self.keys = check_keys("TensorBoardLogger", keys)
        self._last_step: dict[str, int] = {}  # per name: one point per step
        self.active = is_main() or not rank_zero_only
        self._writer: Any = None
        self._purged = False  # the writer is reopened at the first record, with its step
        if self.active:
            self._writer = self._open()

    def _open(self, purge_step: int | None = None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                f"TensorBoardLogger needs the tensorboard package ({error}). Install the extra: "
                "pip install 'steplib[tb]' (or pip install tensorboard)."
            ) from error
        try:
            return SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
        except Exception as error:
            raise LogWriteError(
                f"TensorBoardLogger could not open {self.log_dir!r}: {error!r}. Check that the "
                "directory can be created and written."
            ) from error

    def start_run(self, *, step: int = 0) -> None:
        """At the run's first record, reopen the writer with that record's ``purge_step``, as
        at this logger's first: a run resumed in the same process writes those steps again."""
        self._purged = False
        self._last_step = {}

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
        if not self._purged:  # a resumed run writes its steps again: hide the killed run's
            self._purged = True
            self._writer.close()
            # From the step of the first record, not the first update its means cover: a purge
            # hides every name there, and the evaluation at the checkpoint's update is not
            # written again (its point vanished from the curve).
            self._writer = self._open(purge_step=step)
        try:
            for name, value in plotted(record, self.keys).items():
                if self._last_step.get(name) == step:
                    continue
                self._last_step[name] = step
                self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)
            self._writer.flush()
        except Exception as error:
            raise LogWriteError(
                f"TensorBoardLogger could not write to {self.log_dir!r}: {error!r}. Check that "
                "the directory is still writable; the records flushed before are kept."
            ) from error

    @property
    def closed(self) -> bool:
        """The event file was closed (``close``, or the end of the ``with`` block)."""
        return self.active and self._writer is None

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

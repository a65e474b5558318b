"""What a log continued at a resume drops: the records the resumed run writes again, judged
from its first record. The file sinks, the console's summary and TensorBoard's ``purge_step``
follow these rules; a tracker's run, which cannot drop what it logged, warns instead
(:class:`TrackerSink`, the base of the W&B and MLflow sinks)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from steplib.handlers.logging.base import Record, Sink


def first_update(record: Record) -> Any:
    """The first update ``record`` covers: its ``step``, or for an interval's means
    (``TrainMetrics``' ``updates`` of them) the interval's first. A sink continuing a file at a
    resume drops the records from there: a record that a run wrote after the save of its
    update (the one at ``fit_end``) is covered again by the resumed run's first."""
    step, updates = record.get("step"), record.get("updates")
    if isinstance(step, int) and type(updates) is int and updates > 1:
        return step - updates + 1
    return step


def written_again(first: Record, written: Mapping[str, Any], *, means_only: bool = False) -> bool:
    """Whether a resumed run whose first record is ``first`` writes ``written``, a record of
    the file it continues, again: a record at ``first``'s step or later; and an interval's
    means (with ``updates``: ``TrainMetrics``', ``GradNormMonitor``'s) from the first update
    ``first`` covers on (the one a run wrote at ``fit_end`` after the save of its update,
    which ``first`` covers again). Another record before ``first``'s step is kept: an
    evaluation at the checkpoint's update, which the resumed run does not run again.

    ``means_only``: the interval means alone, for a run whose first record held none (an
    evaluation's): its first record of means then judges them, and its own records are kept.

    Example:
        >>> first = {"step": 6, "updates": 2}  # the means of updates 5 and 6
        >>> [written_again(first, r) for r in ({"step": 5, "updates": 1}, {"step": 5},
        ...                                    {"step": 4, "updates": 2}, {"step": 7})]
        [True, False, False, True]
    """
    step, start = written.get("step"), first_update(first)
    if not isinstance(step, int) or not isinstance(start, int):
        return False
    means = step >= start and written.get("updates") is not None
    return means if means_only else step >= first["step"] or means


class Continuation:
    """When a sink that continues earlier records (a file appended to, a run started again in
    the same process) drops those its run writes again: at the run's first record, judged by
    it; and when that one held no interval means (an evaluation's), the earlier means again at
    the run's first record of means (the stopped run's ``fit_end`` means it covers again).

    Example:
        >>> continuation = Continuation(continuing=True)
        >>> continuation.judge({"step": 5, "val_loss": 0.5}), continuation.judge({"step": 6})
        (False, None)
        >>> continuation.judge({"step": 8, "updates": 4}), continuation.judge({"step": 9})
        (True, None)
    """

    def __init__(self, *, continuing: bool) -> None:
        self._continuing = continuing  # until the first record: drop the steps it writes again
        self._means_pending = False  # until the first record of means, when the first held none

    def start_run(self) -> None:
        """A run starts: its first record judges the earlier ones."""
        self._continuing = True

    def judge(self, record: Record) -> bool | None:
        """``None`` when ``record`` drops nothing; else the ``means_only`` of
        :func:`written_again` for the earlier records it drops."""
        means = record.get("updates") is not None
        if self._continuing:  # the run's first record judges every earlier record
            self._continuing = False
            self._means_pending = not means
            return False
        if self._means_pending and means:
            self._means_pending = False
            return True
        return None


def warn_rewound(owner: str, record: Record, last: int | None, kept: str) -> None:
    """Warn when a sink that cannot drop what it logged (a tracker's run: W&B, MLflow) gets
    a run's first record at or before the last step it logged: a run started again in the
    same process (after a crash or a stop, from a checkpoint or from scratch) logs those steps
    again, and ``kept`` says what the tracker then holds (a template of ``{step}``, the
    record's, and ``{last}``)."""
    step = record.get("step")
    if last is None or not isinstance(step, int) or step > last:
        return
    holds = kept.format(step=step, last=last)
    warnings.warn(
        f"{owner}: this run's first record is at step {step}, but its tracker run already holds "
        f"steps up to {last}, logged by an earlier run of this logger (a run started again in "
        f"this process, resumed from a checkpoint or from scratch). {holds} The tracker cannot "
        "drop what it holds: for a run of this run's values alone, build a new logger (a new "
        "tracker run) before running again.",
        stacklevel=3,
    )


class TrackerSink(Sink):
    """The base of the trackers' sinks (W&B, MLflow): a tracker's run keeps what it logged
    (no step can be dropped or replaced), so a run started again with the same logger
    (:meth:`start_run`, called by a ``Log`` at ``fit_start``) whose first record goes back
    over the steps it logged warns, saying what the tracker then holds."""

    _last_step: int | None = None  # the highest step this logger logged
    _run_started = False

    def start_run(self, *, step: int = 0) -> None:
        """A run starts: its first record warns if the tracker's run holds its step."""
        self._run_started = True

    def check_step(self, record: Record, kept: str) -> None:
        """Before logging ``record``: at a run's first, :func:`warn_rewound` with ``kept``."""
        if self._run_started:
            self._run_started = False
            warn_rewound(type(self).__name__, record, self._last_step, kept)
        step = record.get("step")
        if isinstance(step, int):
            self._last_step = step if self._last_step is None else max(step, self._last_step)

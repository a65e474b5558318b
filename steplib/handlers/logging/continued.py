"""What a log continued at a resume drops: the records the resumed run writes again, judged
from its first record. The file sinks, the console's summary and TensorBoard's ``purge_step``
follow these rules; a tracker's run, which cannot drop what it logged, warns instead
(:class:`TrackerSink`, the base of the W&B and MLflow sinks)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
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


# What each tracker holds after a run that starts again at or before its last step.
WANDB_KEPT = (
    "W&B drops a record at a step lower than the last it holds and merges one at that step "
    "into the earlier run's: the steps from {step} to before {last} keep the earlier run's "
    "values, not this run's."
)
WANDB_ID_KEPT = (
    "W&B continues the run (id=) at the step after the last it holds and drops a record at a "
    "lower step: this run's records at steps {step} to {last} are dropped, a value the earlier "
    "run did not log there too, and those steps keep the earlier run's values (the same under "
    "an exact resume, law 9). To log them in it, rewind the W&B run to the checkpoint's "
    "update instead: WandbLogger(..., resume_from='<id>?_step=<that update>') in place of "
    "id= and resume= (W&B's rewind)."
)
MLFLOW_KEPT = (
    "MLflow would keep both, so this run's values at the steps it holds are left out: steps "
    "{step} to {last} keep the earlier run's (the same under an exact resume, law 9)."
)


def warn_rewound(owner: str, record: Record, last: int | None, kept: str) -> None:
    """Warn when a sink that cannot drop what it logged (a tracker's run: W&B, MLflow) gets
    a run's first record at or before the last step its run holds: a run started again in the
    same process (after a crash or a stop, from a checkpoint or from scratch), or a resumed
    run continuing the killed one's tracker run (``run_id=``), logs those steps again, and
    ``kept`` says what the tracker then holds (a template of ``{step}``, the record's, and
    ``{last}``)."""
    step = record.get("step")
    if last is None or not isinstance(step, int) or step > last:
        return
    holds = kept.format(step=step, last=last)
    warnings.warn(
        f"{owner}: this run's first record is at step {step}, but its tracker run already holds "
        f"steps up to {last}, logged by an earlier run (of this logger: a run started again in "
        f"this process; or the run it continues: a run resumed after a kill). {holds} The "
        "tracker cannot drop what it holds: for a run of this run's values alone, build a new "
        "logger (a new tracker run) before running again.",
        stacklevel=3,
    )


class TrackerSink(Sink):
    """The base of the trackers' sinks (W&B, MLflow): a tracker's run keeps what it logged
    (no step can be dropped or replaced), so a run whose first record goes back over the steps
    the tracker's run holds warns, saying what the tracker then holds: a run started again
    with the same logger (:meth:`start_run`, called by a ``Log`` at ``fit_start``), or the
    first run of a logger that continues a killed run's tracker run (:meth:`continue_run`).

    It also keeps, per metric, the last step the tracker's run held when the run started
    (:meth:`new_names`): MLflow, which keeps every value it is given, logs only the others."""

    _last_step: int | None = None  # the highest step this logger logged, or its run held
    _run_started = False
    # Per metric, the last step the tracker's run holds, and that when the run started: an
    # instance's own dicts once set (these read-only defaults are shared by the class).
    _logged: Mapping[str, int] = MappingProxyType({})
    _held: Mapping[str, int] = MappingProxyType({})

    def start_run(self, *, step: int = 0) -> None:
        """A run starts: its first record warns if the tracker's run holds its step."""
        self._run_started = True
        self._held = dict(self._logged)

    def continue_run(self, held: Mapping[str, int]) -> None:
        """This logger continues a tracker run that holds each metric of ``held`` up to its
        step (a killed run's): its first run starts as a run started again would."""
        self._logged = dict(held)
        self._last_step = max(held.values(), default=None)
        self.start_run()

    def check_step(self, record: Record, kept: str) -> None:
        """Before logging ``record``: at a run's first, :func:`warn_rewound` with ``kept``."""
        if self._run_started:
            self._run_started = False
            warn_rewound(type(self).__name__, record, self._last_step, kept)
        step = record.get("step")
        if isinstance(step, int):
            self._last_step = step if self._last_step is None else max(step, self._last_step)

    def new_names(self, step: int, names: Iterable[str]) -> list[str]:
        """Of the metrics ``names`` logged at ``step``, those the tracker's run did not hold at
        ``step`` or later when this run started. A run resumed from a checkpoint logs again
        the steps its killed run logged after it: the tracker's run keeps one value per step,
        the killed run's (under an exact resume, law 9, the same as this run's).

        Example:
            >>> class Held(TrackerSink):
            ...     def write(self, record): ...
            ...     def close(self): ...
            >>> sink = Held()
            >>> sink.continue_run({"loss": 6, "val_loss": 4})
            >>> sink.new_names(5, ["loss", "val_loss"]), sink.new_names(8, ["loss", "val_loss"])
            (['val_loss'], ['loss', 'val_loss'])
        """
        new = [name for name in names if name not in self._held or step > self._held[name]]
        self._logged = {**self._logged, **{n: max(step, self._logged.get(n, step)) for n in new}}
        return new

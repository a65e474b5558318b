"""A sink that prints each record as one short line, above a progress bar if one is drawn."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import IO, Any

from steplib.distributed import is_main
from steplib.errors import LogWriteError
from steplib.handlers.logging.base import Record, Sink, check_keys
from steplib.handlers.logging.continued import Continuation, first_update, written_again
from steplib.handlers.terminal import tqdm_class


class ConsoleLogger(Sink):
    """Print each record as one short line (above a progress bar, via ``tqdm.write``), and a
    summary of the last value of every name when closed (a value of an earlier record than
    the last says its step).

    A run started again with the same logger (a ``Log`` attached to it calls
    :meth:`start_run`: a run resumed in the same process after a crash, a notebook cell run
    again) writes again what the earlier run printed from the resumed run's first step on:
    the summary counts those records once, with the values the new run printed (as a file
    sink continued at a resume drops them:
    :func:`~steplib.handlers.logging.continued.written_again`). For that the summary keeps
    the last ``kept_records`` records whole (about 0.4 kB each) and folds older ones into its
    count and last values, so that its memory is bounded however long the run. A run started
    again further back (more than ``kept_records`` records) would drop folded records, which
    can no longer be told apart: the summary then drops the fold, counts the records kept and
    says so (``summary after 7 records from step 40001 ...``).

    Args:
        file: the stream (stdout when ``None``).
        keys: the names to print (``None``: all but ``time`` and ``micro_step``).
        rank_zero_only: print on rank 0 only.

    Attributes:
        kept_records: how many of the last records the summary keeps whole (10 000: 4 MB).

    Example:
        >>> console = ConsoleLogger(keys=["loss"])
        >>> console.write({"step": 10, "loss": 2.3456, "lr": 0.1})
        step 10  loss 2.346
        >>> console.write({"step": 20, "loss": 1.5})
        step 20  loss 1.5
        >>> console.close()
        summary after 2 records, at step 20: loss 1.5
    """

    kept_records: int = 10_000

    def __init__(
        self,
        *,
        file: IO[str] | None = None,
        keys: Sequence[str] | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        self.file = file
        self.keys = check_keys("ConsoleLogger", keys)
        self.active = is_main() or not rank_zero_only
        self._summary = _Summary()
        self._continuation = Continuation(continuing=False)

    def start_run(self, *, step: int = 0) -> None:
        """A run starts (a :class:`~steplib.handlers.Log` calls it): its first record drops,
        from the summary, the records it prints again."""
        self._continuation.start_run()

    def write(self, record: Record) -> None:
        """Print ``record`` as ``step S  name value  ...``.

        Raises:
            LogWriteError: the stream cannot be written.
        """
        if not self.active:
            return
        if isinstance(first_update(record), int):  # as a file sink judges, at a step
            means_only = self._continuation.judge(record)
            if means_only is not None:
                self._summary.drop(record, means_only=means_only)
        self._summary.add(record, kept=self.kept_records)
        self._print(f"step {record.get('step')}  {self._format(record)}".rstrip())

    def close(self) -> None:
        """Print the summary line once (nothing if no record was written)."""
        if not self.active or not self._summary.count:
            return
        summary, self._summary = self._summary, _Summary()
        last, steps = summary.last_values()
        since = "" if summary.since is None else f" from step {summary.since}"
        self._print(
            f"summary after {summary.count} records{since}, at step {last.get('step')}: "
            f"{self._format(last, steps)}"
        )

    def _format(self, record: Record, steps: Mapping[str, Any] | None = None) -> str:
        final = record.get("step")
        shown = [
            f"{name} {_short(value)}"
            + ("" if steps is None or steps[name] == final else f" (step {steps[name]})")
            for name, value in record.items()
            if name != "step"
            and name not in _UNSUMMARISED
            and (self.keys is None or name in self.keys)
        ]
        return "  ".join(shown)

    def _print(self, line: str) -> None:
        try:
            tqdm_class().write(line, file=self.file)
        except Exception as error:
            raise LogWriteError(f"ConsoleLogger could not print: {error!r}.") from error


_UNSUMMARISED = ("micro_step", "time")


class _Summary:
    """The records of a console's summary, each counted once: a run started again drops
    those it prints again, so no value of a step it replaced stays (a ``skipped`` the fixed
    run has not). The last records are kept whole for those drops (``tail``); older ones are
    folded into a count and each name's last value and its step, so that a run of 10^6
    records holds ``kept`` of them, not 10^6 (400 MB)."""

    def __init__(self) -> None:
        self.tail: deque[Record] = deque()
        self.since: Any = None  # the step a drop into the fold restarted the count from
        self._fold()

    def _fold(self) -> None:
        self.folded = 0  # how many records the fold holds
        self.last: Record = {}  # each name's last value in the fold ...
        self.steps: dict[str, Any] = {}  # ... and its record's step
        # The fold's latest steps, of any record and of interval means: what a drop compares.
        self.latest: int | None = None
        self.latest_means: int | None = None

    @property
    def count(self) -> int:
        return self.folded + len(self.tail)

    def add(self, record: Record, *, kept: int) -> None:
        """Keep ``record`` (without the clock), folding the oldest beyond ``kept``."""
        self.tail.append({k: v for k, v in record.items() if k not in _UNSUMMARISED})
        while len(self.tail) > max(kept, 0):
            oldest = self.tail.popleft()
            self.folded += 1
            _take(self.last, self.steps, oldest)
            if isinstance(step := oldest.get("step"), int):
                self.latest = step if self.latest is None else max(self.latest, step)
                if oldest.get("updates") is not None:
                    means = self.latest_means
                    self.latest_means = step if means is None else max(means, step)

    def drop(self, first: Record, *, means_only: bool) -> None:
        """Drop the records a run whose first record is ``first`` prints again
        (:func:`written_again`, which grows with a record's step: the fold's latest steps
        tell whether it holds one). A fold that does is dropped whole, and the summary then
        says the step it counts from: the records it folded can no longer be told apart."""
        self.tail = deque(
            r for r in self.tail if not written_again(first, r, means_only=means_only)
        )
        probes = ({"step": self.latest}, {"step": self.latest_means, "updates": 1})
        if any(written_again(first, probe, means_only=means_only) for probe in probes):
            self._fold()
            self.since = (self.tail[0] if self.tail else first).get("step")

    def last_values(self) -> tuple[Record, dict[str, Any]]:
        """Each name's last value, and the step of the record it came from."""
        last, steps = dict(self.last), dict(self.steps)
        for record in self.tail:
            _take(last, steps, record)
        return last, steps


def _take(last: Record, steps: dict[str, Any], record: Record) -> None:
    """Each name of ``record`` into ``last`` with its value and into ``steps`` with the
    record's step: the summary's one rule, for the fold and for the records kept whole."""
    last.update(record)
    steps.update(dict.fromkeys(record, record.get("step")))


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

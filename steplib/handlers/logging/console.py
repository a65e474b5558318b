"""A sink that prints each record as one short line, above a progress bar if one is drawn."""

from __future__ import annotations

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
    :func:`~steplib.handlers.logging.continued.written_again`).

    Args:
        file: the stream (stdout when ``None``).
        keys: the names to print (``None``: all but ``time`` and ``micro_step``).
        rank_zero_only: print on rank 0 only.

    Attributes:
        written: the records of the summary (without ``micro_step`` and ``time``), emptied
            when it is printed; each is kept until then (about 0.4 kB).

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
        self.keys = check_keys("ConsoleLogger", keys)
        self.active = is_main() or not rank_zero_only
        # The records of the summary, as printed: a run started again drops those it prints
        # again, so no value of a step it replaced stays (a `skipped` the fixed run has not).
        self.written: list[Record] = []
        self._continuation = Continuation(continuing=False)

    def start_run(self) -> None:
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
                self.written = [
                    r for r in self.written if not written_again(record, r, means_only=means_only)
                ]
        # What the summary and a later drop read (about 0.4 kB a record): not the clock.
        self.written.append({k: v for k, v in record.items() if k not in _UNSUMMARISED})
        self._print(f"step {record.get('step')}  {self._format(record)}".rstrip())

    def close(self) -> None:
        """Print the summary line once (nothing if no record was written)."""
        if not self.active or not self.written:
            return
        written, self.written = self.written, []
        last: Record = {}
        steps: dict[str, Any] = {}  # the step of each name's last value
        for record in written:
            last.update(record)
            steps.update(dict.fromkeys(record, record.get("step")))
        self._print(
            f"summary after {len(written)} records, at step {last.get('step')}: "
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


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

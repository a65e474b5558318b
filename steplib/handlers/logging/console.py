"""A sink that prints each record as one short line, above a progress bar if one is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import IO, Any

from steplib.distributed import is_main
from steplib.errors import LogWriteError
from steplib.handlers.logging.base import Record, Sink, check_keys
from steplib.handlers.terminal import tqdm_class


class ConsoleLogger(Sink):
    """Print each record as one short line (above a progress bar, via ``tqdm.write``), and a
    summary of the last value of every name when closed (a value of an earlier record than
    the last says its step).

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
        self.keys = check_keys("ConsoleLogger", keys)
        self.active = is_main() or not rank_zero_only
        self.last: Record = {}
        self.steps: dict[str, Any] = {}  # the step of each name's last value
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
        self.steps.update(dict.fromkeys(record, record.get("step")))
        self._print(f"step {record.get('step')}  {self._format(record)}".rstrip())

    def close(self) -> None:
        """Print the summary line once (nothing if no record was written)."""
        if not self.active or not self.records:
            return
        records, self.records = self.records, 0
        last = self.last
        self._print(
            f"summary after {records} records, at step {last.get('step')}: "
            f"{self._format(last, self.steps)}"
        )

    def _format(self, record: Record, steps: Mapping[str, Any] | None = None) -> str:
        final = record.get("step")
        shown = [
            f"{name} {_short(value)}"
            + ("" if steps is None or steps[name] == final else f" (step {steps[name]})")
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

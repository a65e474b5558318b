"""The console's summary holds a bounded number of records however long the run (it held
every record it printed: about 0.4 kB each, 400 MB for 10^6), and prints what it printed when
it held them all, also after a run started again within the records it keeps."""

from __future__ import annotations

import io
import os
import tracemalloc

from steplib.handlers import ConsoleLogger


def _record(step: int) -> dict[str, object]:
    return {"step": step, "epoch": 0, "micro_step": step, "time": 0.5 * step, "loss": 1 / step,
            "lr": 0.1, "grad_norm": 2 / step, "num_targets": 32, "skipped": False}  # fmt: skip


def _summary(kept: int, steps: list[range]) -> str:
    """The summary of a console keeping ``kept`` records, given one run per range (each
    after the first started again); an evaluation at step 4."""
    console = ConsoleLogger(file=io.StringIO(), keys=["loss", "val_loss", "skipped"])
    console.kept_records = kept
    for run in steps:
        console.start_run()
        for step in run:
            console.write(_record(step) | ({"val_loss": 0.5} if step == 4 else {}))
    console.close()
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue().splitlines()[-1]


def test_the_console_summary_memory_is_bounded_by_the_records_it_keeps() -> None:
    with open(os.devnull, "w") as devnull:
        console = ConsoleLogger(file=devnull)
        console.kept_records = 100
        tracemalloc.start()
        try:
            for step in range(1, 5001):
                console.write(_record(step))
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Every record held: about 1.9 MB; 100 records kept: about 40 kB.
    assert held < 200_000, held


def test_the_console_summary_of_a_run_started_again_within_the_kept_records_is_exact() -> None:
    want = _summary(10_000, [range(1, 9)])
    assert (
        want
        == "summary after 8 records, at step 8: loss 0.125  skipped False  val_loss 0.5 (step 4)"
    )
    # Killed after 10, resumed at 6: records 6..10 dropped, the evaluation at 4 folded.
    assert _summary(6, [range(1, 11), range(6, 9)]) == want
    assert _summary(10_000, [range(1, 11), range(6, 9)]) == want


def test_a_run_started_again_before_the_kept_records_says_where_its_summary_counts_from() -> None:
    # Records 1..8 folded when the run started again at 6: they cannot be told apart.
    assert _summary(2, [range(1, 11), range(6, 9)]) == (
        "summary after 3 records from step 6, at step 8: loss 0.125  skipped False"
    )

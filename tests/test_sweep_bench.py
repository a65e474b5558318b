"""Smoke test of benchmarks/bench_sweep.py: it runs and prints its table (no timing asserted)."""

from __future__ import annotations

import pytest

from benchmarks import bench_sweep


def test_bench_sweep_quick_prints_one_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    rows = bench_sweep.main(["--quick", "--batch-size", "8"])
    printed = capsys.readouterr().out
    assert [(r["what"], r["n"]) for r in rows] == [("lr,wd", 2), ("seeds", 2)]
    assert "speed-up" in printed and len(printed.splitlines()) == 4
    assert all(r["mem_ratio"] == pytest.approx(1.0, abs=0.05) for r in rows)

"""Smoke test of the checkpoint benchmark (benchmarks/bench_checkpoint.py): it runs to the end
on a small state and reports every figure. It times nothing against a limit: the timings it
prints are read by people (docs/performance.md), not asserted here."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks import bench_checkpoint as bench


def test_the_checkpoint_benchmark_runs_and_reports_every_ratio(tmp_path: Path) -> None:
    # Its saves and loads step a state between them, so it must go on from the newest state
    # (session 21: it stepped one a load had replaced, refused since the lineage checks).
    for overwrite in ([], ["--overwrite"]):
        output = tmp_path / f"checkpoint{len(overwrite)}.json"
        args = ["--params-m", "0.05", "--rounds", "2", "--dir", str(tmp_path / "ckpt")]
        result = bench.main([*args, "--output", str(output), *overwrite])
        assert output.exists()
        assert set(result["ratios"]) == set(bench.RATIOS)
        assert all(len(values) == 2 for values in result["ratios"].values())
        assert all(math.isfinite(v) for values in result["ratios"].values() for v in values)

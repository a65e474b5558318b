"""The GPU check (``make gpu``, benchmarks/gpu_check.py): its CPU dry run, which CI makes so
that the script cannot rot between the rare runs on a GPU, and its plan for a GPU."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_reports_the_machine_and_every_check_passed(tmp_path: Path) -> None:
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert f"torch {torch.__version__}" in report and "Python " in report
    for check in gpu_check.checks("cpu"):
        assert f"| {check.title} | passed |" in report
    assert "skipped" in report  # the GPU tests, on a CPU
    assert "compile_stats" in report  # the compiled step's figures made it into the report


def test_the_gpu_plan_covers_the_tests_both_workloads_cuda_graphs_and_sweeps_in_9_minutes() -> None:
    plan = gpu_check.checks("cuda")
    titles = [c.title for c in plan]
    assert titles[0] == "pytest -m gpu"
    for workload in ("tiny", "transformer"):
        for mode in ("default", "reduce-overhead"):
            assert f"bench_compile, {workload}, mode={mode}" in titles
    assert titles[-1] == "bench_sweep"
    assert sum(c.budget_s for c in plan) <= gpu_check.TOTAL_S == 520
    assert all("--device" in c.args and "cuda" in c.args for c in plan[1:])


def test_a_failing_or_overlong_check_is_reported_and_the_rest_still_run(tmp_path: Path) -> None:
    failing = gpu_check.Check("fails", ("json.tool", str(tmp_path / "missing.json")), 30)
    slow = gpu_check.Check("sleeps", ("timeit", "-n1", "-r1", "import time; time.sleep(30)"), 1)
    results = [gpu_check.run_check(failing, deadline=time.monotonic() + 60)]
    results.append(gpu_check.run_check(slow, deadline=time.monotonic() + 1))
    assert results[0].status.startswith("failed (exit")
    assert results[1].status.startswith("out of time") and results[1].seconds < 10
    never = gpu_check.Check("never", ("json.tool",), 30)
    gpu_check.write_report(tmp_path / "report.md", "cpu", results, [never])
    report = (tmp_path / "report.md").read_text()
    assert "| fails | failed (exit" in report and "| sleeps | out of time" in report
    assert "| never | not run yet |" in report
    # Two files whatever the number of checks: the device tool brings back only a few.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checks.log", "report.md"]
    assert "===== 1. fails: failed (exit" in (tmp_path / "checks.log").read_text()


def test_make_gpu_runs_the_check_on_the_device_asked_for() -> None:
    shown = subprocess.run(
        ["make", "-n", "gpu", "DEVICE=cpu"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "-m benchmarks.gpu_check --device cpu" in shown
    assert "PYTHONPATH=" in shown  # the checkout on the path: nothing is built


def test_the_report_names_the_machine_without_git(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    # The GPU machine runs a copy of the working tree, which may come without git.
    monkeypatch.setenv("PATH", str(tmp_path))
    lines = gpu_check.environment("cpu")
    assert f"- torch {torch.__version__}, CUDA none" in lines
    assert "- steplib commit unknown" in lines

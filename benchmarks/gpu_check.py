"""The GPU check: every GPU test and benchmark of steplib in one command, and one report.

Usage (from the repository root; ``make gpu`` runs it on a GPU machine, after installing the
wheels that machine lacks, see docs/development.md)::

    python -m benchmarks.gpu_check                  # on CUDA: the whole check, ~8 minutes at most
    python -m benchmarks.gpu_check --device cpu     # the dry run CI makes: the same checks, quick

It runs, each in a child process with its own time budget, never stopping at a failure:

1. ``pytest -m gpu``: the laws on CUDA (no host sync, accumulation, device-side skips, async
   checkpoints, CUDA graphs under ``compile_step``, ...); on a CPU they are all skipped;
2. ``bench_overhead --device ...``: steplib's step against the raw loop, with the host syncs
   per update;
3. ``bench_compile --device ...`` for the tiny MLP and the transformer, eager against
   ``compile_step`` in the default mode and in ``mode="reduce-overhead"`` (CUDA graphs). The
   dry run times the tiny MLP in the default mode only, with ``--quick``: it checks that the
   script and every benchmark it calls still run.

The report (``report.md`` in ``$GPU_REPORT_DIR``, default ``gpu-report/``) names the card,
torch, CUDA and Python, gives each check's status and time, and the tail of its output, which
holds the figures. The exit code is 1 when a check failed or ran out of time.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

TOTAL_S = 480  # the whole check on a GPU: the machines are lent for minutes at a time
# The dry run is not timed, only checked: on a busy 2-core CPU (CI, with the test suite beside
# it) a cold compile alone can take over a minute, so its budgets are this much longer.
CPU_SLACK = 4
TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class Check:
    """One child process: what it is, its arguments after ``python -m``, its time budget."""

    title: str
    args: tuple[str, ...]
    budget_s: int


@dataclasses.dataclass(frozen=True)
class Result:
    check: Check
    status: str  # "passed", "failed (exit N)" or "out of time"
    seconds: float
    output: str


def checks(device: str) -> list[Check]:
    """The checks for ``device``: on ``cpu`` the same ones with the quick settings."""
    quick = device == "cpu"
    pytest = ("pytest", "-m", "gpu", *_plugin(), "-q", "tests")
    overhead: tuple[str, ...] = ("benchmarks.bench_overhead", "--device", device)
    overhead += ("--workload", "tiny", "--contenders", "steplib", "--no-memory")
    overhead += ("--quick",) if quick else ("--rounds", "30")
    found = [
        Check("pytest -m gpu", (*pytest, "-p", "no:cacheprovider"), 150),
        Check("bench_overhead, tiny MLP", (*overhead, "--output", "/dev/null"), 50),
    ]
    for workload in ("tiny",) if quick else ("tiny", "transformer"):
        sizes = ("--quick",) if quick else ("--rounds", "10", "--gate-updates", "20")
        # CUDA graphs need CUDA: the dry run compiles once, in the default mode.
        for mode in ("default",) if quick else ("default", "reduce-overhead"):
            args = ("benchmarks.bench_compile", "--device", device, "--workload", workload)
            found.append(
                Check(
                    f"bench_compile, {workload}, mode={mode}", (*args, "--mode", mode, *sizes), 70
                )
            )
    return found


def _plugin() -> tuple[str, ...]:
    # Installed (a venv), steplib's pytest plugin is loaded by its entry point; on a GPU
    # machine steplib is only on the path, so pytest is told to load it.
    found = importlib.metadata.entry_points(group="pytest11")
    return () if any(ep.name == "steplib" for ep in found) else ("-p", "steplib.testing.plugin")


def run_check(check: Check, *, deadline: float) -> Result:
    """Run ``check`` until it ends or its budget (or the whole check's deadline) is spent."""
    budget = max(1.0, min(check.budget_s, deadline - time.monotonic()))
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", *check.args],
            capture_output=True,
            text=True,
            timeout=budget,
        )
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        return Result(check, f"out of time ({budget:.0f} s)", time.monotonic() - start, output)
    status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
    return Result(check, status, time.monotonic() - start, done.stdout + done.stderr)


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def environment(device: str) -> list[str]:
    """Lines naming the machine: the card, torch, CUDA, Python, and the commit checked."""
    card = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return [
        f"- device: {card or 'cpu (the dry run: GPU tests skipped, quick benchmarks)'}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}",
        f"- Python {platform.python_version()} on {platform.machine()}",
        f"- steplib commit {commit or 'unknown'}",
    ]


def write_report(path: Path, device: str, results: Sequence[Result]) -> None:
    """The markdown report: the machine, a table of the checks, each check's output tail."""
    lines = [f"# steplib GPU check ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    lines += [*environment(device), "", "| check | status | seconds |", "|---|---|---|"]
    lines += [f"| {r.check.title} | {r.status} | {r.seconds:.0f} |" for r in results]
    for r in results:
        tail = "\n".join(r.output.rstrip().splitlines()[-TAIL_LINES:])
        lines += [
            "",
            f"## {r.check.title}: {r.status}",
            "",
            f"`python -m {' '.join(r.check.args)}`",
        ]
        lines += ["", "```text", tail or "(no output)", "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks, write the report, print its path.

    Args:
        argv: command-line arguments (``None``: ``sys.argv[1:]``).

    Returns:
        0 when every check passed, else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default=os.environ.get("GPU_REPORT_DIR", "gpu-report"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu for the dry run")
        return 1
    slack = CPU_SLACK if args.device == "cpu" else 1
    deadline = time.monotonic() + TOTAL_S * slack
    results = []
    for check in checks(args.device):
        result = run_check(
            dataclasses.replace(check, budget_s=check.budget_s * slack), deadline=deadline
        )
        print(f"{check.title}: {result.status} in {result.seconds:.0f} s", flush=True)
        results.append(result)
    report = Path(args.out) / "report.md"
    write_report(report, args.device, results)
    print(f"report: {report}")
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

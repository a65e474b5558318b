"""The GPU check: every GPU test and benchmark of steplib in one command, and one report.

Usage (from the repository root; ``make gpu`` runs it on a GPU machine, after installing the
wheels that machine lacks, see docs/development.md)::

    python -m benchmarks.gpu_check                  # on CUDA: the whole check, ~9 minutes at most
    python -m benchmarks.gpu_check --device cpu     # the dry run CI makes: the same checks, quick

It runs, each in a child process with its own time budget, never stopping at a failure:

1. ``pytest -m gpu``: the laws on CUDA (no host sync, accumulation, device-side skips, async
   checkpoints, CUDA graphs under ``compile_step``, ...); on a CPU they are all skipped;
2. ``bench_overhead --device ...``: steplib's step against the raw loop, with the host syncs
   per update;
3. ``bench_compile --device ...`` for the tiny MLP and the transformer, eager against
   ``compile_step`` in the default mode and in ``mode="reduce-overhead"`` (CUDA graphs). The
   dry run times the tiny MLP in the default mode only, with ``--quick``: it checks that the
   script and every benchmark it calls still run;
4. ``bench_sweep --device ...``: a vectorised sweep of N copies against N sequential runs,
   N up to 64 on CUDA.

The report (``report.md`` in ``$GPU_REPORT_DIR``, default ``gpu-report/``) names the card,
torch, CUDA and Python, gives each check's status and time, and the tail of its output, which
holds the figures. It is written again after each check, so that a machine taken back mid-run
still leaves the checks done so far. The exit code is 1 when a check failed or ran out of time.
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

TOTAL_S = 520  # the whole check on a GPU: the machines are lent for minutes at a time
# The dry run is not timed, only checked: on a busy 2-core CPU (CI, with the test suite beside
# it) a cold compile alone can take over a minute, so its budgets are this much longer.
CPU_SLACK = 4
TAIL_LINES = 60


@dataclasses.dataclass(frozen=True)
class Check:
    """One child process: what it is, its arguments after ``python -m``, its time budget (what
    an earlier check leaves unspent is added to it)."""

    title: str
    args: tuple[str, ...]
    budget_s: int


@dataclasses.dataclass(frozen=True)
class Result:
    """How one check ended: its status, its time and its output."""

    check: Check
    status: str  # "passed", "failed (exit N)" or "out of time"
    seconds: float
    output: str


def checks(device: str) -> list[Check]:
    """The checks for ``device``: on ``cpu`` the same ones with the quick settings."""
    quick = device == "cpu"
    # -v names each test as it ends: a check cut off by its budget still shows how far it got.
    # A test module that cannot be imported on a GPU machine (a dev-only package it lacks) must
    # not stop the GPU tests from running: it is reported as an error, and the check fails.
    # --log-level: torch's compiler logs its trace at DEBUG, thousands of lines that would bury a
    # failure's message in the report (the first GPU run's report was all of them).
    pytest = ("pytest", "-m", "gpu", *_plugin(), "-v", "--continue-on-collection-errors")
    pytest += ("--log-level=INFO", "-p", "no:cacheprovider", "tests")
    overhead: tuple[str, ...] = ("benchmarks.bench_overhead", "--device", device)
    overhead += ("--workload", "tiny", "--contenders", "steplib", "--no-memory")
    # --atol: a weight difference on CUDA (kernels need not be bitwise reproducible) still
    # gets timed; the table's weights column says whether they were bit-identical.
    overhead += ("--quick",) if quick else ("--rounds", "30", "--atol", "1e-5")
    found = [
        Check("pytest -m gpu", pytest, 120),
        Check("bench_overhead, tiny MLP", (*overhead, "--output", "/dev/null"), 40),
    ]
    # The transformer's cold compile alone took 59 s on an H100 (torch 2.11): it gets more.
    for workload, budget in (("tiny", 50),) if quick else (("tiny", 50), ("transformer", 110)):
        # --atol: on an H100 the compiled transformer drifted 5.6e-5, then 1.3e-4, from the eager
        # loop in 20 updates (inductor's fused kernels round differently, and Adam amplifies
        # it): within 1e-3 it is still timed; a broken compile is off by far more.
        sizes: tuple[str, ...] = ("--quick",)
        sizes = sizes if quick else ("--rounds", "10", "--gate-updates", "20", "--atol", "1e-3")
        # CUDA graphs need CUDA: the dry run compiles once, in the default mode.
        for mode in ("default",) if quick else ("default", "reduce-overhead"):
            args = ("benchmarks.bench_compile", "--device", device, "--workload", workload)
            title = f"bench_compile, {workload}, mode={mode}"
            found.append(Check(title, (*args, "--mode", mode, *sizes), budget))
    # A sweep of N copies against N sequential runs (the GPU goal: 10x at N=64).
    sweep = ("benchmarks.bench_sweep", "--device", device)
    found.append(
        Check("bench_sweep", (*sweep, *(("--quick",) if quick else ("--rounds", "20"))), 40)
    )
    return found


def _plugin() -> tuple[str, ...]:
    # Installed (a venv), steplib's pytest plugin is loaded by its entry point; on a GPU
    # machine steplib is only on the path, so pytest is told to load it.
    found = importlib.metadata.entry_points(group="pytest11")
    return () if any(ep.name == "steplib" for ep in found) else ("-p", "steplib.testing.plugin")


def run_check(check: Check, *, deadline: float) -> Result:
    """Run ``check`` until it ends or ``deadline`` (a ``time.monotonic()`` value) passes.

    Args:
        check: what to run, in a child process of this Python.
        deadline: when it is stopped; never later than one second from now.

    Returns:
        Its status, the seconds it took and its output (stdout, then stderr).
    """
    budget = max(1.0, deadline - time.monotonic())
    start = time.monotonic()
    try:
        # faulthandler: a crash in a child (a segfault under CUDA graphs on the first GPU run)
        # prints the Python stack it happened in.
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-m", *check.args],
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
    try:  # the GPU machine runs a copy of the working tree: maybe no .git, maybe no git
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return [
        f"- device: {card or 'cpu (the dry run: GPU tests skipped, quick benchmarks)'}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}",
        f"- Python {platform.python_version()} on {platform.machine()}",
        f"- steplib commit {commit or 'unknown'}",
    ]


def write_report(
    path: Path, device: str, results: Sequence[Result], pending: Sequence[Check] = ()
) -> None:
    """The markdown report: the machine, a table of the checks (``pending``: not run yet), and
    each check's output tail; the checks' whole outputs go next to it, in one ``checks.log``
    (two files in all: the device tool brings back only a few files from a run)."""
    lines = [f"# steplib GPU check ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    lines += [*environment(device), "", "| check | status | seconds |", "|---|---|---|"]
    lines += [f"| {r.check.title} | {r.status} | {r.seconds:.0f} |" for r in results]
    lines += [f"| {c.title} | not run yet | - |" for c in pending]
    path.parent.mkdir(parents=True, exist_ok=True)
    log = []
    for number, r in enumerate(results, 1):
        log += [f"===== {number}. {r.check.title}: {r.status} =====", r.output]
        tail = "\n".join(r.output.rstrip().splitlines()[-TAIL_LINES:])
        lines += ["", f"## {r.check.title}: {r.status}", ""]
        command = f"`python -m {' '.join(r.check.args)}`"
        lines += [f"{command}; the whole output: `checks.log`, section {number}."]
        lines += ["", "```text", tail or "(no output)", "```"]
    (path.parent / "checks.log").write_text("\n".join(log) + "\n")
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
    end = time.monotonic() + TOTAL_S * slack
    plan = [dataclasses.replace(c, budget_s=c.budget_s * slack) for c in checks(args.device)]
    report = Path(args.out) / "report.md"
    results: list[Result] = []
    for index, check in enumerate(plan):
        # Each later check keeps its own budget; this one gets the rest (its own and what the
        # earlier ones left), so a slow cold compile can use the time a quick check saved.
        later = sum(c.budget_s for c in plan[index + 1 :])
        result = run_check(check, deadline=end - later)
        print(f"{check.title}: {result.status} in {result.seconds:.0f} s", flush=True)
        results.append(result)
        write_report(report, args.device, results, plan[index + 1 :])
    print(f"report: {report}")
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What ``import steplib`` costs on top of ``import torch``.

Usage (from the repository root)::

    python -m benchmarks.bench_import              # min of 5 fresh interpreters each
    python -m benchmarks.bench_import --runs 9 --top 15

Each figure is one fresh interpreter's ``python -X importtime -c "import NAME"``: the total of
its top-level import, in seconds. The two commands alternate (torch, steplib, torch, ...), so a
machine that slows down in the middle slows both, and the minimum over ``--runs`` is reported
(the run least disturbed by the rest of the machine). Bytecode caching is turned on for the
children (``PYTHONDONTWRITEBYTECODE`` unset) and one untimed run of each writes the caches
first: a user's second ``import steplib`` never recompiles the sources, so neither does this.

It then lists the modules ``import steplib`` loads that ``import torch`` does not, by their own
time (their imports not included), slowest first: where to look when the ratio grows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

IMPORT_TIME_PREFIX = "import time:"


def import_times(module: str) -> dict[str, tuple[int, int]]:
    """One fresh interpreter's ``-X importtime`` of ``import module``.

    Args:
        module: the module to import.

    Returns:
        ``{module name: (own microseconds, cumulative microseconds)}`` for every module that
        import loaded.

    Raises:
        subprocess.CalledProcessError: the import failed.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    times: dict[str, tuple[int, int]] = {}
    for line in done.stderr.splitlines():
        if not line.startswith(IMPORT_TIME_PREFIX) or "cumulative" in line:
            continue
        own, cumulative, name = line[len(IMPORT_TIME_PREFIX) :].split("|")
        times[name.strip()] = (int(own), int(cumulative))
    return times


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Measure, print the table, return the figures.

    Args:
        argv: command-line arguments (``None``: ``sys.argv[1:]``).

    Returns:
        ``{"torch_s": ..., "steplib_s": ..., "ratio": ...}``: the minima and their ratio.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per module")
    parser.add_argument("--top", type=int, default=10, help="modules beyond torch to list")
    args = parser.parse_args(argv)

    import_times("torch"), import_times("steplib")  # write the bytecode caches, untimed
    torch_runs: list[float] = []
    steplib_runs: list[float] = []
    for _ in range(args.runs):
        torch_times, steplib_times = import_times("torch"), import_times("steplib")
        torch_runs.append(torch_times["torch"][1] / 1e6)
        steplib_runs.append(steplib_times["steplib"][1] / 1e6)
    beyond_torch = {k: own for k, (own, _) in steplib_times.items() if k not in torch_times}
    torch_s, steplib_s = min(torch_runs), min(steplib_runs)
    ratio = steplib_s / torch_s
    print(f"python {sys.version.split()[0]}, min of {args.runs} fresh interpreters each")
    for name, best, runs in (("torch", torch_s, torch_runs), ("steplib", steplib_s, steplib_runs)):
        print(f"import {name:8} {best:7.3f} s  (runs: {', '.join(f'{t:.3f}' for t in runs)})")
    print(f"ratio           {ratio:7.3f}x  (goal: at most 1.2x)")
    print(f"\nthe {args.top} slowest modules beyond torch's (own ms, the last run):")
    ranked = sorted(beyond_torch.items(), key=lambda item: -item[1])[: args.top]
    for name, micros in ranked:
        print(f"  {micros / 1e3:8.1f}  {name}")
    return {"torch_s": torch_s, "steplib_s": steplib_s, "ratio": ratio}


if __name__ == "__main__":
    main()

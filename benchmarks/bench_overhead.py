"""Per-step overhead of steplib against a raw PyTorch loop and the peers, interleaved.

Usage (from the repository root)::

    python -m benchmarks.bench_overhead                      # tiny and transformer, CPU, ~4 min
    python -m benchmarks.bench_overhead --workload tiny --quick
    python -m benchmarks.bench_overhead --workload transformer-big --contenders steplib  # ~75 s
    python -m benchmarks.bench_overhead --device cuda        # adds host syncs per step
    python -m benchmarks.bench_overhead --workload tiny --contenders steplib --profile

What it does, per workload:

1. Builds every contender from the same template weights, data pool, loss and recipe
   (accumulation 4, clip_grad_norm 1.0, AdamW + warmup LambdaLR, fp32) and runs the warm-up
   updates.
2. **Weight gate**: every contender's parameters must equal the raw loop's (bit for bit on CPU;
   ``--atol`` loosens it, e.g. for CUDA kernels that are not bitwise deterministic). A contender
   that fails is reported as failed and is not timed.
3. **Interleaved timing**: in each round every contender runs the same few updates, in a
   shuffled order, in this one process. Machines like this one change speed by ~1.5x every few
   hundred ms, so only times taken close together are compared: the ratio to the raw loop is
   computed per round and the median over rounds reported, with its spread.
4. The gate is repeated after timing (all contenders have run the same updates by then).
5. **Memory**: each contender is run again alone in a child process (peak RSS is
   process-wide, so in the shared process it would only show the largest contender): its RSS
   after build, the peak during training above that (the kernel's RSS high-water mark is reset
   after build via /proc/self/clear_refs), and on CUDA the allocator peak above the build.
6. On CUDA, host syncs per update are counted with ``torch.cuda.set_sync_debug_mode("warn")``.
7. ``--profile``: where one update's time goes, microseconds per phase for steplib and for the
   raw loop's equivalent lines, interleaved (``benchmarks/profile_phases.py``).

Writes JSON (``--output``, default ``benchmarks/results/overhead.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.contenders import Contender, registry
from benchmarks.profile_phases import format_profile, profile
from benchmarks.workloads import WORKLOADS, Setup, Workload

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "overhead.json"
SCHEMA = 1
CHILD_MARKER = "BENCH-MEMORY-JSON "


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much to run for one workload.

    Attributes:
        warmup_steps: updates per contender before the weight gate (also warms caches).
        steps_per_round: updates per contender per round (one timed chunk).
        discard_rounds: interleaved rounds run but not recorded (the order settles, allocator
            caches fill).
        rounds: recorded rounds.
        memory_steps: updates in each memory child process.
        time_budget_s: stop recording rounds once the timed phase has run this long (but not
            before ``min_rounds``), so that a slow or loaded machine still finishes in time;
            the JSON says how many rounds were recorded.
        min_rounds: recorded rounds that the time budget never cuts.
    """

    warmup_steps: int
    steps_per_round: int
    discard_rounds: int
    rounds: int
    memory_steps: int
    time_budget_s: float = math.inf
    min_rounds: int = 1

    @property
    def total_steps(self) -> int:
        """Updates per contender: warm-up, the rounds, and one chunk counting host reads."""
        return self.warmup_steps + (self.discard_rounds + self.rounds + 1) * self.steps_per_round


# Sized so that the whole default run (both workloads, all contenders, memory children) stays
# under 5 minutes on 2 CPU cores; the chunk sizes keep one chunk at a few ms on the tiny
# workload (far above timer resolution and the per-chunk call) and ~1 update on the big one.
PLANS: dict[str, Plan] = {
    "tiny": Plan(
        warmup_steps=12,
        steps_per_round=4,
        discard_rounds=5,
        rounds=300,
        memory_steps=50,
        time_budget_s=60,
        min_rounds=60,
    ),
    "transformer": Plan(
        warmup_steps=3,
        steps_per_round=1,
        discard_rounds=2,
        rounds=40,
        memory_steps=4,
        time_budget_s=110,
        min_rounds=15,
    ),
    "transformer-big": Plan(
        warmup_steps=2,
        steps_per_round=1,
        discard_rounds=1,
        rounds=20,
        memory_steps=2,
        time_budget_s=50,
        min_rounds=8,
    ),
}
# --profile: (rounds, updates per round) of the per-phase profile.
PROFILE_PLANS = {"tiny": (150, 4), "transformer": (12, 1), "transformer-big": (6, 1)}
# What "--workload all" (the default) runs: transformer-big (~75 s for raw + steplib alone) is
# for the "how the cost grows" table and runs only when named.
DEFAULT_WORKLOADS = ("tiny", "transformer")
QUICK_PLANS: dict[str, Plan] = {
    "tiny": Plan(warmup_steps=3, steps_per_round=2, discard_rounds=1, rounds=3, memory_steps=2),
    "transformer": Plan(
        warmup_steps=2, steps_per_round=1, discard_rounds=0, rounds=2, memory_steps=1
    ),
    "transformer-big": Plan(
        warmup_steps=2, steps_per_round=1, discard_rounds=0, rounds=2, memory_steps=1
    ),
}


# ---------------------------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median (binomial order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return ordered[0], ordered[-1]
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[lo], ordered[hi]


def summarise(values: Sequence[float], digits: int) -> dict[str, float]:
    lo, hi = median_ci95(values)
    return {
        key: round(value, digits)
        for key, value in {
            "median": statistics.median(values),
            "p10": percentile(values, 10),
            "q1": percentile(values, 25),
            "q3": percentile(values, 75),
            "p90": percentile(values, 90),
            "median_ci95_lo": lo,
            "median_ci95_hi": hi,
        }.items()
    }


# ---------------------------------------------------------------------------------------------
# weights


def compare_weights(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, Any]:
    """How far ``model``'s parameters are from ``reference``'s (same order, same shapes)."""
    ours = [p.detach() for p in model.parameters()]
    ref = [p.detach() for p in reference.parameters()]
    if len(ours) != len(ref) or any(a.shape != b.shape for a, b in zip(ours, ref, strict=True)):
        return {"bit_identical": False, "max_abs_diff": math.inf, "reason": "different shapes"}
    identical = all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(ours, ref, strict=True))
    return {"bit_identical": identical, "max_abs_diff": diff}


def passes(check: dict[str, Any], atol: float) -> bool:
    return bool(check["bit_identical"]) or (atol > 0 and check["max_abs_diff"] <= atol)


# ---------------------------------------------------------------------------------------------
# memory (child process)


def _proc_status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    # Linux >= 4.0: writing 5 resets VmHWM (the RSS high-water mark) to the current RSS, so a
    # later VmHWM is the peak of what ran in between.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_child(name: str, workload: Workload, device: torch.device, steps: int) -> dict[str, Any]:
    """Build one contender alone in this process, train ``steps`` updates, report memory."""
    cls = registry()[name]
    setup = Setup.create(workload, device, total_steps=steps + 1)
    contender = cls(setup)
    mib = 1 / 1024
    with contender.quiet():
        contender.build()
    gc.collect()
    rss_build = _proc_status_kib("VmRSS")
    reset = _reset_peak_rss()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_build = torch.cuda.memory_allocated(device)
    with contender.quiet():
        contender.advance(steps)
        setup.sync()
        contender.close()
    peak = _proc_status_kib("VmHWM") if reset else None
    result: dict[str, Any] = {
        "rss_after_build_mib": round(rss_build * mib, 1) if rss_build is not None else None,
        "train_peak_rss_mib": round(peak * mib, 1) if peak is not None else None,
        "train_peak_over_build_mib": (
            round((peak - rss_build) * mib, 2)
            if peak is not None and rss_build is not None
            else None
        ),
        # ru_maxrss is the whole child's peak (imports included), in KiB on Linux.
        "process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * mib, 1),
        "steps": steps,
    }
    if cuda:
        over = torch.cuda.max_memory_allocated(device) - allocated_build
        result["cuda_peak_over_build_mib"] = round(over / 2**20, 2)
    return result


def measure_memory(
    name: str, workload: Workload, device: torch.device, steps: int
) -> dict[str, Any]:
    """Run :func:`memory_child` in a fresh interpreter and return its report (or the error)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_overhead",
        "--memory-child",
        name,
        "--workload",
        workload.name,
        "--device",
        device.type,
        "--memory-steps",
        str(steps),
    ]
    try:
        done = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 300 s"}
    for line in done.stdout.splitlines():
        if line.startswith(CHILD_MARKER):
            report: dict[str, Any] = json.loads(line[len(CHILD_MARKER) :])
            return report
    return {"error": f"exit {done.returncode}: {done.stderr.strip()[-500:]}"}


# ---------------------------------------------------------------------------------------------
# the interleaved run


# Tensor methods that copy a value to the host: a device sync when the tensor is on a GPU.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextlib.contextmanager
def count_host_reads() -> Iterator[collections.Counter[str]]:
    """Count calls of :data:`HOST_READS` on any tensor, by calling site (``file:line``).

    Works on CPU too, where nothing syncs: it shows which code *would* sync on a GPU (the law-8
    test of steplib patches the same methods). The patch is process-wide, so the Trainer's
    worker thread is counted as well.
    """
    sites: collections.Counter[str] = collections.Counter()
    patched: list[str] = []

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            sites[f"{caller.f_code.co_filename}:{caller.f_lineno} {name}"] += 1
            return original(self, *args, **kwargs)

        return counted

    try:
        for name in HOST_READS:
            if name in vars(torch.Tensor):  # defined in Python: not ours to patch safely
                continue
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
            patched.append(name)
        yield sites
    finally:
        for name in patched:
            delattr(torch.Tensor, name)  # the C method of TensorBase shows through again


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[warnings.WarningMessage]]:
    """Record the warnings ``set_sync_debug_mode("warn")`` raises for each synchronising op."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per code location
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def run_workload(
    workload: Workload,
    *,
    classes: Sequence[type[Contender]],
    plan: Plan,
    device: torch.device,
    memory: bool,
    atol: float = 0.0,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Build, gate, time (interleaved) and measure the contenders on one workload.

    Args:
        workload: what to train.
        classes: the contenders; the raw loop must be among them (it is the reference).
        plan: how much to run.
        device: ``cpu`` or ``cuda``.
        memory: measure memory in child processes (several seconds per contender).
        atol: accept weights within this absolute difference (0: bit-identical only).
        seed: seeds the weights, the data and the per-round order.
        log: progress lines go here.

    Returns:
        The workload's JSON section.
    """
    if not any(c.name == "raw" for c in classes):
        raise ValueError("run_workload: the raw loop is the reference and must be a contender")
    setup = Setup.create(workload, device, total_steps=plan.total_steps, seed=seed)
    s = plan.steps_per_round
    results: dict[str, dict[str, Any]] = {}
    live: dict[str, Contender] = {}
    for cls in classes:
        entry: dict[str, Any] = {"label": cls.label, "notes": cls.notes}
        results[cls.name] = entry
        if not cls.available():
            entry["status"] = "unavailable"
            entry["reason"] = f"not installed: {', '.join(cls.requires)}"
            continue
        contender = cls(setup)
        try:
            with contender.quiet():
                start = time.perf_counter()
                contender.build()
                contender.advance(plan.warmup_steps)
                setup.sync()
                entry["build_and_warmup_s"] = round(time.perf_counter() - start, 3)
        except Exception as error:  # a peer that cannot run here is reported, not fatal
            entry["status"] = "error"
            entry["reason"] = f"{type(error).__name__}: {error}"
            with contextlib.suppress(Exception), contender.quiet():
                contender.close()
            continue
        live[cls.name] = contender
    if "raw" not in live:
        raise RuntimeError(f"the raw loop could not run: {results['raw'].get('reason')}")
    log(f"[{workload.name}] built and warmed up: {', '.join(live)}")

    def drop(name: str, status: str, reason: str) -> None:
        results[name]["status"] = status
        results[name]["reason"] = reason
        contender = live.pop(name)
        with contextlib.suppress(Exception), contender.quiet():
            contender.close()

    def gate(when: str, steps: int) -> None:
        reference = live["raw"].module()
        for name in list(live):
            contender = live[name]
            with contender.quiet():
                check = compare_weights(contender.module(), reference)
            check["after_steps"] = steps
            results[name].setdefault("weights", {})[when] = check
            if not passes(check, atol):
                reason = (
                    f"weights differ from the raw loop {when} ({steps} updates): max |diff| = "
                    f"{check['max_abs_diff']:.3g}; no time is reported for it"
                )
                drop(name, "failed", reason)

    gate("before_timing", plan.warmup_steps)

    rng = random.Random(seed)
    order = list(live)
    chunks: dict[str, list[int]] = {name: [] for name in live}
    deadline = time.perf_counter() + plan.time_budget_s
    cut_by_budget = False
    for round_index in range(plan.discard_rounds + plan.rounds):
        recorded = round_index - plan.discard_rounds
        if recorded >= plan.min_rounds and time.perf_counter() > deadline:
            cut_by_budget = True
            break
        rng.shuffle(order)
        for name in order:
            if name not in live:
                continue  # dropped in an earlier round
            contender = live[name]
            try:
                with contender.quiet():
                    # A young-generation collection now, outside the clock, so that a
                    # collection triggered by the previous contender's garbage is not charged
                    # to this one.
                    gc.collect(0)
                    start = time.perf_counter_ns()
                    own = contender.advance(s)
                    setup.sync()
                    elapsed = time.perf_counter_ns() - start
            except Exception as error:
                if name == "raw":
                    raise
                drop(name, "error", f"{type(error).__name__} while timing: {error}")
                continue
            if round_index >= plan.discard_rounds:
                chunks[name].append(own if own is not None else elapsed)
    # Every live contender ran every round (the budget only cuts between rounds).
    done_steps = plan.warmup_steps + len(chunks["raw"]) * s + plan.discard_rounds * s
    gate("after_timing", done_steps)

    # One more chunk each, untimed, counting host reads (and on CUDA, real syncs).
    for name, contender in live.items():
        contender.timing_sync = False  # the harness's own synchronize is not the peer's
        with contender.quiet(), count_host_reads() as sites:
            if device.type == "cuda":
                with count_host_syncs() as caught:
                    contender.advance(s)
                syncs = [w for w in caught if "synchroniz" in str(w.message)]
                results[name]["host_syncs_per_step"] = len(syncs) / s
                sync_sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs)
                results[name]["host_sync_sites"] = dict(sync_sites.most_common(10))
            else:
                contender.advance(s)
        contender.timing_sync = True
        results[name]["host_reads_per_step"] = sum(sites.values()) / s
        results[name]["host_read_sites"] = dict(sites.most_common(10))
    gate("after_host_read_count", done_steps + s)
    log(f"[{workload.name}] timed {len(chunks['raw'])} rounds" + (" (time budget)" * cut_by_budget))

    for contender in live.values():
        with contender.quiet():
            contender.close()

    raw_chunks = chunks["raw"]
    for name in live:
        per_step_us = [ns / s / 1000 for ns in chunks[name]]
        ratios = [ns / raw for ns, raw in zip(chunks[name], raw_chunks, strict=True)]
        results[name]["status"] = "ok"
        results[name]["timing"] = {
            "us_per_step": summarise(per_step_us, 1),
            "ratio_to_raw": summarise(ratios, 3),
            "rounds": len(ratios),
        }
    if memory:
        names = [name for name, entry in results.items() if entry.get("status") == "ok"]
        log(f"[{workload.name}] memory, one child process each: {', '.join(names)}")
        # Two children at a time: memory does not depend on CPU contention, and the timing of
        # this workload is over.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            reports = pool.map(
                lambda name: measure_memory(name, workload, device, plan.memory_steps), names
            )
            for name, report in zip(names, reports, strict=True):
                results[name]["memory"] = report
    plan_record: dict[str, Any] = dataclasses.asdict(plan)
    plan_record["recorded_rounds"] = len(chunks["raw"])
    plan_record["cut_by_time_budget"] = cut_by_budget
    return {
        "description": workload.description,
        "recipe": setup.recipe(),
        "plan": plan_record,
        "contenders": results,
    }


# ---------------------------------------------------------------------------------------------
# reporting


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "steplib", "lightning", "accelerate", "pytorch-ignite", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": device.type,
    }
    if device.type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
    return info


def strict_json(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan"): standard JSON has no
    Infinity/NaN, and a diverged contender's weight difference can be either."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def format_table(report: dict[str, Any]) -> str:
    lines: list[str] = []
    cuda = report["machine"]["device"] == "cuda"
    for name, section in report["workloads"].items():
        lines.append(f"\n{name}: {section['description']}")
        head = (
            f"{'contender':<18} {'status':<11} {'us/step':>9} {'x raw':>6} {'95% CI':>11} "
            f"{'p10-p90':>11} "
            f"{'IQR':>11} {'weights':>9} {'RSS MiB':>8} {'+train':>7}"
        )
        if cuda:
            head += f" {'+cuda':>7} {'syncs':>6}"
        head += f" {'reads':>6}"
        lines += [head, "-" * len(head)]
        for entry in section["contenders"].values():
            status = entry.get("status", "?")
            row = f"{entry['label']:<18} {status:<11}"
            timing = entry.get("timing")
            if timing:
                us, ratio = timing["us_per_step"], timing["ratio_to_raw"]
                row += (
                    f" {us['median']:>9.1f} {ratio['median']:>6.3f}"
                    f" {ratio['median_ci95_lo']:>5.2f}-{ratio['median_ci95_hi']:<5.2f}"
                    f" {ratio['p10']:>5.2f}-{ratio['p90']:<5.2f}"
                    f" {ratio['q1']:>5.2f}-{ratio['q3']:<5.2f}"
                )
            else:
                row += f" {'-':>9} {'-':>6} {'-':>11} {'-':>11} {'-':>11}"
            checks = entry.get("weights", {})
            if checks:
                ok = all(c["bit_identical"] for c in checks.values())
                row += f" {'bitwise' if ok else 'DIFFER':>9}"
            else:
                row += f" {'-':>9}"
            mem = entry.get("memory") or {}
            row += f" {_num(mem.get('rss_after_build_mib')):>8} "
            row += f"{_num(mem.get('train_peak_over_build_mib')):>7}"
            if cuda:
                row += f" {_num(mem.get('cuda_peak_over_build_mib')):>7}"
                row += f" {_num(entry.get('host_syncs_per_step')):>6}"
            row += f" {_num(entry.get('host_reads_per_step')):>6}"
            lines.append(row)
            if status not in ("ok",) and entry.get("reason"):
                lines.append(f"{'':<18} {entry['reason']}")
    return "\n".join(lines)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_overhead",
        description="Per-step overhead of steplib vs a raw loop and peers, interleaved.",
    )
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="all",
        help=f"all: {' and '.join(DEFAULT_WORKLOADS)} (the bigger one only when named)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--contenders",
        default="all",
        help=f"comma-separated subset of {','.join(registry())} (raw is always included)",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    parser.add_argument("--rounds", type=int, help="override the recorded rounds")
    parser.add_argument("--steps-per-round", type=int, help="override updates per chunk")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print microseconds per phase of one update, steplib vs the raw loop",
    )
    parser.add_argument("--atol", type=float, default=0.0, help="weight tolerance (0: bitwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    # Internal: the memory measurement re-runs this module in a child process.
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-steps", type=int, default=10, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def select(names: str) -> list[type[Contender]]:
    known = registry()
    if names == "all":
        return list(known.values())
    wanted = {n.strip() for n in names.split(",") if n.strip()} | {"raw"}
    unknown = wanted - known.keys()
    if unknown:
        raise SystemExit(f"unknown contender(s) {sorted(unknown)}; choose from {list(known)}")
    return [cls for name, cls in known.items() if name in wanted]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # One intra-op thread: the tiny workload measures Python overhead, and on 2 shared cores a
    # second thread would mostly measure the other engineers' processes.
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; skipping the GPU benchmark.")
        return 0
    if args.memory_child:
        memory = memory_child(
            args.memory_child, WORKLOADS[args.workload], device, args.memory_steps
        )
        print(CHILD_MARKER + json.dumps(memory))
        return 0

    classes = select(args.contenders)
    names = list(DEFAULT_WORKLOADS) if args.workload == "all" else [args.workload]
    started = time.perf_counter()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.bench_overhead " + " ".join(argv or sys.argv[1:]),
        "machine": machine(device),
        "versions": versions(),
        "method": (
            "interleaved: each round runs steps_per_round updates of every contender in a "
            "shuffled order; us_per_step and ratio_to_raw are over recorded rounds (ratio per "
            "round against that round's raw chunk), with p10/q1/q3/p90 and a 95% CI of the "
            "median. Memory: one child process per contender."
        ),
        "workloads": {},
    }
    for name in names:
        plan = (QUICK_PLANS if args.quick else PLANS)[name]
        if args.rounds is not None:
            plan = dataclasses.replace(plan, rounds=args.rounds)
        if args.steps_per_round is not None:
            plan = dataclasses.replace(plan, steps_per_round=args.steps_per_round)
        report["workloads"][name] = run_workload(
            WORKLOADS[name],
            classes=classes,
            plan=plan,
            device=device,
            memory=not args.no_memory,
            atol=args.atol,
            seed=args.seed,
        )
        if args.profile:
            rounds, per_round = PROFILE_PLANS[name] if not args.quick else (3, 1)
            report["workloads"][name]["profile"] = profile(
                WORKLOADS[name],
                rounds=rounds,
                updates_per_round=per_round,
                device=device,
                seed=args.seed,
            )
    report["wall_s"] = round(time.perf_counter() - started, 1)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(strict_json(report), indent=2, allow_nan=False) + "\n")
    print(format_table(report))
    for name, section in report["workloads"].items():
        if "profile" in section:
            print(f"\n{name}: " + format_profile(section["profile"]))
    print(f"\nwrote {args.output} in {report['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

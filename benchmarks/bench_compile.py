"""``compile_step`` against the raw eager loop, interleaved: speed, cold compile time, numerics.

Usage (from the repository root)::

    python -m benchmarks.bench_compile                     # tiny workload, CPU, ~2 min
    python -m benchmarks.bench_compile --quick             # a smoke test
    python -m benchmarks.bench_compile --steps-per-round 1 --rounds 400
    python -m benchmarks.bench_compile --mode max-autotune-no-cudagraphs
    python -m benchmarks.bench_compile --device cuda --mode reduce-overhead   # CUDA graphs

What it does (the recipe of ``benchmarks/workloads.py``: accumulation 4, clip 1.0, AdamW with a
warmup LambdaLR, fp32; one intra-op thread):

1. **Numerics gate**: fresh copies of the raw loop and of each compiled contender train
   ``--gate-updates`` (200) updates from the same weights on the same data; the compiled
   weights must be within ``--atol`` (1e-5) of the raw loop's, or the contender is reported as
   failed and not timed. The differences after 1 and 10 updates are printed too.
2. **Cold compile time**: the wall time of the compiled contender's first three updates (the
   first runs eagerly, the second compiles every graph), in a fresh inductor cache directory
   unless ``--warm-cache`` (then it shows the cost with inductor's on-disk cache hit).
3. **Interleaved timing** after ``--warmup`` updates: each round runs ``--steps-per-round``
   updates of every contender in a shuffled order in this one process; the ratio to the raw
   loop is taken per round, and the median over rounds is reported with its 95% CI and p10-p90.
   On a shared 2-core machine the speed changes by ~1.5x within seconds, so only times taken
   close together are compared. Short rounds penalise the contender with the larger code
   footprint (caches are cold when its turn comes): run with ``--steps-per-round 1`` and with a
   larger value to see both ends.
4. The weights of the timed instances are compared with the raw loop's before and after timing
   (reported, with the same tolerance).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from benchmarks.bench_overhead import compare_weights, summarise
from benchmarks.contenders import Contender
from benchmarks.contenders.raw import RawContender
from benchmarks.contenders.steplib_loop import SteplibContender
from benchmarks.workloads import WORKLOADS, Setup, Workload
from steplib import compile_step
from steplib.step import compile_stats

CPU = torch.device("cpu")


class CompiledContender(SteplibContender):
    """The steplib step of :class:`SteplibContender` under ``compile_step``."""

    name = "compiled"
    label = "steplib compiled"
    notes = "compile_step(accumulate(clip(make_train_step(loss_fn), max_norm=1.0), 4))"
    compile_kwargs: ClassVar[dict[str, Any]] = {}

    def build(self) -> None:
        super().build()
        self.step = compile_step(self.step, **self.compile_kwargs)

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(compile_stats(self.step))


class TorchCompileContender(RawContender):
    """The raw loop with torch's own recipe: ``torch.compile(model)`` (AOTAutograd backward)
    and the documented compiled optimizer step with a tensor LR."""

    name = "raw-compiled"
    label = "raw + torch.compile"
    notes = (
        "the raw loop with model = torch.compile(model) and @torch.compile def opt_step(): "
        "opt.step(), the LR a tensor (torch's compiled-optimizer tutorial)"
    )

    def build(self) -> None:
        super().build()
        compiled: nn.Module = torch.compile(self.model)  # type: ignore[assignment]
        for group in self.optimizer.param_groups:
            # the tutorial's float32 tensor LR, where the parameters are
            group["lr"] = torch.tensor(group["lr"], device=group["params"][0].device)
        optimizer = self.optimizer

        @torch.compile
        def opt_step() -> None:
            optimizer.step()

        self.compiled_model = compiled
        self.opt_step = opt_step

    def advance(self, steps: int) -> None:
        optimizer, scheduler = self.optimizer, self.scheduler
        loss_fn, k, max_norm = self.setup.loss_fn, self.setup.accumulation, self.setup.max_norm
        model = self.compiled_model
        for _ in range(steps):
            for _ in range(k):
                loss = loss_fn(model, self.next_batch())
                (loss / k).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            self.opt_step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()


def numerics(
    workload: Workload,
    cls: type[Contender],
    *,
    updates: int,
    seed: int,
    device: torch.device = CPU,
) -> dict[str, Any]:
    """Max |w - w_raw| of fresh copies after 1, 10 and ``updates`` updates."""
    setup = Setup.create(workload, device, total_steps=updates, seed=seed)
    raw, other = RawContender(setup), cls(setup)
    raw.build()
    other.build()
    out: dict[str, Any] = {}
    done = 0
    for mark in sorted({1, 10, updates}):
        raw.advance(mark - done)
        other.advance(mark - done)
        done = mark
        out[f"max_abs_diff_after_{mark}"] = compare_weights(other.module(), raw.module())[
            "max_abs_diff"
        ]
    return out


def cold_compile(
    workload: Workload, cls: type[CompiledContender], *, seed: int, device: torch.device = CPU
) -> float:
    """Seconds for build + the first three updates of a fresh compiled contender."""
    setup = Setup.create(workload, device, total_steps=10, seed=seed)
    contender = cls(setup)
    start = time.perf_counter()
    contender.build()
    contender.advance(3)
    setup.sync()
    return time.perf_counter() - start


def timed_rounds(
    workload: Workload,
    classes: Sequence[type[Contender]],
    *,
    warmup: int,
    rounds: int,
    steps_per_round: int,
    seed: int,
    device: torch.device = CPU,
) -> dict[str, Any]:
    total = warmup + (rounds + 2) * steps_per_round
    setup = Setup.create(workload, device, total_steps=total, seed=seed)
    live: dict[str, Contender] = {}
    for cls in classes:
        contender = cls(setup)
        contender.build()
        contender.advance(warmup)
        live[cls.name] = contender
    reference = live["raw"]
    weights: dict[str, Any] = {
        name: {"before_timing": compare_weights(c.module(), reference.module())}
        for name, c in live.items()
    }
    rng = random.Random(seed)
    order = list(live)
    chunks: dict[str, list[int]] = {name: [] for name in live}
    for index in range(rounds + 2):
        rng.shuffle(order)
        for name in order:
            gc.collect(0)  # outside the clock: the previous contender's garbage is not charged
            start = time.perf_counter_ns()
            live[name].advance(steps_per_round)
            setup.sync()  # a GPU's queued kernels belong to the chunk that queued them
            elapsed = time.perf_counter_ns() - start
            if index >= 2:  # two rounds discarded: the order settles
                chunks[name].append(elapsed)
    for name, contender in live.items():
        weights[name]["after_timing"] = compare_weights(contender.module(), reference.module())
    results: dict[str, Any] = {}
    for name, contender in live.items():
        per_update_us = [ns / steps_per_round / 1000 for ns in chunks[name]]
        speedup = [raw / ns for raw, ns in zip(chunks["raw"], chunks[name], strict=True)]
        entry: dict[str, Any] = {
            "us_per_update": summarise(per_update_us, 1),
            "speedup_vs_raw": summarise(speedup, 3),
            "weights": weights[name],
        }
        if isinstance(contender, CompiledContender):
            entry["compile_stats"] = contender.stats()
        results[name] = entry
    return results


def format_row(name: str, entry: dict[str, Any], atol: float) -> str:
    us, speed = entry["us_per_update"], entry["speedup_vs_raw"]
    diffs = [check["max_abs_diff"] for check in entry["weights"].values()]
    ok = "ok" if max(diffs) <= atol else "DRIFT"
    return (
        f"{name:<14} {us['median']:>9.1f} {speed['median']:>7.2f}x"
        f" {speed['median_ci95_lo']:>5.2f}-{speed['median_ci95_hi']:<5.2f}"
        f" {speed['p10']:>5.2f}-{speed['p90']:<5.2f} {max(diffs):>9.1e} {ok}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_compile",
        description="compile_step vs the raw eager loop: speed, cold compile time, numerics.",
    )
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny")
    parser.add_argument("--quick", action="store_true", help="a few updates: a smoke test")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--gate-updates", type=int, default=200)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--mode", help="torch.compile mode for compile_step")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--torch-recipe",
        action="store_true",
        help="also time the raw loop under torch's own compile recipe",
    )
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's disk cache")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.warm_cache:
        # Inductor reads the location when it first compiles: a fresh directory makes the
        # compile time cold (no kernel or graph from an earlier run on disk).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="steplib-inductor-")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; skipping the GPU benchmark.")
        return 0
    workload = WORKLOADS[args.workload]
    if args.quick:
        args.rounds, args.warmup, args.gate_updates = 3, 3, 12
    compiled = type(
        "Compiled",
        (CompiledContender,),
        {"compile_kwargs": {"mode": args.mode} if args.mode else {}},
    )
    print(f"inductor cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'the default (warm)')}")
    cold = cold_compile(workload, compiled, seed=args.seed, device=device)
    print(f"cold start (build + 3 updates, compiles included): {cold:.1f} s")

    candidates: list[type[Contender]] = [compiled]
    if args.torch_recipe:
        candidates.append(TorchCompileContender)
    timed: list[type[Contender]] = [RawContender, SteplibContender]
    for cls in candidates:
        check = numerics(workload, cls, updates=args.gate_updates, seed=args.seed, device=device)
        worst = check[f"max_abs_diff_after_{args.gate_updates}"]
        shown = ", ".join(f"{k.rsplit('_', 1)[1]}: {v:.1e}" for k, v in check.items())
        verdict = "ok" if worst <= args.atol else f"FAILED (> {args.atol:g}): not timed"
        print(f"numerics gate {cls.name}: max |w - w_raw| after {shown} updates -> {verdict}")
        if worst <= args.atol:
            timed.append(cls)

    results = timed_rounds(
        workload,
        timed,
        warmup=args.warmup,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        seed=args.seed,
        device=device,
    )
    print(
        f"\n{workload.name}: {workload.description}; {args.rounds} rounds of "
        f"{args.steps_per_round} update(s) each, interleaved, on {device.type}"
    )
    print(
        f"{'contender':<14} {'us/update':>9} {'speedup':>8} {'95% CI':>11} {'p10-p90':>11}"
        f" {'max|dw|':>9}"
    )
    for name, entry in results.items():
        print(format_row(name, entry, args.atol))
        if "compile_stats" in entry:
            print(f"{'':<14} compile_stats: {entry['compile_stats']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

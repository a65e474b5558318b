"""A sweep of N copies against N sequential steplib runs, interleaved in one process.

Usage (from the repository root)::

    python -m benchmarks.bench_sweep                  # the table below, CPU, one thread, ~2 min
    python -m benchmarks.bench_sweep --quick          # a smoke test
    python -m benchmarks.bench_sweep --device cuda    # on a GPU (`make gpu` runs it)

Each case is a model width (an MLP ``16-w-w-10``), a number of copies N and what differs per
copy: ``lr,wd`` (N (learning rate, weight decay) pairs: ``SweepAdamW``) or ``seeds`` (the same
hyper-parameters: one ``torch.optim.AdamW`` over the stacked parameters). The sequential side
is N ordinary steplib runs (``TrainState`` + ``make_train_step`` + ``torch.optim.AdamW``), one
update each per round; the sweep side is one update of the sweep step. Every round times both
sides in a shuffled order on the same batch; the speed-up is the median over rounds of the
per-round ratio (on a shared machine the speed moves within seconds: only times taken close
together are compared).

Memory: what one update holds, counted in bytes: parameters, gradients and optimizer state,
plus the activations saved for backward of one batch (``saved_tensors_hooks``). A sweep of N
holds N copies of each and one batch; the column ``mem ratio`` is the sweep's over N times
one run's (1.00: nothing more than the N runs together). On CUDA the allocator's peak is shown
too.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.sweep import Copies, SweepAdamW, sweep_step


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def hyper(n: int) -> tuple[list[float], list[float]]:
    return [1e-3 * 1.5**i for i in range(n)], [0.01 * (i % 4) for i in range(n)]


class Sequential:
    """N ordinary steplib runs; ``advance`` is one update of each."""

    def __init__(self, n: int, width: int, per_copy: bool, device: torch.device) -> None:
        lrs, wds = hyper(n)
        self.runs = []
        for i in range(n):
            torch.manual_seed(i)
            model = mlp(width).to(device)
            lr, wd = (lrs[i], wds[i]) if per_copy else (1e-3, 0.01)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
            self.runs.append(sl.TrainState.create(model=model, optimizer=opt))
        self.step = sl.make_train_step(loss_fn)

    def advance(self, batch: Any) -> None:
        for i, state in enumerate(self.runs):
            self.runs[i], _ = self.step(state, batch)


class Sweep:
    """The same N runs as one sweep; ``advance`` is one update of the sweep step."""

    def __init__(
        self, n: int, width: int, per_copy: bool, device: torch.device, batch: Any
    ) -> None:
        self.copies = Copies.seeded(lambda: mlp(width), seeds=range(n)).to(device)
        if per_copy:
            lrs, wds = hyper(n)
            opt: torch.optim.Optimizer = SweepAdamW(
                self.copies.parameters(), lr=lrs, weight_decay=wds
            )
        else:
            opt = torch.optim.AdamW(self.copies.parameters(), lr=1e-3, weight_decay=0.01)
        self.state = sl.TrainState.create(model=self.copies, optimizer=opt)
        self.step = sweep_step(sl.make_train_step(loss_fn), copies=self.copies, example_batch=batch)

    def advance(self, batch: Any) -> None:
        self.state, _ = self.step(self.state, batch)


def held_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, forward: Callable[[], Any]
) -> int:
    """Parameters + gradients + optimizer state + the activations saved for one backward."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.sum().backward()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    model.zero_grad(set_to_none=True)
    return 2 * params + state + saved


def case(
    n: int,
    width: int,
    per_copy: bool,
    *,
    rounds: int,
    warmup: int,
    batch_size: int,
    device: torch.device,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(batch_size, 16, generator=gen).to(device),
        torch.randint(0, 10, (batch_size,), generator=gen).to(device),
    )
    seq, sweep = Sequential(n, width, per_copy, device), Sweep(n, width, per_copy, device, batch)
    sides: dict[str, Callable[[Any], None]] = {"seq": seq.advance, "sweep": sweep.advance}
    for _ in range(warmup):
        for advance in sides.values():
            advance(batch)
    ratios: list[float] = []
    times: dict[str, list[float]] = {"seq": [], "sweep": []}
    for _ in range(rounds):
        took = {}
        for name in random.sample(list(sides), 2):
            _sync(device)
            start = time.perf_counter()
            sides[name](batch)
            _sync(device)
            took[name] = time.perf_counter() - start
            times[name].append(took[name])
        ratios.append(took["seq"] / took["sweep"])
    one = seq.runs[0]
    run_bytes = held_bytes(one.model, one.optimizer, lambda: loss_fn(one.model, batch))
    sweep_bytes = held_bytes(
        sweep.copies, sweep.state.optimizer, lambda: sweep.step.losses(batch)[0]
    )
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        sweep.advance(batch)
        peak = torch.cuda.max_memory_allocated(device)
    return {
        "what": "lr,wd" if per_copy else "seeds",
        "width": width,
        "n": n,
        "seq_ms": 1e3 * statistics.median(times["seq"]),
        "sweep_ms": 1e3 * statistics.median(times["sweep"]),
        "speedup": statistics.median(ratios),
        "p10": _quantile(ratios, 0.1),
        "p90": _quantile(ratios, 0.9),
        "sweep_kib": sweep_bytes / 1024,
        "mem_ratio": sweep_bytes / (n * run_bytes),
        "cuda_peak_mib": None if peak is None else peak / 2**20,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CASES = [  # (what differs, width, N)
    ("lr,wd", 32, 8),
    ("seeds", 32, 32),
    ("lr,wd", 32, 32),
    ("seeds", 32, 8),
    ("seeds", 32, 64),
    ("lr,wd", 128, 8),
    ("seeds", 256, 16),
]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--quick", action="store_true", help="two small cases, a few rounds")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cases = CASES[:2] if not args.quick else [("lr,wd", 32, 2), ("seeds", 32, 2)]
    rounds, warmup = (3, 1) if args.quick else (args.rounds, args.warmup)
    if device.type == "cuda" and not args.quick:
        cases = [*cases, ("seeds", 32, 64), ("lr,wd", 32, 64), ("seeds", 256, 64)]
    elif not args.quick:
        cases = CASES
    print(f"device {device}, {torch.get_num_threads()} thread(s), batch {args.batch_size}, "
          f"{rounds} interleaved rounds per case, torch {torch.__version__}")  # fmt: skip
    header = "what   width   N   seq ms  sweep ms  speed-up (p10-p90)  sweep KiB  mem ratio"
    print(header + ("  CUDA peak MiB" if device.type == "cuda" else ""))
    rows = []
    for what, width, n in cases:
        row = case(
            n, width, what == "lr,wd", rounds=rounds, warmup=warmup,
            batch_size=args.batch_size, device=device,
        )  # fmt: skip
        rows.append(row)
        line = (
            f"{what:6} {width:5} {n:3} {row['seq_ms']:8.2f} {row['sweep_ms']:9.2f} "
            f"{row['speedup']:7.2f}x ({row['p10']:.2f}-{row['p90']:.2f}) "
            f"{row['sweep_kib']:10.0f} {row['mem_ratio']:10.2f}"
        )
        if row["cuda_peak_mib"] is not None:
            line += f" {row['cuda_peak_mib']:14.1f}"
        print(line, flush=True)
    return rows


if __name__ == "__main__":
    main()

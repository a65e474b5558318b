"""Checkpoint speed: steplib's save / load against plain ``torch.save`` / ``torch.load`` of the
same state to the same disk, and how long an async save stalls training.

Usage (from the repository root)::

    python -m benchmarks.bench_checkpoint                     # ~770 MB of state, 7 rounds
    python -m benchmarks.bench_checkpoint --params-m 8 --rounds 3 --dir /tmp/ckpt-bench

The state is a stack of ``Linear`` layers (``--params-m`` million float32 parameters) with
AdamW's two moments (so the checkpoint is ~3x the parameters), a scheduler and the counters.

Rows, each timed in every round, in a shuffled order, in this one process (machines like this
one change speed by a lot every few hundred ms, so only times taken close together are
compared: every ratio is computed within a round and the median over rounds reported):

* ``torch.save``: one ``torch.save`` of the same trees steplib writes, to a path on the same
  disk (no fsync: what most trainers do).
* ``torch.save + fsync``: the same, then ``os.fsync``: what a durable save costs at least.
* ``steplib save``: ``steplib.checkpoint.save`` (3 files + manifest, CRC32 of every byte,
  fsync of every file, atomic rename, directory fsync).
* ``steplib save, no fsync``: the same without the fsyncs (internal switch), to show their part.
* ``torch.load``: ``torch.load(weights_only=True)`` + ``load_state_dict`` into the same objects.
* ``steplib load``: ``steplib.checkpoint.load`` (reads, verifies every checksum, loads).
* ``async stall``: how long ``AsyncSaver.save`` blocks the caller (the snapshot to CPU memory),
  after a first save has allocated the snapshot buffers; ``async first stall``: the first one.

Every operation starts after an (untimed) ``os.sync()``, so that no row pays for another's
unwritten data. Loads read from the page cache (the file was just written); nothing here drops
caches. Prints a Markdown table; writes the raw numbers as JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from steplib import TrainState
from steplib.checkpoint import AsyncSaver, load, save
from steplib.checkpoint import save_load as save_load_module
from steplib.checkpoint.contents import gather


def build_state(params_m: float) -> TrainState:
    """Linear layers of 1024 x 1024 (~1 M parameters each) with AdamW's moments filled in."""
    layers = max(1, round(params_m))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates exp_avg / exp_avg_sq: the optimizer state is 2x the model
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)


def timed(function: Callable[[], Any]) -> float:
    # Start every operation with no dirty pages: on ext4 (data=ordered) an fsync also writes
    # out what earlier operations left unwritten, which would bill one row for another's data.
    os.sync()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--params-m", type=float, default=64, help="million model parameters")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--output", default="benchmarks/results/checkpoint.json")
    args = parser.parse_args(argv)

    state = build_state(args.params_m)
    root = Path(args.dir or tempfile.mkdtemp(prefix="steplib-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    trees = gather(state, data=None, extras={})
    size = sum(
        t.numel() * t.element_size()
        for tree in (trees["model.pt"], trees["optimizer.pt"]["state"])
        for t in _tensors(tree)
    )
    plain = str(root / "plain.pt")
    saver = AsyncSaver()

    def torch_save() -> None:
        torch.save(gather(state, data=None, extras={}), plain)

    def torch_save_fsync() -> None:
        torch_save()
        fsync_file(plain)

    def steplib_save() -> None:
        save(state, str(root / "steplib"))

    def steplib_save_no_fsync() -> None:
        plan = save_load_module.prepare(
            state,
            str(root / "steplib-nofsync"),
            data=None,
            extras=None,
            step=None,
            metrics=None,
            storage_options=None,
            caller="bench",
        )
        save_load_module.write(plan, fsync=False)

    def torch_load() -> None:
        trees = torch.load(plain, map_location="cpu", weights_only=True)
        state.model.load_state_dict(trees["model.pt"])
        state.optimizer.load_state_dict(trees["optimizer.pt"])

    def steplib_load() -> None:
        load(str(root / "steplib" / "step-00000000"), state)

    def async_stall() -> None:
        saver.save(state, str(root / "async"))

    rows: dict[str, Callable[[], None]] = {
        "torch.save": torch_save,
        "torch.save + fsync": torch_save_fsync,
        "steplib save": steplib_save,
        "steplib save, no fsync": steplib_save_no_fsync,
        "torch.load": torch_load,
        "steplib load": steplib_load,
    }
    # Warm-up: files exist for the loads; the async buffers are allocated (timed: first stall).
    steplib_save()
    torch_save()
    first_stall = timed(async_stall)
    saver.wait()

    times: dict[str, list[float]] = {name: [] for name in [*rows, "async stall", "async write"]}
    order = list(rows)
    for _ in range(args.rounds):
        random.shuffle(order)
        for name in order:
            times[name].append(timed(rows[name]))
        stall = timed(async_stall)
        start = time.perf_counter()
        saver.wait()
        times["async stall"].append(stall)
        times["async write"].append(stall + time.perf_counter() - start)
    saver.close()

    def ratio(name: str, base: str) -> list[float]:
        return [a / b for a, b in zip(times[name], times[base], strict=True)]

    ratios = {
        "steplib save / torch.save": ratio("steplib save", "torch.save"),
        "steplib save / torch.save + fsync": ratio("steplib save", "torch.save + fsync"),
        "steplib save, no fsync / torch.save": ratio("steplib save, no fsync", "torch.save"),
        "steplib load / torch.load": ratio("steplib load", "torch.load"),
        "async stall / steplib save": ratio("async stall", "steplib save"),
    }
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "state_bytes": size,
        "directory": str(root),
        "rounds": args.rounds,
        "first_async_stall_s": first_stall,
        "times_s": times,
        "ratios": ratios,
    }
    print(_table(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def _table(result: dict[str, Any]) -> str:
    times, ratios = result["times_s"], result["ratios"]
    mb = result["state_bytes"] / 2**20
    lines = [
        f"state: {mb:,.0f} MiB of tensors; {result['machine']}; torch {result['torch']}, "
        f"{result['threads']} threads; {result['rounds']} rounds; dir {result['directory']}",
        "",
        "| operation | median s | min s | max s | MiB/s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median:.3f} | {min(values):.3f} | {max(values):.3f} | "
            f"{mb / median:,.0f} |"
        )
    lines.append(
        f"| async first stall (buffers allocated) | {result['first_async_stall_s']:.3f} | | | |"
    )
    lines += ["", "| ratio (per round) | median | min | max | goal |", "|---|---:|---:|---:|---|"]
    goals = {
        "steplib save / torch.save": "<= 1.1",
        "async stall / steplib save": "< 0.10",
    }
    for name, values in ratios.items():
        lines.append(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{max(values):.2f} | {goals.get(name, '')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

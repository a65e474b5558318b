"""Checkpoint speed: steplib's save / load against plain ``torch.save`` / ``torch.load`` of the
same state to the same disk, and how long an async save stalls training.

Usage (from the repository root)::

    python -m benchmarks.bench_checkpoint                     # ~770 MB of state, 7 rounds
    python -m benchmarks.bench_checkpoint --params-m 16 --rounds 25   # 192 MiB, the README's
    python -m benchmarks.bench_checkpoint --params-m 8 --rounds 3 --dir /tmp/ckpt-bench

The state is a stack of ``Linear`` layers (``--params-m`` million float32 parameters) with
AdamW's two moments (so the checkpoint is ~3x the parameters), a scheduler and the counters.

Rows, each timed in every round, in a shuffled order, in this one process (machines like this
one change speed by a lot every few hundred ms, so only times taken close together are
compared: every ratio is computed within a round and the median over rounds reported):

* ``torch.save``: one ``torch.save`` of the same trees steplib writes, to a path on the same
  disk (no fsync: what most trainers do; the data may still be in the page cache).
* ``torch.save + fsync``: the same, then ``os.fsync``: a durable ``torch.save``.
* ``steplib save (durable)``: ``steplib.checkpoint.save`` (3 files + manifest, XXH3 of every
  byte, fsync of every file, atomic rename, directory fsync): the default.
* ``steplib save, durable=False``: ``save(..., durable=False)``: the same without the fsyncs
  (still atomic and checksummed).
* ``torch.load``: ``torch.load(weights_only=True)`` + ``load_state_dict`` into the same objects.
* ``steplib load``: ``steplib.checkpoint.load`` (reads, verifies every checksum, loads).
* ``update alone``: one training update of this state (``make_train_step``: forward and
  backward of a batch of 64, AdamW), no save in flight.
* ``async stall``: how long an async save blocks training: ``AsyncSaver.save`` (buffers,
  extras, RNG and data states copied; the parameters and the optimizer state left to a
  background copy) plus what the next update waits for that copy before it changes them
  (``TrainState.fence.wait``, timed inside that update). ``async save call`` and
  ``async fence wait`` are its two parts. Measured after a first save has allocated the
  snapshot buffers; ``async first stall``: the first save call.
* ``update after async save``: that next update, whole (it runs while the background copy and
  the writer share the machine with it); ``async write``: from the save call until committed.
* ``async save + fence wait``: the save call followed by ``state.fence.wait()`` (training
  blocked for the whole copy, as it was before the copy moved to the background).

The goal "a sync save within 1.3x of torch.save" is checked on the two like-for-like pairs:
the durable save against ``torch.save + fsync``, and ``durable=False`` against ``torch.save``;
"a verified load within 1.5x of torch.load" on ``steplib load`` against ``torch.load``.
The durable save against a plain ``torch.save`` is printed too (the price of the fsyncs). The
goal "an async stall below 10% of a sync save" is checked against the durable save (what
``AsyncSaver`` writes by default). What the background work costs the update that runs beside
it (``update after async save`` minus ``update alone``: the copy and the writer take cores and
memory bandwidth from it) is printed against the durable save too, with no goal: it is not a
stall, and how much of it there is depends on how many cores training leaves idle.

Every save writes a new file or checkpoint directory, as a run saving step-500, step-1000, ...
does; what the previous save of its kind wrote is deleted first, untimed (``--overwrite``:
every save of a kind replaces the previous one at the same path, within the timing, as this
benchmark did before: ext4 spends ~100 ms freeing 200 MiB, in both ``torch.save`` and
steplib's rows). Every operation starts after an (untimed) ``os.sync()``, so that no row
pays for another's unwritten data or freed blocks. Loads read from the page cache (the file
was just written); nothing here drops caches. Prints a Markdown table; writes the raw numbers
as JSON (``--output``).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from steplib import TrainState, make_train_step
from steplib.checkpoint import AsyncSaver, load, save
from steplib.checkpoint.contents import gather
from steplib.fence import UpdateFence

DURABLE = "steplib save (durable)"
NOT_DURABLE = "steplib save, durable=False"
SLOWED = "update slowed by async save"  # update after async save - update alone
# name: (numerator row, denominator row, goal on the median or "")
RATIOS = {
    "durable save / (torch.save + fsync)": (DURABLE, "torch.save + fsync", "<= 1.3"),
    "durable=False save / torch.save": (NOT_DURABLE, "torch.save", "<= 1.3"),
    "durable save / torch.save (no fsync)": (DURABLE, "torch.save", ""),
    "steplib load / torch.load": ("steplib load", "torch.load", "<= 1.5"),
    "async stall / durable save": ("async stall", DURABLE, "< 0.10"),
    "async stall / durable=False save": ("async stall", NOT_DURABLE, ""),
    "async save + fence wait / durable save": ("async save + fence wait", DURABLE, ""),
    "update slowed by async save / durable save": (SLOWED, DURABLE, ""),
}
BATCH = 64


def build_state(params_m: float) -> TrainState:
    """Linear layers of 1024 x 1024 (~1 M parameters each) with AdamW's moments filled in.

    A whole ``params_m`` gives that many layers; a fractional one (e.g. 16 / 12 for a 16 MiB
    state) adds a last ``Linear(1024, k)`` with ``k`` the fraction of 1024 outputs.
    """
    layers = max(1, int(params_m) if params_m % 1 else round(params_m))
    torch.manual_seed(0)
    modules = [nn.Linear(1024, 1024) for _ in range(layers)]
    if params_m % 1 and params_m > 1:
        modules.append(nn.Linear(1024, max(1, round(params_m % 1 * 1024))))
    model = nn.Sequential(*modules)
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


class Fresh:
    """New paths to save to, as a run that saves step-500, step-1000, ... writes new files.

    Before each save, what the previous save of the same kind wrote is deleted, untimed:
    overwriting (or deleting) 200 MiB is no part of a save and costs ~100 ms on ext4, which
    would be billed to whichever row overwrote. With ``overwrite`` every save of a kind goes
    to one path instead, replacing the previous file or checkpoint within the timing (how
    this benchmark measured before; ``--overwrite``).
    """

    def __init__(self, root: Path, *, overwrite: bool = False) -> None:
        self.root = root
        self.overwrite = overwrite
        self.count = 0
        self.latest: dict[str, Path] = {}

    def next(self, kind: str) -> Path:
        if self.overwrite:
            self.latest[kind] = self.root / kind
            return self.latest[kind]
        old = self.latest.get(kind)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.count += 1
        self.latest[kind] = self.root / f"{kind}-{self.count}"
        return self.latest[kind]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--params-m",
        type=float,
        default=64,
        help="million model parameters (3x in state; a fraction adds a narrower last layer)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--output", default="benchmarks/results/checkpoint.json")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="save to the same path every time (replacing within the timing), not to new ones",
    )
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
    fresh = Fresh(root, overwrite=args.overwrite)
    saver = AsyncSaver()

    def torch_save(path: Path) -> None:
        torch.save(gather(state, data=None, extras={}), str(path))

    def torch_save_fsync(path: Path) -> None:
        torch_save(path)
        fsync_file(str(path))

    saved: dict[str, str] = {}  # the newest steplib checkpoint, for the loads

    def unnumbered() -> TrainState:
        # The updates between rounds advance state.step: saved as step 0 all along, every
        # checkpoint has one name, so that --overwrite replaces the previous one. The state
        # with the counters set is the run's newest from then on: the updates go on from it.
        nonlocal state
        state = state.replace(step=0)
        return state

    def steplib_save(path: Path) -> None:
        saved["url"] = save(unnumbered(), str(path))

    def steplib_save_not_durable(path: Path) -> None:
        saved["url"] = save(unnumbered(), str(path), durable=False)

    def torch_load(_: Path) -> None:
        trees = torch.load(fresh.latest["plain"], map_location="cpu", weights_only=True)
        state.model.load_state_dict(trees["model.pt"])
        state.optimizer.load_state_dict(trees["optimizer.pt"])

    def steplib_load(_: Path) -> None:
        nonlocal state
        state = load(saved["url"], state)  # the state a load returns is the newest

    def async_stall(path: Path) -> None:
        saver.save(unnumbered(), str(path))

    def async_save_fence_wait(path: Path) -> None:
        saver.save(unnumbered(), str(path))
        state.fence.wait()

    # name: (kind of path written, or "" for a load; the operation)
    rows: dict[str, tuple[str, Callable[[Path], None]]] = {
        "torch.save": ("plain", torch_save),
        "torch.save + fsync": ("plain", torch_save_fsync),
        DURABLE: ("steplib", steplib_save),
        NOT_DURABLE: ("steplib", steplib_save_not_durable),
        "torch.load": ("", torch_load),
        "steplib load": ("", steplib_load),
    }

    def measure(kind: str, operation: Callable[[Path], None]) -> float:
        path = fresh.next(kind) if kind else root
        return timed(lambda: operation(path))

    # Training: the step changes the state in place, as a run does; the fence wait inside it
    # is timed by wrapping the fence the step calls.
    step = make_train_step(lambda model, batch: model(batch).square().mean())
    batch = torch.randn(BATCH, 1024)
    fence_waits: list[float] = []

    class TimedFence(UpdateFence):
        def wait(self) -> None:
            start = time.perf_counter()
            super().wait()
            fence_waits.append(time.perf_counter() - start)

    state = state.replace(lane=dataclasses.replace(state.lane, fence=TimedFence()))

    def update() -> None:
        nonlocal state
        state, _ = step(state, batch)

    # Warm-up: files exist for the loads; the async buffers are allocated (timed: first stall).
    steplib_save(fresh.next("steplib"))
    torch_save(fresh.next("plain"))
    update()
    first_stall = measure("async", async_stall)
    saver.wait()

    names = [*rows, "async save + fence wait", "update alone"]
    names += ["async save call", "async fence wait", "async stall", "update after async save"]
    times: dict[str, list[float]] = {name: [] for name in [*names, "async write", SLOWED]}
    order = list(rows)
    try:
        for _ in range(args.rounds):
            random.shuffle(order)
            for name in order:
                times[name].append(measure(*rows[name]))
            times["async save + fence wait"].append(measure("async", async_save_fence_wait))
            saver.wait()
            times["update alone"].append(timed(update))
            call = measure("async", async_stall)
            fence_waits.clear()
            after = time.perf_counter()
            update()
            updated = time.perf_counter()
            saver.wait()
            times["async save call"].append(call)
            times["async fence wait"].append(fence_waits[0])
            times["async stall"].append(call + fence_waits[0])
            times["update after async save"].append(updated - after)
            times[SLOWED].append(updated - after - times["update alone"][-1])
            times["async write"].append(call + time.perf_counter() - after)
    finally:
        saver.close()

    def ratio(name: str, base: str) -> list[float]:
        return [a / b for a, b in zip(times[name], times[base], strict=True)]

    ratios = {name: ratio(a, b) for name, (a, b, _) in RATIOS.items()}
    goals = {
        name: {
            "median": statistics.median(ratios[name]),
            "goal": goal,
            "met": statistics.median(ratios[name]) <= limit
            if goal.startswith("<=")
            else statistics.median(ratios[name]) < limit,
        }
        for name, (_, _, goal) in RATIOS.items()
        if goal
        for limit in [float(goal.split()[-1])]
    }
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": BATCH,
        "state_bytes": size,
        "directory": str(root),
        "rounds": args.rounds,
        "targets": "overwritten" if args.overwrite else "new",
        "first_async_stall_s": first_stall,
        "times_s": times,
        "ratios": ratios,
        "goals": goals,
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
        f"{result['threads']} threads; {result['rounds']} rounds; {result['targets']} files; "
        f"dir {result['directory']}",
        "",
        "| operation | median s | min s | max s | MiB/s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        speed = f"{mb / median:,.0f}" if median > 0 else ""
        lines.append(f"| {name} | {median:.3f} | {min(values):.3f} | {max(values):.3f} | {speed} |")
    lines.append(
        f"| async first stall (buffers allocated) | {result['first_async_stall_s']:.3f} | | | |"
    )
    lines += [
        "",
        "| ratio (per round) | median | min | max | goal |",
        "|---|---:|---:|---:|---|",
    ]
    for name, values in ratios.items():
        goal = RATIOS[name][2]
        lines.append(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{max(values):.2f} | {goal} |"
        )
    lines.append("")
    for name, goal in result["goals"].items():
        verdict = "met" if goal["met"] else "NOT met"
        lines.append(f"goal {name} {goal['goal']}: {goal['median']:.2f}, {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

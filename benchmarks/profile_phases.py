"""Where one update's time goes: microseconds per phase, steplib against the raw loop's
equivalent lines, interleaved (``python -m benchmarks.bench_overhead --profile``).

steplib's functions are wrapped with a timer that records *exclusive* time (a wrapped call
nested inside another is charged to the inner one only), so the rows add up to the update:

==============================  =====================================  ==========================
row                             steplib                                raw loop
==============================  =====================================  ==========================
forward (loss_fn)               ``loss_fn``                            ``loss_fn``
phase 1: backward               ``forward_backward`` less ``loss_fn``  ``(loss / k).backward()``
step call bookkeeping           ``Step.__call__`` less the phases      (none)
phase 2: grad processing        ``process_grads``                      ``clip_grad_norm_``
phase 3: apply                  ``apply``                              ``step``, ``zero_grad``,
                                                                       ``scheduler.step``
state replacement               ``TrainState.replace``                 (none)
==============================  =====================================  ==========================

The timers cost ~0.2 µs per wrapped call themselves, charged to the rows that make the calls:
read the differences between the columns, not the absolute microseconds.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.workloads import Setup, Workload

ROWS = (
    "forward (loss_fn)",
    "phase 1: backward",
    "step call bookkeeping",
    "phase 2: grad processing",
    "phase 3: apply",
    "state replacement",
)


class Clock:
    """Exclusive time per row: a nested timed call's time is charged to its own row only."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(ROWS, 0)
        self._stack: list[int] = []  # time spent in nested timed calls, per open frame

    def wrap(self, row: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        totals, stack, now = self.totals, self._stack, time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0)
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = now() - start
                nested = stack.pop()
                totals[row] += elapsed - nested
                if stack:
                    stack[-1] += elapsed

        return timed

    def take(self) -> dict[str, int]:
        """The totals so far, and zero them (in place: the wrappers hold the dict)."""
        out = dict(self.totals)
        self.totals.update(dict.fromkeys(ROWS, 0))
        return out


@contextlib.contextmanager
def timed_steplib(clock: Clock) -> Iterator[None]:
    """Wrap steplib's phases with ``clock`` while the block runs (class attributes and module
    globals, restored afterwards)."""
    from steplib.state import TrainState
    from steplib.step import core

    patches = [
        (core.Step, "__call__", "step call bookkeeping"),
        (core.Step, "_close", "phase 3: apply"),
        (core, "apply", "phase 3: apply"),
        (TrainState, "replace", "state replacement"),
    ]
    runner = core.Runner
    saved = [(owner, name, vars(owner)[name]) for owner, name, _ in patches]
    saved += [(runner, n, vars(runner)[n]) for n in ("forward_backward", "process_grads")]
    try:
        for owner, name, row in patches:
            setattr(owner, name, clock.wrap(row, getattr(owner, name)))
        runner.forward_backward = staticmethod(
            clock.wrap("phase 1: backward", core.forward_backward)
        )
        runner.process_grads = staticmethod(
            clock.wrap("phase 2: grad processing", core.process_grads)
        )
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _steplib(setup: Setup, clock: Clock) -> Callable[[list[Any]], None]:
    import steplib

    model = setup.make_model()
    optimizer = setup.make_optimizer(model.parameters())
    holder = [
        steplib.TrainState.create(
            model=model, optimizer=optimizer, scheduler=setup.make_scheduler(optimizer)
        )
    ]
    loss_fn = clock.wrap("forward (loss_fn)", setup.loss_fn)
    step = steplib.accumulate(
        steplib.clip(steplib.make_train_step(loss_fn), max_norm=setup.max_norm),
        setup.accumulation,
    )

    def advance(batches: list[Any]) -> None:
        state = holder[0]
        with timed_steplib(clock):
            for batch in batches:
                state, _ = step(state, batch)
        holder[0] = state

    return advance


def _raw(setup: Setup, clock: Clock) -> Callable[[list[Any]], None]:
    model = setup.make_model()
    optimizer = setup.make_optimizer(model.parameters())
    scheduler = setup.make_scheduler(optimizer)
    k, max_norm, totals = setup.accumulation, setup.max_norm, clock.totals
    loss_fn = setup.loss_fn
    now = time.perf_counter_ns

    def advance(batches: list[Any]) -> None:
        for i in range(0, len(batches), k):
            for batch in batches[i : i + k]:
                t0 = now()
                loss = loss_fn(model, batch)
                t1 = now()
                (loss / k).backward()
                t2 = now()
                totals["forward (loss_fn)"] += t1 - t0
                totals["phase 1: backward"] += t2 - t1
            t0 = now()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            t1 = now()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            t2 = now()
            totals["phase 2: grad processing"] += t1 - t0
            totals["phase 3: apply"] += t2 - t1

    return advance


def profile(
    workload: Workload,
    *,
    rounds: int,
    updates_per_round: int,
    device: torch.device | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Median microseconds per update of each row over ``rounds`` interleaved rounds. On a GPU
    the rows are host time (what the Python side costs; kernels run asynchronously).

    Returns:
        ``{"rows": {row: {"steplib": us, "raw": us, "diff": us}}, "total": {...}, ...}``.
    """
    k = 4
    total = (rounds + 3) * updates_per_round
    device = device or torch.device("cpu")
    setup = Setup.create(workload, device, total_steps=total + 1, seed=seed)
    clocks = {"raw": Clock(), "steplib": Clock()}
    runs = {"raw": _raw(setup, clocks["raw"]), "steplib": _steplib(setup, clocks["steplib"])}
    pool = list(setup.batches)
    per_round: dict[str, list[dict[str, int]]] = {name: [] for name in runs}
    rng = random.Random(seed)
    order = list(runs)
    position = 0
    for index in range(rounds + 3):
        batches = [pool[(position + j) % len(pool)] for j in range(updates_per_round * k)]
        position += len(batches)
        rng.shuffle(order)
        for name in order:
            gc.collect(0)
            runs[name](batches)
            setup.sync()  # outside the timers: the next contender starts on an idle device
            taken = clocks[name].take()
            if index >= 3:  # three warm-up rounds
                per_round[name].append(taken)
    rows: dict[str, dict[str, float]] = {}
    for row in (*ROWS, "total"):
        values = {}
        for name in runs:
            samples = [
                (sum(r.values()) if row == "total" else r[row]) / updates_per_round / 1000
                for r in per_round[name]
            ]
            values[name] = round(statistics.median(samples), 1)
        values["diff"] = round(values["steplib"] - values["raw"], 1)
        rows[row] = values
    return {"rounds": rounds, "updates_per_round": updates_per_round, "us_per_update": rows}


def format_profile(report: dict[str, Any]) -> str:
    lines = [
        f"per-phase profile: median us per update over {report['rounds']} interleaved rounds "
        f"of {report['updates_per_round']} updates (timers included)",
        f"{'phase':<26} {'steplib':>9} {'raw':>9} {'diff':>8}",
    ]
    for row, values in report["us_per_update"].items():
        lines.append(
            f"{row:<26} {values['steplib']:>9.1f} {values['raw']:>9.1f} {values['diff']:>+8.1f}"
        )
    return "\n".join(lines)

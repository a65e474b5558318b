"""A small training run for the resume tests, importable and runnable as a separate process.

Every run is built from a :class:`Setup` alone (seeds included), so that a run interrupted in
one process and resumed in another can be compared bit for bit with an uninterrupted one:
dropout, a shuffling ``resumable_loader``, AdamW with a warmup-cosine schedule, clipping, and
optionally accumulation and float16 with a GradScaler.

As a script::

    python -m tests.resume_worker resume JOBS.json RESULTS.pt   # resume each job, save results
    python -m tests.resume_worker sigterm DIR READY_FILE        # train slowly until SIGTERM
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from steplib import (
    Events,
    Stop,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    run,
    warmup_cosine,
)
from steplib.checkpoint import checkpoint_every, preemption, resume_from, save
from steplib.data import ResumableLoader, resumable_loader

Record = tuple[str, int, torch.Tensor]  # ("micro" | "step", counter, loss)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything that defines a run."""

    steps: int = 25
    accumulate: int = 1
    fp16: bool = False
    samples: int = 40  # 10 batches of 4 per epoch
    batch_size: int = 4
    width: int = 32
    deep: bool = False  # an extra width x width layer: bigger checkpoints for the kill tests
    dropout: float = 0.25
    seed: int = 0


def build(setup: Setup) -> tuple[Any, TrainState, ResumableLoader]:
    """The step, the initial state and the loader of ``setup`` (seeds the global generator)."""
    torch.manual_seed(setup.seed)
    hidden: list[nn.Module] = [nn.Linear(8, setup.width), nn.Tanh()]
    if setup.deep:
        hidden += [nn.Linear(setup.width, setup.width), nn.Tanh()]
    model = nn.Sequential(*hidden, nn.Dropout(setup.dropout), nn.Linear(setup.width, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup=3, total=setup.steps)
    )
    scaler = (
        # A scale that overflows float16 at first: updates are skipped and the scale backs off,
        # then grows every 2 good updates, so the scaler's state changes all the time.
        torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) if setup.fp16 else None
    )
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    data = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(
        torch.randn(setup.samples, 8, generator=data), torch.randn(setup.samples, 3, generator=data)
    )
    loader = resumable_loader(dataset, batch_size=setup.batch_size, shuffle=True, seed=7)
    step = clip(make_train_step(_loss), max_norm=1.0)
    if setup.accumulate > 1:
        step = accumulate(step, setup.accumulate)
    if setup.fp16:
        step = amp_wrap(step, dtype=torch.float16)
    return step, state, loader


def _loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def recorder(records: list[Record], events: Events) -> Events:
    """Record every micro-batch's and every update's loss."""
    events.on("micro_step_end", lambda e: records.append(("micro", e.micro_step, e.output.loss)))
    events.on("step_end", lambda e: records.append(("step", e.step, e.output.loss)))
    return events


def result(state: TrainState, records: list[Record]) -> dict[str, Any]:
    """What two runs are compared by (plain data, for torch.save)."""
    return {
        "records": records,
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optimizer": state.optimizer.state_dict(),
        "scaler": None if state.scaler is None else state.scaler.state_dict(),
        "counters": (state.step, state.micro_step, state.epoch),
    }


def reference(setup: Setup) -> dict[str, Any]:
    """The uninterrupted run."""
    step, state, loader = build(setup)
    records: list[Record] = []
    state = run(step, state, loader, events=recorder(records, Events()), max_steps=setup.steps)
    return result(state, records)


def first_leg(
    setup: Setup, directory: str, *, at_step: int | None = None, at_micro: int | None = None
) -> dict[str, Any]:
    """Train until the save point, checkpoint there and stop (the process then ends).

    ``at_step`` saves through ``checkpoint_every`` at that update; ``at_micro`` saves with
    ``save`` after that micro-batch, inside an open accumulation window.
    """
    step, state, loader = build(setup)
    records: list[Record] = []
    events = recorder(records, Events())
    if at_step is not None:
        checkpoint_every(directory, every=at_step, data=loader, at_end=False).attach(events)
        events.on("step_end", lambda e: Stop("saved"), once=at_step)
    else:

        def save_mid_window(event: Any) -> Stop:
            assert event.state.window.size > 0, "the test means to save inside a window"
            save(event.state, directory, data=loader, step=step)
            return Stop("saved")

        events.on("micro_step_end", save_mid_window, once=at_micro)
    state = run(step, state, loader, events=events, max_steps=setup.steps)
    return result(state, records)


def resume(setup: Setup, directory: str) -> dict[str, Any]:
    """A fresh process's run: resume from ``directory`` and train to the end."""
    step, state, loader = build(setup)
    records: list[Record] = []
    events = Events().on("fit_start", resume_from(directory, data=loader))
    state = run(step, state, loader, events=recorder(records, events), max_steps=setup.steps)
    return result(state, records)


# ---------------------------------------------------------------------------------------------
# Fault injection: a run that checkpoints every update and logs every loss as it goes, so that
# a parent can SIGKILL it anywhere and check what it had computed so far.
# ---------------------------------------------------------------------------------------------


def logged_run(setup: Setup, directory: str, log_path: str, *, background: bool) -> None:
    """Resume from ``directory`` (if anything is there) and train to the end, checkpointing
    every update (keep_last=2) and appending ``loss <micro_step> <hex>`` and
    ``saving <step>`` / ``saved <step>`` lines to ``log_path`` unbuffered."""
    torch.set_num_threads(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    step, state, loader = build(setup)
    events = Events().on("fit_start", resume_from(directory, data=loader))
    events.on("fit_start", lambda e: log(f"start {e.step}"))
    events.on("micro_step_end", lambda e: log(f"loss {e.micro_step} {float(e.output.loss).hex()}"))
    # The checkpoint handler saves after the other handlers (last=True): these two lines
    # bracket its save as the last handlers too, in registration order.
    events.on("step_end", lambda e: log(f"saving {e.step}"), last=True)
    checkpoint_every(directory, every=1, keep_last=2, data=loader, background=background).attach(
        events
    )
    events.on("step_end", lambda e: log(f"saved {e.step}"), last=True)
    state = run(step, state, loader, events=events, max_steps=setup.steps)
    torch.save(result(state, []), log_path + ".final.pt")
    log("done")
    os.close(fd)


def reference_losses(setup: Setup, out_path: str) -> None:
    """The uninterrupted run's losses by micro_step and its final state, saved to a file."""
    torch.set_num_threads(1)
    torch.save(reference(setup), out_path)


# ---------------------------------------------------------------------------------------------
# SIGTERM: a slow run that a parent terminates; it saves at the next update and exits.
# ---------------------------------------------------------------------------------------------


def sigterm_run(setup: Setup, directory: str, ready_file: str) -> int:
    """Train with a preemption handler, one update per ~20 ms, touching ``ready_file`` after
    update 3 so the parent knows when to send SIGTERM. Returns the handler's exit code."""
    step, state, loader = build(setup)
    slow: Callable[[Any], None] = lambda e: time.sleep(0.02)  # noqa: E731
    checkpointer = checkpoint_every(directory, every=1000, data=loader, at_end=False)
    handler = preemption(checkpointer)
    events = handler.attach(checkpointer.attach(Events()))
    events.on("step_end", slow)
    events.on("step_end", lambda e: Path(ready_file).touch(), once=3)
    state = run(step, state, loader, events=events, max_steps=setup.steps)
    print(f"stopped at step {state.step}: preempted={handler.received is not None}", flush=True)
    print(f"saved {handler.saved}", flush=True)
    return handler.exit_code


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    command = argv[0]
    if command == "resume":
        jobs = json.loads(Path(argv[1]).read_text())
        results = {job["name"]: resume(Setup(**job["setup"]), job["directory"]) for job in jobs}
        torch.save(results, argv[2])
        return 0
    if command == "sigterm":
        return sigterm_run(Setup(steps=400), argv[1], argv[2])
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

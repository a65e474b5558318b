"""Small states and runs shared by the checkpoint tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch

from steplib import Step, TrainState, make_train_step
from tests.reference import make_batches, mean_loss, tiny_model


def make_state(
    seed: int = 0,
    *,
    scheduler: bool = True,
    scaler: bool = False,
    dropout: float = 0.0,
    extras: dict[str, Any] | None = None,
) -> TrainState:
    """A tiny model with AdamW (stateful buffers), optionally a scheduler and a scaler."""
    model = tiny_model(seed, dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState.create(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        if scheduler
        else None,
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None,
        extras=extras,
    )


def train(state: TrainState, step: Step | None = None, n: int = 3, *, seed: int = 1) -> TrainState:
    """``n`` calls of ``step`` (a plain train step by default) on fixed batches."""
    step = step or make_train_step(mean_loss)
    for batch in make_batches(n, seed=seed):
        state, _ = step(state, batch)
    return state


def snapshot(state: TrainState) -> dict[str, Any]:
    """Copies of everything a resume must restore, to compare after more training."""
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optimizer": _clone(state.optimizer.state_dict()),
        "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
        "counters": (state.step, state.micro_step, state.epoch, state.window.size),
    }


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Recursive equality; tensors bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree


@pytest.fixture
def memory_dir() -> Iterator[str]:
    """A fresh ``memory://`` directory (the memory filesystem is process-global: removed after)."""
    url = f"memory://steplib-tests/{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def assert_every_rank_saved_update_3_and_stopped(results: list[Any], root: Any) -> None:
    """What the 2-rank preemption scenarios expect: the ranks agree on everything, saved the
    same update (3: signalled during update 2) into ``root/preempt`` once, and report SIGUSR1."""
    import signal

    from steplib.checkpoint import list_checkpoints

    assert results[0] == results[1]
    assert results[0]["saved"] == f"{root}/preempt/step-00000003"
    assert results[0]["exit_code"] == 128 + signal.SIGUSR1
    assert [c.step for c in list_checkpoints(f"{root}/preempt")] == [3]


def assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    """A port's run through steplib equals its plain loop's, bit for bit: the model, the
    optimizer state, and each update's loss and rate from where it resumed (``"resumed"``)."""
    first = got.get("resumed", 0)
    assert_same(got["model"], want["model"])
    assert_same(got["optimizer"], want["optimizer"])
    assert_same(got["losses"], want["losses"][first:])
    if "lrs" in got:
        assert got["lrs"] == want["lrs"][first:]


def assert_same_on_ranks(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """:func:`assert_same_run` on each of 2 ranks; the loss steplib reports is the mean over
    the ranks (each rank's loss is its own in the loop)."""
    mean = [(a + b) / 2 for a, b in zip(want[0]["losses"], want[1]["losses"], strict=True)]
    for mine, theirs in zip(got, want, strict=True):
        assert_same_run(mine, {**theirs, "losses": mean})


class KilledError(Exception):
    """The job dying after an update, between two saves."""


def record_and_kill(
    events: Any, kill_at: int | None
) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """Register on ``events`` what a port's run records (the step it started at, after
    ``resume_from``; each update's loss and rate) and a :class:`KilledError` after update
    ``kill_at``; return the three lists, filled as the run goes."""
    resumed: list[int] = []
    events.on("fit_start", lambda e: resumed.append(e.step))  # after resume_from's

    def kill(event: Any) -> None:
        if event.step == kill_at:
            raise KilledError

    events.on("step_end", kill)
    losses: list[torch.Tensor] = []
    lrs: list[float] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    events.on("step_end", lambda e: lrs.append(float(e.output.lr)))
    return resumed, losses, lrs

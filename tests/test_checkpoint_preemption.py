"""Preemption: SIGTERM / SIGUSR1 only set a flag; the save happens at the next optimizer-step
boundary; the loop stops cleanly with a recognisable exit; the resume is exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from steplib import ConfigError, Events, accumulate, make_train_step, run
from steplib.checkpoint import checkpoint_every, list_checkpoints, load, preemption, resume_from
from tests.checkpoint_helpers import assert_same, make_state, snapshot
from tests.reference import make_batches, mean_loss
from tests.resume_worker import Record, Setup, build, recorder

ROOT = Path(__file__).resolve().parents[1]


def _kill_self_at(micro_step: int, signum: int = signal.SIGUSR1) -> Any:
    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        _kill_self_at.calls += 1  # type: ignore[attr-defined]
        if _kill_self_at.calls == micro_step:  # type: ignore[attr-defined]
            os.kill(os.getpid(), signum)  # as a scheduler would, in the middle of a step
        return mean_loss(model, batch)

    _kill_self_at.calls = 0  # type: ignore[attr-defined]
    return loss_fn


def test_signal_saves_at_the_next_update_and_stops_cleanly(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    step = accumulate(make_train_step(_kill_self_at(micro_step=5)), 3)  # inside window 2
    checkpointer = checkpoint_every(str(tmp_path), every=100)
    handler = preemption(checkpointer)
    ends: list[str] = []
    events = handler.attach(checkpointer.attach(Events()))
    events.on("fit_end", lambda e: ends.append("fit_end"))
    state = run(step, make_state(), make_batches(12), events=events)
    # Signalled during micro-batch 5: the window closed at 6 (update 2), saved there, stopped.
    assert (state.step, state.micro_step) == (2, 6)
    assert handler.received == signal.SIGUSR1 and handler.exit_code == 128 + signal.SIGUSR1
    assert handler.saved == f"{tmp_path}/step-00000002"
    assert [c.name for c in list_checkpoints(str(tmp_path))] == ["step-00000002"]
    assert ends == ["fit_end"]  # a clean end, not an exception
    assert signal.getsignal(signal.SIGUSR1) == previous  # handlers restored


def test_no_signal_no_preemption_save(tmp_path: Path) -> None:
    checkpointer = checkpoint_every(str(tmp_path), every=100, at_end=False)
    handler = preemption(checkpointer)
    run(
        make_train_step(mean_loss),
        make_state(),
        make_batches(3),
        events=handler.attach(checkpointer.attach(Events())),
    )
    assert handler.received is None and handler.saved is None and handler.exit_code == 0
    assert list_checkpoints(str(tmp_path)) == []


def test_a_second_signal_gets_its_previous_meaning(tmp_path: Path) -> None:
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:

        def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            os.kill(os.getpid(), signal.SIGUSR1)  # asked twice within one update
            os.kill(os.getpid(), signal.SIGUSR1)
            return mean_loss(model, batch)

        checkpointer = checkpoint_every(str(tmp_path), every=100)
        handler = preemption(checkpointer)
        run(
            make_train_step(loss_fn),
            make_state(),
            make_batches(3),
            events=handler.attach(checkpointer.attach(Events())),
        )
        assert calls == [signal.SIGUSR1]  # the second went to the previous handler
        assert handler.received == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preemption_outside_the_main_thread_is_refused(tmp_path: Path) -> None:
    checkpointer = checkpoint_every(str(tmp_path), every=100)
    events = preemption(checkpointer).attach(Events())
    errors: list[BaseException] = []

    def train() -> None:
        try:
            run(make_train_step(mean_loss), make_state(), make_batches(2), events=events)
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)
    assert "main thread" in str(errors[0])


@pytest.mark.slow
def test_sigterm_in_a_separate_process_saves_exits_cleanly_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    directory, ready = tmp_path / "ckpt", tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.resume_worker", "sigterm", str(directory), str(ready)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the child never reached update 3"
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "preempted=True" in out
    (info,) = list_checkpoints(str(directory))
    assert 3 <= info.step < 400 and f"saved {info.url}" in out

    # The resume continues exactly where the uninterrupted run is at that step.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup, stop = Setup(steps=400), info.step + 6
        step, state, loader = build(setup)
        want: list[Record] = []
        state = run(step, state, loader, events=recorder(want, Events()), max_steps=stop)
        step, fresh, loader = build(setup)
        got: list[Record] = []
        events = Events().on("fit_start", resume_from(str(directory), data=loader))
        resumed = run(step, fresh, loader, events=recorder(got, events), max_steps=stop)
    finally:
        torch.set_num_threads(threads)
    tail = [r for r in want if r[1] > (info.micro_step if r[0] == "micro" else info.step)]
    assert [(k, n) for k, n, _ in got] == [(k, n) for k, n, _ in tail]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(got, tail, strict=True))
    assert_same(snapshot(resumed)["model"], snapshot(state)["model"])
    assert load(info.url, build(setup)[1]).step == info.step

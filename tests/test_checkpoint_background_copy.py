"""The async save copies the parameters and the optimizer state in the background: the save
returns before they are copied, forward and backward run meanwhile, the next update (and
``load``) waits for the copy, buffers are copied before ``save`` returns, and a tensor changed
in place during the copy fails the checkpoint loudly instead of committing a torn one.

The background copy is held back by a gate in these tests, so that each ordering is certain
rather than a matter of timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from steplib import TrainState, accumulate, compile_step, make_train_step
from steplib.checkpoint import (
    AsyncSaver,
    CheckpointError,
    latest,
    load,
    save,
)
from steplib.checkpoint.background import BackgroundCopy
from tests.checkpoint_helpers import assert_same, make_state, snapshot, train
from tests.reference import make_batches, mean_loss

WAIT = 10  # seconds: a bound on what must happen at once, never reached when the code is right


class Gate:
    """Holds every background copy until ``open()``; records what each one copies."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.started = threading.Event()
        self.paths: list[tuple[Any, ...]] = []

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate()
    run = BackgroundCopy._run

    def gated(self: BackgroundCopy) -> None:
        assert self._copies is not None
        gate.paths += [path for path, *_ in self._copies]
        gate.started.set()
        gate.opened.wait(WAIT)
        run(self)

    monkeypatch.setattr(BackgroundCopy, "_run", gated)
    yield gate
    gate.open()  # never leave a thread waiting


def in_thread(function: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``function`` in a thread; its result (or error) lands in the returned dict."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = function()
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def batchnorm_state() -> TrainState:
    """A model with buffers that every training forward changes (BatchNorm's statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3), nn.Flatten(0))
    return TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_only_parameters_and_optimizer_state_are_left_to_the_background(
    tmp_path: Path, gate: Gate
) -> None:
    state = train(batchnorm_state(), n=2)
    saver = AsyncSaver()
    saver.save(state, str(tmp_path))  # returns although the background copy cannot start
    assert gate.started.wait(WAIT)
    deferred = {"/".join(map(str, path)) for path in gate.paths}
    parameters = {f"model.pt/{name}" for name, _ in state.model.named_parameters()}
    moments = {
        f"optimizer.pt/state/{index}/{key}"
        for index in range(len(parameters))
        for key in ("exp_avg", "exp_avg_sq", "step")
    }
    assert deferred == parameters | moments  # no buffer (running_mean, num_batches_tracked...)
    gate.open()
    saver.close()


def test_a_frozen_parameter_the_optimizer_holds_is_copied_before_save_returns(
    tmp_path: Path, gate: Gate
) -> None:
    """A momentum encoder (MoCo's key encoder): frozen, held by the optimizer, changed by the
    next forward through ``.data``, which bumps no ``_version``; left to the background copy, the
    checkpoint silently held the value after that forward."""
    torch.manual_seed(0)
    encoder = nn.Linear(16, 3)  # frozen, changed by the forward
    model = nn.Sequential(nn.Linear(8, 16), encoder.requires_grad_(False), nn.Flatten(0))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state = train(state, n=2)
    saved_value = encoder.weight.detach().clone()
    saver = AsyncSaver()
    url = saver.save(state, str(tmp_path))
    assert gate.started.wait(WAIT)
    encoder.weight.data.mul_(0.5)  # as a momentum update in the next forward does
    gate.open()
    saver.close()
    loaded = torch.load(f"{url}/model.pt", weights_only=True)
    assert torch.equal(loaded["1.weight"], saved_value)


def test_the_next_update_waits_for_the_copy_and_forward_backward_do_not(
    tmp_path: Path, gate: Gate
) -> None:
    step = accumulate(make_train_step(mean_loss), 2)
    state = train(make_state(), step, n=4)
    at_save = snapshot(state)
    saver = AsyncSaver()
    url = saver.save(state, str(tmp_path))
    first, second = make_batches(2, seed=9)

    state, _ = step(state, first)  # a micro-batch: forward and backward run during the copy
    assert not gate.opened.is_set()
    thread, out = in_thread(lambda: step(state, second))  # closes the window: an update
    thread.join(0.5)
    assert thread.is_alive(), "the update did not wait for the background copy"
    assert_same(snapshot(state)["model"], at_save["model"])  # not updated yet
    gate.open()
    thread.join(WAIT)
    state, output = out["result"]
    assert output.did_update
    saver.close()
    assert not torch.equal(state.model.get_parameter("0.weight"), at_save["model"]["0.weight"])
    assert_same(snapshot(load(url, make_state(seed=3), step=step)), at_save)


def test_buffers_changed_by_the_next_forward_are_copied_before_save_returns(
    tmp_path: Path, gate: Gate
) -> None:
    step = make_train_step(mean_loss)
    state = train(batchnorm_state(), step, n=2)
    at_save = snapshot(state)
    saver = AsyncSaver()
    url = saver.save(state, str(tmp_path))
    state.model(make_batches(1, seed=4)[0][0])  # a training forward: new running statistics
    assert not torch.equal(
        state.model.get_buffer("1.running_mean"), at_save["model"]["1.running_mean"]
    )
    gate.open()
    saver.close()
    assert_same(snapshot(load(url, batchnorm_state()))["model"], at_save["model"])


def test_a_parameter_changed_in_place_during_the_copy_fails_the_checkpoint_loudly(
    tmp_path: Path, gate: Gate
) -> None:
    state = train(make_state(), n=2)
    before = save(state, str(tmp_path))
    saver = AsyncSaver()
    saver.save(state.replace(step=5), str(tmp_path))
    with torch.no_grad():
        state.model.get_parameter("0.weight").add_(1.0)  # e.g. a handler projecting the weights
    gate.open()
    with pytest.raises(CheckpointError) as raised:
        saver.wait()
    message = str(raised.value)
    assert "model.pt/0.weight" in message and "changed in place" in message
    assert "state.fence.wait()" in message and "nothing was committed" in message
    assert latest(str(tmp_path)) == before  # the torn copy was never committed
    saver.close()


def test_the_fence_lets_parameters_change_after_the_copy(tmp_path: Path, gate: Gate) -> None:
    state = train(make_state(), n=2)
    at_save = snapshot(state)
    with AsyncSaver() as saver:
        url = saver.save(state, str(tmp_path))
        thread, out = in_thread(state.fence.wait)
        thread.join(0.5)
        assert thread.is_alive(), "state.fence.wait() did not wait for the background copy"
        gate.open()
        thread.join(WAIT)
        assert "error" not in out
        with torch.no_grad():
            state.model.get_parameter("0.weight").mul_(0.0)
    assert_same(snapshot(load(url, make_state(seed=3))), at_save)


def test_load_waits_for_the_copy_of_what_it_overwrites(tmp_path: Path, gate: Gate) -> None:
    other = save(make_state(seed=5), str(tmp_path / "other"))
    state = train(make_state(), n=2)
    at_save = snapshot(state)
    with AsyncSaver() as saver:
        url = saver.save(state, str(tmp_path / "async"))
        thread, out = in_thread(lambda: load(other, state))
        thread.join(0.5)
        assert thread.is_alive(), "load did not wait for the background copy"
        gate.open()
        thread.join(WAIT)
        assert "error" not in out
    assert_same(snapshot(load(url, make_state(seed=3))), at_save)


def test_a_compiled_step_waits_for_the_copy_too(tmp_path: Path, gate: Gate) -> None:
    step = compile_step(make_train_step(mean_loss))
    gate.open()  # the first saves and updates compile: no gate while they do
    state = train(make_state(scheduler=False), step, n=3)
    gate.opened.clear()
    at_save = snapshot(state)
    saver = AsyncSaver()
    url = saver.save(state, str(tmp_path))
    thread, out = in_thread(lambda: step(state, make_batches(1, seed=9)[0]))
    thread.join(0.5)
    assert thread.is_alive(), "the compiled update did not wait for the background copy"
    gate.open()
    thread.join(WAIT)
    assert out["result"][1].did_update
    saver.close()
    assert_same(snapshot(load(url, make_state(seed=3, scheduler=False)))["model"], at_save["model"])


def test_two_savers_of_one_state_are_both_waited_for(tmp_path: Path, gate: Gate) -> None:
    step = make_train_step(mean_loss)
    state = train(make_state(), step, n=2)
    at_save = snapshot(state)
    with AsyncSaver() as first, AsyncSaver() as second:
        urls = [first.save(state, str(tmp_path / "a")), second.save(state, str(tmp_path / "b"))]
        thread, out = in_thread(lambda: step(state, make_batches(1, seed=9)[0]))
        thread.join(0.5)
        assert thread.is_alive(), "the update did not wait for the background copies"
        gate.open()
        thread.join(WAIT)
        assert "error" not in out
    for url in urls:  # neither copy was torn by the update
        assert_same(snapshot(load(url, make_state(seed=3))), at_save)


def test_the_fence_waits_for_every_copy_held_for_a_state_once() -> None:
    joined: list[str] = []

    class Copy:
        def __init__(self, name: str) -> None:
            self.name = name

        def join(self) -> None:
            joined.append(self.name)

    state, other = make_state(seed=1), make_state(seed=2)
    later = state.replace(step=5)  # a derived state shares its fence
    state.fence.hold(Copy("first saver"))
    later.fence.hold(Copy("second saver"))
    other.fence.hold(Copy("another state"))
    state.fence.wait()
    assert joined == ["first saver", "second saver"]
    later.fence.wait()  # waited for: gone
    assert joined == ["first saver", "second saver"]
    other.fence.wait()
    assert joined[-1] == "another state"

"""Async save: the background checkpoint equals a sync one taken at the same step, training
during the write is not corrupted, a second save waits, and errors surface later, never lost."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest
import torch

from steplib import Events, TrainState, make_train_step, run
from steplib.checkpoint import (
    AsyncSaver,
    CheckpointError,
    background,
    checkpoint_every,
    latest,
    list_checkpoints,
    load,
    save,
    storage,
)
from tests.checkpoint_helpers import assert_same, make_state, memory_dir, snapshot, train
from tests.reference import make_batches, mean_loss

__all__ = ["memory_dir"]


def _files(url: str) -> dict[str, Any]:
    """The manifest's file table: size and checksum of every file."""
    body = orjson.loads(fsspec.open(f"{url}/manifest.json").open().read())
    files: dict[str, Any] = body["files"]
    return files


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The first write of each checkpoint file stalls 100 ms (the event is set then)."""
    started = threading.Event()
    write = storage.ChecksumFile.write

    def slow_write(self: Any, data: Any) -> int:
        if self.size == 0:
            started.set()
            time.sleep(0.1)
        return write(self, data)

    monkeypatch.setattr(storage.ChecksumFile, "write", slow_write)
    return started


def test_async_checkpoint_equals_a_sync_one_at_the_same_step(tmp_path: Path) -> None:
    state = train(make_state(), n=3)
    sync_url = save(state, str(tmp_path / "sync"))
    with AsyncSaver() as saver:
        async_url = saver.save(state, str(tmp_path / "async"))
    # Byte for byte: same sizes and checksums of every file (the RNG states included).
    assert _files(async_url) == _files(sync_url)


def test_training_during_the_write_is_not_corrupted(
    memory_dir: str, slow_disk: threading.Event
) -> None:
    step = make_train_step(mean_loss)
    state = train(make_state(dropout=0.2), step, n=3)
    at_save = snapshot(state)
    untouched = train(train(make_state(dropout=0.2), step, n=3), step, n=4, seed=5)
    reference = snapshot(untouched)

    state = train(make_state(dropout=0.2), step, n=3)
    saver = AsyncSaver()
    url = saver.save(state, memory_dir)
    assert slow_disk.wait(5)
    state = train(state, step, n=4, seed=5)  # the parameters change under the writer
    assert saver.pending  # ... and the write really was still going on
    saver.close()

    assert_same(snapshot(load(url, make_state(seed=3, dropout=0.2))), at_save)
    # Training itself was not disturbed by the snapshot or the writer (the RNG either: dropout).
    state = train(make_state(dropout=0.2), step, n=3)
    with AsyncSaver() as saver:
        saver.save(state, f"{memory_dir}/again")
        state = train(state, step, n=4, seed=5)
    assert_same(snapshot(state)["model"], reference["model"])


def test_a_second_save_waits_for_the_first(memory_dir: str, slow_disk: threading.Event) -> None:
    state = make_state()
    with AsyncSaver() as saver:
        first = saver.save(state, memory_dir)
        saver.save(state.replace(step=1), memory_dir)
        # The first is committed by the time the second call returned.
        assert [c.url for c in list_checkpoints(memory_dir)][:1] == [first]
    assert len(list_checkpoints(memory_dir)) == 2


def test_background_error_surfaces_at_the_next_save_and_is_not_lost(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    state = make_state()
    saver = AsyncSaver()
    saver.save(state, str(blocker / "ckpt"))  # fails in the background
    with pytest.raises(CheckpointError, match=r"could not write .*a-file/ckpt/step-00000000"):
        saver.save(state, str(tmp_path / "good"))
    assert latest(str(tmp_path / "good")) is None  # that call raised before saving
    url = saver.save(state, str(tmp_path / "good"))  # the error was reported once
    saver.close()
    assert latest(str(tmp_path / "good")) == url


def test_background_error_surfaces_at_the_end_of_the_run(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"

    def break_the_directory(event: object) -> None:
        # After the start's check: the directory becomes a file, so the save at 2 fails.
        shutil.rmtree(directory, ignore_errors=True)
        directory.write_text("not a directory")

    step = make_train_step(mean_loss)
    events = checkpoint_every(str(directory), every=2, background=True).attach(Events())
    events.on("step_end", lambda e: break_the_directory(e) if e.step == 1 else None)
    with pytest.raises(CheckpointError, match=r"could not write"):
        run(step, make_state(), make_batches(3), events=events)


@pytest.mark.parametrize("background", [False, True])
def test_a_directory_that_cannot_be_written_fails_before_the_first_update(
    tmp_path: Path, background: bool
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    updates: list[int] = []
    step = make_train_step(mean_loss)
    events = checkpoint_every(str(blocker / "ckpt"), every=2, background=background).attach(
        Events()
    )
    events.on("step_end", lambda e: updates.append(e.step))
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints into .*a-file/ckpt"):
        run(step, make_state(), make_batches(5), events=events)
    assert updates == []  # not after the first save (or, in the background, the second)


def test_background_checkpoint_every_writes_what_a_sync_one_writes(tmp_path: Path) -> None:
    step = make_train_step(mean_loss)
    found = {}
    for mode in ("sync", "background"):
        directory = str(tmp_path / mode)
        events = checkpoint_every(
            directory, every=2, keep_last=2, background=mode == "background", metrics=lambda e: {}
        ).attach(Events())
        run(step, make_state(dropout=0.2), make_batches(5), events=events)
        found[mode] = [(c.name, _files(c.url)) for c in list_checkpoints(directory)]
    assert [name for name, _ in found["sync"]] == ["step-00000004", "step-00000005"]
    assert found["background"] == found["sync"]


def test_snapshot_buffers_are_reused_and_the_second_checkpoint_has_the_new_values(
    memory_dir: str, slow_disk: threading.Event
) -> None:
    step = make_train_step(mean_loss)
    state = train(make_state(), step, n=2)
    at_first = snapshot(state)
    with AsyncSaver() as saver:
        first = saver.save(state, f"{memory_dir}/a")
        buffers = dict(saver._buffers)
        state = train(state, step, n=2, seed=7)  # in place: the same tensors, new values
        at_second = snapshot(state)
        assert saver.pending  # the first is still being written from those buffers ...
        second = saver.save(state, f"{memory_dir}/b")  # ... so this waits before copying
        reused = [path for path, buffer in saver._buffers.items() if buffers.get(path) is buffer]
        assert len(reused) == len(buffers) > 0  # no buffer allocated for the second save
    assert not torch.equal(at_first["model"]["0.weight"], at_second["model"]["0.weight"])
    assert_same(snapshot(load(first, make_state(seed=3))), at_first)
    assert_same(snapshot(load(second, make_state(seed=3))), at_second)


def test_the_snapshot_holds_every_kind_of_tensor_as_it_was_at_save_time() -> None:
    """The snapshot (plain ``copy_`` into reused buffers; the chunked copy engine is gone)
    equals the tensors at save time, whatever their layout, and keeps them when they change."""
    torch.manual_seed(0)
    sources = [
        torch.randn(1000),
        torch.randn(7, 5).t(),  # not contiguous
        torch.randn(300).to(torch.bfloat16),
        torch.randint(0, 255, (513,), dtype=torch.uint8),
        torch.empty(0),
        torch.tensor(3.5),
        torch.randn(4, 4)[1:3],  # a view with a storage offset
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate: copy_ resolves it
    ]
    expected = [s.resolve_conj().clone() for s in sources]
    buffers: dict[Any, torch.Tensor] = {}
    for _ in range(2):  # the second snapshot reuses the first one's buffers
        copied, waits = background.snapshot(list(sources), buffers, deferred=set())
        assert not waits  # CPU tensors not deferred: copied before snapshot returns
        for source in sources:
            source.zero_()
        for buffer, value in zip(copied, expected, strict=True):
            assert torch.equal(buffer.resolve_conj(), value)
        sources = [e.clone() for e in expected]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice is Linux's")
def test_the_writer_runs_in_its_own_thread_and_training_keeps_its_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: list[tuple[str, int]] = []
    write = storage.write_tensors

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((threading.current_thread().name, priority()))
        return write(*args, **kwargs)

    monkeypatch.setattr(storage, "write_tensors", spy)
    training = priority()
    with AsyncSaver() as saver:
        saver.save(make_state(), str(tmp_path))
    assert seen and {name.split("-")[1] for name, _ in seen} == {"save"}  # the writer thread
    assert priority() == training


def _multistep_state() -> tuple[TrainState, torch.optim.lr_scheduler.MultiStepLR]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 3], gamma=0.1)
    return TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler), scheduler


def test_an_async_save_keeps_a_counter_as_it_is(tmp_path: Path) -> None:
    # MultiStepLR keeps its milestones in a collections.Counter (a milestone given twice decays
    # twice). The snapshot copied a dict by update(), which a Counter adds: every milestone
    # was counted twice, and the resumed rate fell 100-fold at each (1, 1, 0.01, 1e-4, not
    # 1, 1, 0.1, 0.01).
    state, _ = _multistep_state()
    with AsyncSaver() as saver:
        url = saver.save(state, str(tmp_path))
    resumed, scheduler = _multistep_state()
    load(url, resumed)
    rates = []
    for _ in range(4):
        rates.append(scheduler.get_last_lr()[0])
        resumed.optimizer.step()
        scheduler.step()
    assert scheduler.milestones == {2: 1, 3: 1}
    assert rates == pytest.approx([1.0, 1.0, 0.1, 0.01])

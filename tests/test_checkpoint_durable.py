"""``durable=False``: no fsync of files or directories, and nothing else changes: the same
bytes, the same atomic commit, the same checksums, so that what a power loss can do to a
checkpoint the kernel had not yet written back is detected and skipped."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from steplib import ConfigError, Events, make_train_step, run
from steplib.checkpoint import (
    AsyncSaver,
    CheckpointWarning,
    checkpoint_every,
    latest,
    list_checkpoints,
    load,
    resume_from,
    save,
    storage,
)
from steplib.checkpoint import storage as storage_module
from steplib.testing import run_ranks
from tests.checkpoint_helpers import assert_same, make_state, snapshot, train
from tests.reference import make_batches, mean_loss


def _files(url: str) -> dict[str, Any]:
    files: dict[str, Any] = orjson.loads(Path(url, "manifest.json").read_bytes())["files"]
    return files


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the calls of ``os.fsync``, ``os.fdatasync`` and ``os.sync`` (still made)."""
    calls: Counter[str] = Counter()
    for name in ("fsync", "fdatasync", "sync"):
        real = getattr(os, name, None)
        if real is None:
            continue

        def counted(*args: Any, _name: str = name, _real: Any = real) -> Any:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(os, name, counted)
    yield calls


def _save_with(how: str, directory: str, *, durable: bool) -> str:
    """A checkpoint of a trained state written by one of the ways to save."""
    state = train(make_state(), n=3)
    if how == "save":
        return save(state, directory, durable=durable)
    if how == "AsyncSaver":
        with AsyncSaver() as saver:
            return saver.save(state, directory, durable=durable)
    events = checkpoint_every(
        directory, every=2, background=how == "checkpoint_every(background)", durable=durable
    ).attach(Events())
    run(make_train_step(mean_loss), make_state(), make_batches(3), events=events)
    found = latest(directory)
    assert found is not None
    return found


HOW = ["save", "AsyncSaver", "checkpoint_every", "checkpoint_every(background)"]


@pytest.mark.parametrize("how", HOW)
def test_durable_saves_fsync_and_durable_false_saves_do_not(
    tmp_path: Path, syncs: Counter[str], how: str
) -> None:
    _save_with(how, str(tmp_path / "durable"), durable=True)
    # Every file (3 + the manifest) and both directories (staging, then the parent).
    assert syncs["fsync"] + syncs["fdatasync"] >= 6, dict(syncs)
    syncs.clear()
    url = _save_with(how, str(tmp_path / "fast"), durable=False)
    assert sum(syncs.values()) == 0, dict(syncs)
    assert latest(str(tmp_path / "fast")) == url  # committed and verified


def test_durable_false_round_trips_bit_exactly_and_writes_the_same_bytes(tmp_path: Path) -> None:
    state = train(make_state(scaler=True, dropout=0.2), n=3)
    at_save = snapshot(state)
    durable = save(state, str(tmp_path / "durable"))
    fast = save(state, str(tmp_path / "fast"), durable=False)
    assert _files(fast) == _files(durable)  # same sizes and checksums of every file

    train(state, n=2, seed=4)  # move on, then come back
    loaded = load(fast, make_state(seed=5, scaler=True, dropout=0.2))
    assert_same(snapshot(loaded), at_save)


class _Died(BaseException):
    """Stands for the process dying: nothing after it runs, nothing is cleaned up."""


def _die_while_writing_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    write = storage.ChecksumFile.write

    def dies_half_way(self: Any, data: Any) -> int:
        if self.size > 0:
            raise _Died
        return write(self, data)

    monkeypatch.setattr(storage.ChecksumFile, "write", dies_half_way)


def _die_before_the_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(*args: Any, **kwargs: Any) -> Any:
        raise _Died

    monkeypatch.setattr(storage_module, "commit", dies)


@pytest.mark.parametrize(
    "die", [_die_while_writing_a_file, _die_before_the_rename], ids=["mid-file", "pre-rename"]
)
def test_durable_false_is_still_atomic_when_the_process_dies_mid_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, die: Any
) -> None:
    directory = str(tmp_path / "ckpt")
    state = train(make_state(), n=2)
    first = save(state, directory, durable=False)
    at_first = snapshot(state)

    die(monkeypatch)
    # torch.save's zip writer turns the death inside it into a RuntimeError.
    with pytest.raises((_Died, RuntimeError)):
        save(train(state, n=1), directory, durable=False)
    monkeypatch.undo()

    # A staging directory is left (nothing cleaned up after a death), and is invisible.
    assert any(name.startswith(".tmp-") for name in os.listdir(directory))
    assert [c.url for c in list_checkpoints(directory)] == [first]
    assert latest(directory) == first
    assert_same(snapshot(load(first, make_state(seed=3))), at_first)


@contextlib.contextmanager
def _warns(expected: bool) -> Iterator[None]:
    """A CheckpointWarning is expected, or none may be raised."""
    if expected:
        with pytest.warns(CheckpointWarning):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            # The batches are a list, started over on purpose (resume_from says so).
            warnings.filterwarnings("ignore", "resume_from: .* no state_dict", CheckpointWarning)
            yield


def _lose_the_rename(newest: Path) -> None:
    shutil.rmtree(newest)


def _zero_the_files(newest: Path) -> None:
    # ext4 and xfs can commit a rename before the data of the files it moved: after the
    # crash the files exist with their final names, empty or filled with zeros.
    for path in newest.iterdir():
        if path.name != "manifest.json":
            path.write_bytes(b"\0" * path.stat().st_size)


def _truncate_the_files(newest: Path) -> None:
    for path in newest.iterdir():
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize(
    "power_loss",
    [_lose_the_rename, _zero_the_files, _truncate_the_files],
    ids=["rename lost", "data zeroed", "files truncated"],
)
def test_what_a_power_loss_can_do_to_a_non_durable_checkpoint_is_detected_and_skipped(
    tmp_path: Path, power_loss: Any
) -> None:
    directory = str(tmp_path / "ckpt")
    step = make_train_step(mean_loss)
    state = train(make_state(), step, n=2)
    older = save(state, directory, durable=False)
    at_older = snapshot(state)
    newest = save(train(state, step, n=1), directory, durable=False)

    power_loss(Path(newest))

    # A lost rename leaves nothing to warn about; damaged files are named in a warning.
    warns = power_loss is not _lose_the_rename
    with _warns(warns):
        assert latest(directory) == older
    resumed = Events().on("fit_start", resume_from(directory))
    with _warns(warns):
        # max_steps=2: the older checkpoint's step, so the run resumes and stops at once.
        state = run(step, make_state(seed=3), make_batches(2), events=resumed, max_steps=2)
    assert_same(snapshot(state), at_older)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_durable_that_is_not_a_bool_is_refused_with_the_fix(tmp_path: Path, value: Any) -> None:
    state = make_state()
    directory = str(tmp_path / "ckpt")
    for call in (
        lambda: save(state, directory, durable=value),
        lambda: AsyncSaver().save(state, directory, durable=value),
        lambda: checkpoint_every(directory, every=10, durable=value),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert f"durable=...) received {value!r}" in message
        assert "must be True or False" in message and "durable=False" in message
    assert not os.path.exists(directory)  # refused before anything was written


def _sharded_syncs(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """On each rank: a DDP state saved (sharded) durably and not, by ``save`` and by an
    ``AsyncSaver``, counting the fsyncs; then the non-durable one loaded back."""
    from tests import sharded_runs

    state, step, loader = sharded_runs.build("ddp", rank)
    state, _ = sharded_runs.train(state, step, loader)
    want = sharded_runs.contents(state)
    calls: Counter[str] = Counter()
    real = os.fsync, os.fdatasync

    def fsync(fd: Any) -> None:
        calls["sync"] += 1
        real[0](fd)

    def fdatasync(fd: Any) -> None:
        calls["sync"] += 1
        real[1](fd)

    os.fsync, os.fdatasync = fsync, fdatasync  # a forked rank: the patch dies with it
    counts = {}
    urls = {}
    with AsyncSaver() as saver:
        for durable in (True, False):
            for how in ("save", "async"):
                calls.clear()
                directory = f"{root}/{how}-{durable}"
                if how == "save":
                    urls[how, durable] = save(state, directory, step=step, durable=durable)
                else:
                    urls[how, durable] = saver.save(state, directory, step=step, durable=durable)
                    saver.wait()
                counts[f"{how} durable={durable}"] = calls["sync"]
    fresh, _, _ = sharded_runs.build("ddp", rank, seed=3)
    got = sharded_runs.contents(load(urls["async", False], fresh, step=step))
    result = {"counts": counts, "same": _equal(got, want), "latest": latest(f"{root}/save-False")}
    del state, step, loader, fresh
    return result


def _equal(got: Any, want: Any) -> bool:
    try:
        assert_same(got, want)
    except AssertionError:
        return False
    return True


def test_sharded_saves_pass_durable_through_to_every_rank(tmp_path: Path) -> None:
    results = run_ranks(functools.partial(_sharded_syncs, root=str(tmp_path)), timeout=90)
    for rank, result in enumerate(results):
        counts = result["counts"]
        assert counts["save durable=True"] > 0 and counts["async durable=True"] > 0, counts
        assert counts["save durable=False"] == 0 and counts["async durable=False"] == 0, counts
        assert result["same"], f"rank {rank}: the non-durable checkpoint did not round-trip"
        assert result["latest"] is not None and result["latest"].endswith("step-00000006")

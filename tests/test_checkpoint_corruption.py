"""Corruption: a truncated file, a flipped byte, a deleted or altered manifest, a missing file:
each detected, named, and skipped by ``latest`` and ``resume_from`` (which say so)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fsspec
import orjson
import pytest
import torch
import xxhash

from steplib import Event, TrainState
from steplib.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    latest,
    list_checkpoints,
    load,
    resume_from,
    save,
)
from tests.checkpoint_helpers import assert_same, make_state, memory_dir, snapshot, train

__all__ = ["memory_dir"]


def _three_checkpoints(directory: str) -> list[str]:
    state = make_state()
    urls = []
    for _ in range(3):
        state = train(state, n=1)
        urls.append(save(state, directory))
    return urls


def _truncate(fs: fsspec.AbstractFileSystem, path: str) -> None:
    data = fs.cat_file(path)
    fs.pipe_file(path, data[: len(data) // 2])


def _flip_byte(fs: fsspec.AbstractFileSystem, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    fs.pipe_file(path, bytes(data))


def _alter_manifest(fs: fsspec.AbstractFileSystem, path: str) -> None:
    text = fs.cat_file(path).decode()
    fs.pipe_file(path, text.replace('"step": 3', '"step": 30').encode())


def _delete(fs: fsspec.AbstractFileSystem, path: str) -> None:
    fs.rm(path)


DAMAGE: dict[str, tuple[str, Callable[[fsspec.AbstractFileSystem, str], None], str]] = {
    # name: (file, damage, what the error says)
    "truncated model.pt": ("model.pt", _truncate, r"model\.pt has \d+ bytes, the manifest says"),
    "flipped byte in optimizer.pt": (
        "optimizer.pt",
        _flip_byte,
        r"optimizer\.pt has checksum xxh3_64",
    ),
    "altered manifest.json": ("manifest.json", _alter_manifest, r"manifest\.json cannot be read"),
    "deleted train_state.pt": ("train_state.pt", _delete, r"train_state\.pt is missing"),
}


@pytest.fixture(params=["local", "memory"])
def directory(request: pytest.FixtureRequest, tmp_path: Path, memory_dir: str) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else memory_dir


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_corrupt_file_is_detected_named_and_skipped(directory: str, damage: str) -> None:
    file_name, harm, message = DAMAGE[damage]
    urls = _three_checkpoints(directory)
    fs, path = fsspec.core.url_to_fs(f"{urls[-1]}/{file_name}")
    harm(fs, path)

    target = make_state(seed=7)
    before = snapshot(target)
    with pytest.raises(CorruptCheckpointError, match=message):
        load(urls[-1], target)
    assert_same(snapshot(target), before)  # verified before anything was changed

    with pytest.warns(CheckpointWarning, match=rf"{file_name}.*falling back"):
        assert latest(directory) == urls[-2]
    resume = resume_from(directory)
    with pytest.warns(CheckpointWarning, match=file_name):
        new = resume(Event("fit_start", make_state()))
    assert resume.loaded == urls[-2]
    assert new is not None and new.state.step == 2


def test_deleted_manifest_means_the_checkpoint_does_not_exist(directory: str) -> None:
    urls = _three_checkpoints(directory)
    fs, path = fsspec.core.url_to_fs(f"{urls[-1]}/manifest.json")
    fs.rm(path)
    assert latest(directory) == urls[-2]  # silently: an uncommitted save is not an error
    assert [c.url for c in list_checkpoints(directory)] == urls[:2]
    with pytest.raises(CheckpointError, match=r"no checkpoint \(no manifest.json\)"):
        load(urls[-1], make_state())


def test_every_checkpoint_corrupt_refuses_to_start_over(directory: str) -> None:
    urls = _three_checkpoints(directory)
    for url in urls:
        fs, path = fsspec.core.url_to_fs(f"{url}/model.pt")
        _flip_byte(fs, path)
    with pytest.warns(CheckpointWarning):
        assert latest(directory) is None
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(CorruptCheckpointError, match=r"every checkpoint .* is corrupt"),
    ):
        resume_from(directory)(Event("fit_start", make_state()))


def test_latest_without_verify_only_reads_the_manifest(directory: str) -> None:
    urls = _three_checkpoints(directory)
    fs, path = fsspec.core.url_to_fs(f"{urls[-1]}/model.pt")
    _flip_byte(fs, path)
    assert latest(directory, verify=False) == urls[-1]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_large_tensors_checksummed_beside_the_write_match_the_file(
    tmp_path: Path, memory_dir: str, where: str
) -> None:
    """Tensors of 1 MiB and more are checksummed by a helper thread while the bytes are being
    written; the checksum recorded must still be the whole file's, and a flipped byte in such a
    tensor's bytes must be caught."""
    directory = str(tmp_path) if where == "local" else memory_dir
    model = torch.nn.Sequential(torch.nn.Linear(1024, 600), torch.nn.Linear(600, 3))
    weight = model.get_parameter("0.weight")
    assert weight.numel() * 4 >= 2 << 20  # large writes (a helper thread checksummed them once)
    state = TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    url = save(state, directory)
    fs, root = fsspec.core.url_to_fs(url)
    files = orjson.loads(fs.cat_file(f"{root}/manifest.json"))["files"]
    for name, record in files.items():
        data = fs.cat_file(f"{root}/{name}")
        assert (len(data), xxhash.xxh3_64_hexdigest(data)) == (record["bytes"], record["xxh3_64"])
    assert_same(snapshot(load(url, state)), snapshot(state))
    _flip_byte(fs, f"{root}/model.pt")  # the middle of model.pt: the big weight's bytes
    with pytest.raises(CorruptCheckpointError, match=r"model\.pt has checksum xxh3_64"):
        load(url, state)

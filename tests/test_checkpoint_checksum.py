"""Checkpoint checksums: XXH3-64 (``xxhash``) of every file, checked before anything loads."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import fsspec
import orjson
import pytest
import xxhash

from steplib.checkpoint import (
    CheckpointWarning,
    CorruptCheckpointError,
    latest,
    load,
    load_weights,
    save,
    storage,
)
from tests.checkpoint_helpers import make_state, memory_dir, train

__all__ = ["memory_dir"]


@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 64 * 1024 + 17])
def test_file_digest_in_chunks_equals_the_digest_of_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(storage, "CHUNK_BYTES", 4096)  # several chunks for these small files
    data = os.urandom(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    assert storage.file_digest(str(path)) == xxhash.xxh3_64_hexdigest(data)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_detected_and_named(tmp_path: Path) -> None:
    state = train(make_state(), n=1)
    url = save(state, str(tmp_path))
    _flip_byte(Path(url) / "optimizer.pt")
    with pytest.raises(
        CorruptCheckpointError, match=r"its file optimizer\.pt has checksum xxh3_64 [0-9a-f]{16}"
    ):
        load(url, make_state())


def test_a_truncated_file_is_detected_and_named(tmp_path: Path) -> None:
    url = save(train(make_state(), n=1), str(tmp_path))
    path = Path(url) / "model.pt"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError, match=r"its file model\.pt has \d+ bytes"):
        load(url, make_state())


def test_a_file_grown_after_the_commit_is_not_called_truncated_only(tmp_path: Path) -> None:
    url = save(train(make_state(), n=1), str(tmp_path))
    path = Path(url) / "model.pt"
    path.write_bytes(path.read_bytes() + b"appended")
    with pytest.raises(CorruptCheckpointError, match=r"model\.pt has \d+ bytes.*or overwritten"):
        load(url, make_state())


def _rewrite_manifest(url: str, **changes: object) -> None:
    """Change a committed manifest's fields, its own CRC32 made to match (only the change
    can be why a load refuses it)."""
    path = Path(url) / "manifest.json"
    body = orjson.loads(path.read_bytes())
    del body["manifest_crc32"]
    body.update(changes)
    body["manifest_crc32"] = f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"
    path.write_bytes(orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2))


def test_a_flipped_byte_in_an_object_store_is_detected_and_named(memory_dir: str) -> None:
    """Not a local file: read whole once and checked before torch.load sees it."""
    url = save(train(make_state(), n=1), memory_dir)
    fs, root = fsspec.filesystem("memory"), url.removeprefix("memory://")
    data = bytearray(fs.cat_file(f"{root}/train_state.pt"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{root}/train_state.pt", bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"train_state\.pt has checksum xxh3_64"):
        load(url, make_state())


@pytest.mark.parametrize("version", [1, 3, 4])  # steplib 0.1's; 0.2's development formats
def test_an_older_format_is_refused_with_how_to_use_it(tmp_path: Path, version: int) -> None:
    url = save(train(make_state(), n=1), str(tmp_path))
    files = orjson.loads((Path(url) / "manifest.json").read_bytes())["files"]
    crc32 = {n: {"bytes": e["bytes"], "crc32": "00000000"} for n, e in files.items()}
    _rewrite_manifest(url, version=version, files=crc32 if version == 1 else files)
    expected = (
        rf"format version {version} was written by an earlier steplib.*resume it with that "
        rf"steplib, or start from the weights of a single-process one: "
        rf"load_weights\(model, '{url}/model\.pt'\)"
    )
    with pytest.raises(CorruptCheckpointError, match=expected):
        load(url, make_state())
    with pytest.warns(CheckpointWarning, match=expected):
        assert latest(str(tmp_path)) is None
    assert load_weights(make_state().model, f"{url}/model.pt") == ([], [])  # the way out works


def test_a_newer_format_says_upgrade(tmp_path: Path) -> None:
    url = save(make_state(), str(tmp_path))
    _rewrite_manifest(url, version=6)
    with pytest.raises(CorruptCheckpointError, match=r"format version 6 is newer .*upgrade"):
        load(url, make_state())

"""Checkpoint checksums: XXH3 (``xxhash``) for new files, CRC32 still verified in old ones."""

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
    save,
    storage,
)
from tests.checkpoint_helpers import assert_same, make_state, memory_dir, snapshot, train

__all__ = ["memory_dir"]


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 64 * 1024 + 17])
def test_file_digest_in_chunks_equals_the_digest_of_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, size: int
) -> None:
    monkeypatch.setattr(storage, "CHUNK_BYTES", 4096)  # several chunks for these small files
    data = os.urandom(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    whole = xxhash.xxh3_64_hexdigest(data) if algorithm == "xxh3_64" else f"{zlib.crc32(data):08x}"
    assert storage.file_digest(str(path), size, algorithm) == (whole, size)
    assert storage.digest(data, algorithm) == whole


def test_a_file_shorter_than_expected_reports_what_was_read(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(os.urandom(900))
    _, read = storage.file_digest(str(path), 1000)  # truncated after its size was read
    assert read == 900


def test_an_unknown_algorithm_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown checksum algorithm 'md5'; known: xxh3_64"):
        storage.hasher("md5")


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


def _as_written_before_0_2(url: str) -> None:
    """Rewrite a checkpoint's manifest as steplib 0.1 wrote it: format 1, the ``crc32`` of
    every file (zlib, 8 hex digits), the manifest's own CRC32 of its body with keys sorted."""
    root = Path(url)
    body = orjson.loads((root / "manifest.json").read_bytes())
    del body["manifest_crc32"]
    body["version"] = 1
    body["files"] = {
        name: {"bytes": entry["bytes"], "crc32": f"{zlib.crc32((root / name).read_bytes()):08x}"}
        for name, entry in body["files"].items()
    }
    body["manifest_crc32"] = f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"
    (root / "manifest.json").write_bytes(
        orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
    )


def test_an_old_checkpoint_with_crc32_still_loads_verified(tmp_path: Path) -> None:
    state = train(make_state(), n=2)
    url = save(state, str(tmp_path))
    _as_written_before_0_2(url)
    assert "xxh3_64" not in (Path(url) / "manifest.json").read_text()

    assert_same(snapshot(load(url, make_state())), snapshot(state))
    assert latest(str(tmp_path)) == url  # verified: every file's CRC32 matches

    _flip_byte(Path(url) / "model.pt")
    with pytest.raises(
        CorruptCheckpointError, match=r"its file model\.pt has checksum crc32 [0-9a-f]{8}"
    ):
        load(url, make_state())
    with pytest.warns(CheckpointWarning, match=r"model\.pt has checksum crc32"):
        assert latest(str(tmp_path)) is None


def test_an_old_checkpoint_in_memory_is_verified_too(memory_dir: str) -> None:
    """Not a local file: read whole and checked against its CRC32."""
    state = train(make_state(), n=1)
    url = save(state, memory_dir)
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    body = orjson.loads(fs.cat_file(f"{root}/manifest.json"))
    del body["manifest_crc32"]
    body["version"] = 1
    body["files"] = {
        name: {"bytes": e["bytes"], "crc32": f"{zlib.crc32(fs.cat_file(f'{root}/{name}')):08x}"}
        for name, e in body["files"].items()
    }
    body["manifest_crc32"] = f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"
    fs.pipe_file(f"{root}/manifest.json", orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
    assert_same(snapshot(load(url, make_state())), snapshot(state))
    data = bytearray(fs.cat_file(f"{root}/train_state.pt"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{root}/train_state.pt", bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"train_state\.pt has checksum crc32"):
        load(url, make_state())


def test_a_checksum_this_steplib_does_not_know_says_upgrade(tmp_path: Path) -> None:
    url = save(make_state(), str(tmp_path))
    root = Path(url)
    body = orjson.loads((root / "manifest.json").read_bytes())
    del body["manifest_crc32"]
    body["files"] = {n: {"bytes": e["bytes"], "blake9": "00"} for n, e in body["files"].items()}
    body["manifest_crc32"] = f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"
    (root / "manifest.json").write_bytes(orjson.dumps(body))
    with pytest.raises(CorruptCheckpointError, match=r"no checksum this steplib knows.*upgrade"):
        load(url, make_state())

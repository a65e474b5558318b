"""The multi-threaded CRC32 a load verifies files with: equal to zlib's over the whole file."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

from steplib.checkpoint import crc


def test_crc32_combine_equals_the_crc_of_the_concatenation() -> None:
    rng = random.Random(0)
    lengths = [0, 1, 2, 3, 4, 7, 8, 255, 256, 1000, 4097]
    for _ in range(100):
        a = rng.randbytes(rng.choice(lengths))
        b = rng.randbytes(rng.choice(lengths))
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
@pytest.mark.parametrize("size", [0, 1, 1000, 64 * 1024 + 17])
def test_file_crc32_in_ranges_equals_zlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, size: int
) -> None:
    # Small ranges and chunks, so that these small files are cut into several of each.
    monkeypatch.setattr(crc, "MIN_RANGE_BYTES", 100)
    monkeypatch.setattr(crc, "CHUNK_BYTES", 4096)
    data = os.urandom(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    assert crc.file_crc32(str(path), size, workers=workers) == (zlib.crc32(data), size)


def test_a_file_shorter_than_expected_reports_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(crc, "MIN_RANGE_BYTES", 100)
    path = tmp_path / "file"
    path.write_bytes(os.urandom(900))
    _, read = crc.file_crc32(str(path), 1000, workers=4)  # truncated after its size was read
    assert read == 900

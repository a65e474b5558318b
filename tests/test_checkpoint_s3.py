"""The same checkpoints against a real S3-protocol server (moto's, on 127.0.0.1, started and
stopped by this module): round trip, commit by manifest, corruption, retention, async, resume.

Needs the ``s3`` extra (s3fs) and moto's server (``pip install 'moto[server]'``, in ``dev``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from steplib import Events, make_train_step, run
from steplib.checkpoint import (
    CheckpointWarning,
    CorruptCheckpointError,
    checkpoint_every,
    latest,
    list_checkpoints,
    load,
    resume_from,
    save,
)
from steplib.data import resumable_loader
from tests.checkpoint_helpers import assert_same, make_state, snapshot, train
from tests.reference import make_batches, mean_loss

pytestmark = pytest.mark.slow  # a server process; runs in CI like every other test


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """storage_options for a fresh moto server on 127.0.0.1 with one bucket."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                # moto loads its backends on the first request: a slow first answer is normal.
                urllib.request.urlopen(endpoint, timeout=10).close()
                break
            except OSError:  # refused (not listening yet), reset, or timed out: ask again
                assert server.poll() is None, "moto_server exited at start"
                assert time.monotonic() < deadline, "moto_server did not answer in 60 s"
                time.sleep(0.2)
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        fsspec.filesystem("s3", **options).mkdir("steplib-test")  # no region: moto's default
        yield options
    finally:
        server.terminate()  # by its PID, the one this fixture started
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


@pytest.fixture
def bucket_dir() -> str:
    return f"s3://steplib-test/{uuid.uuid4().hex}/ckpt"


def test_s3_round_trip(s3: dict[str, Any], bucket_dir: str) -> None:
    state = train(make_state(extras={"note": "s3"}))
    want = snapshot(state)
    url = save(state, bucket_dir, storage_options=s3, metrics={"val": 0.5})
    assert url == f"{bucket_dir}/step-00000003"
    assert latest(bucket_dir, storage_options=s3) == url
    (info,) = list_checkpoints(bucket_dir, storage_options=s3)
    assert info.metrics == {"val": 0.5}
    loaded = load(url, make_state(seed=4), storage_options=s3)
    assert_same(snapshot(loaded), want)
    assert loaded.extras["note"] == "s3"


def test_s3_checkpoint_without_manifest_does_not_exist(s3: dict[str, Any], bucket_dir: str) -> None:
    url = save(make_state(), bucket_dir, storage_options=s3)
    fs = fsspec.filesystem("s3", **s3)
    # A crash after the data files, before the manifest: what an interrupted save leaves.
    fs.pipe_file(f"{bucket_dir.removeprefix('s3://')}/step-00000005/model.pt", b"partial")
    assert latest(bucket_dir, storage_options=s3) == url


def test_s3_corrupt_file_is_detected_and_skipped(s3: dict[str, Any], bucket_dir: str) -> None:
    first = save(make_state(), bucket_dir, storage_options=s3)
    second = save(train(make_state(), n=1), bucket_dir, storage_options=s3)
    fs = fsspec.filesystem("s3", **s3)
    path = f"{second.removeprefix('s3://')}/optimizer.pt"
    data = bytearray(fs.cat_file(path))
    data[-100] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.pt"):
        load(second, make_state(), storage_options=s3)
    with pytest.warns(CheckpointWarning, match=r"optimizer\.pt"):
        assert latest(bucket_dir, storage_options=s3) == first


def test_s3_checkpoint_every_in_background_then_resume(s3: dict[str, Any], bucket_dir: str) -> None:
    step = make_train_step(mean_loss)
    batches = make_batches(7)
    loader = resumable_loader(batches, batch_size=None, shuffle=True, seed=0)
    events = checkpoint_every(
        bucket_dir,
        every=2,
        keep_last=2,
        background=True,
        data=loader,
        storage_options=s3,
    ).attach(Events())
    full = run(step, make_state(dropout=0.1), loader, events=events, max_steps=6)
    assert [c.step for c in list_checkpoints(bucket_dir, storage_options=s3)] == [4, 6]
    fs = fsspec.filesystem("s3", **s3)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket_dir.removeprefix('s3://')}/step-00000002/model.pt")

    loader = resumable_loader(batches, batch_size=None, shuffle=True, seed=0)
    resume = resume_from(bucket_dir, data=loader, storage_options=s3)
    resumed = run(
        step,
        make_state(seed=9, dropout=0.1),
        loader,
        events=Events().on("fit_start", resume),
        max_steps=6,
    )
    assert resume.loaded == f"{bucket_dir}/step-00000006"
    assert_same(snapshot(resumed), snapshot(full))
    assert os.environ.get("AWS_ENDPOINT_URL") is None  # nothing leaked into the environment

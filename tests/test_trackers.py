"""W&B and MLflow sinks, for real and offline: each tracker's own reader sees the logged values.

W&B runs in offline mode (its service process writes a ``.wandb`` file in a temporary
directory); MLflow writes to a file store in a temporary directory. A guard makes any socket
from this process to anything but the loopback interface or a Unix socket fail the test, and
both trackers' telemetry and network paths are switched off by their environment variables.
Each test is skipped only when its package is not installed.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import socket
import struct
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from steplib import ConfigError, Events, TrainState, accumulate, clip, make_train_step, run
from steplib.handlers import Log, Logger, LogWriteError, MLflowLogger, WandbLogger


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse connections from this process to anything but loopback or a Unix socket."""
    original = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family != socket.AF_UNIX:
            host = address[0]
            if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
                raise AssertionError(f"a tracker tried to reach the network: {address!r}")
        return original(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def wandb(monkeypatch: pytest.MonkeyPatch, no_network: None, tmp_path: Path) -> Any:
    # Set before wandb reads its settings: offline, quiet, nothing from the user's config.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return pytest.importorskip("wandb")


@pytest.fixture
def mlflow_uri(monkeypatch: pytest.MonkeyPatch, no_network: None, tmp_path: Path) -> str:
    # Telemetry off before the first import (MLflow starts its client when imported); the
    # file store is in maintenance mode in MLflow 3 and refused without the opt-in.
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    pytest.importorskip("mlflow")
    return (tmp_path / "mlruns").as_uri()


def _train(sinks: list[Logger]) -> list[dict[str, Any]]:
    """Train 3 updates, logging every update to ``sinks``; return what was logged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 4, generator=gen), torch.randint(0, 3, (5,), generator=gen))] * 6

    def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        logits = model(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits, y, reduction="sum"), y.numel(), {"acc": acc}

    step = accumulate(clip(make_train_step(loss_fn), max_norm=0.5), 2)
    seen: list[dict[str, Any]] = []
    log = Log(sinks)
    events = Events().on("step_end", log).on("step_end", lambda e: seen.append(_copy(e)))
    run(step, state, batches, events=events)
    return seen


def _copy(event: Any) -> dict[str, Any]:
    out = event.output
    return {
        "step": event.step,
        "loss": out.loss.item(),
        "grad_norm": out.grad_norm.item(),
        "acc": out.aux["acc"].item(),
    }


# --- W&B -----------------------------------------------------------------------------------

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed chunks


def _wandb_records(path: str) -> Iterator[Any]:
    """Read the records of an offline run's ``.wandb`` file with W&B's own protobuf schema.

    wandb (0.31) ships no Python reader for it any more (its Go service reads it), so only
    the framing is read here (7-byte file header, then chunks with a 7-byte header: crc32,
    length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4); each record is parsed by
    ``wandb_internal_pb2``.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            pending = b""
            yield record


def _finished_records(path: str, timeout: float = 30.0) -> list[Any]:
    """The records once the run's ``exit`` record is on disk: ``run.finish()`` returns before
    W&B's service process has written the end of the file, so poll for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(_wandb_records(path))
        except Exception:  # a chunk still being written does not parse yet
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"no exit record in {path} after {timeout}s: {records}")
        time.sleep(0.05)


def _wandb_history(path: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for record in _finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.setdefault(row["_step"], {}).update(row)
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return rows, config


def test_wandb_offline_run_holds_the_logged_values(wandb: Any, tmp_path: Path) -> None:
    settings = wandb.Settings(console="off", x_disable_stats=True)
    with WandbLogger(
        project="steplib-test",
        dir=str(tmp_path / "runs"),
        config={"lr": 0.1, "k": 2},
        name="offline",
        settings=settings,
    ) as logger:
        seen = _train([logger])
    sync_file = logger.run.settings.sync_file
    assert sync_file.startswith(str(tmp_path / "runs"))
    rows, config = _wandb_history(sync_file)

    assert sorted(rows) == [e["step"] for e in seen] == [1, 2, 3]
    for expected in seen:
        row = rows[expected["step"]]
        for name in ("loss", "grad_norm", "acc"):
            assert row[name] == pytest.approx(expected[name], rel=1e-6), name
        assert "time" not in row and "micro_step" not in row  # counters are not curves
    assert config["lr"] == 0.1 and config["k"] == 2


def test_wandb_closed_logger_refuses_writes_and_close_is_idempotent(
    wandb: Any, tmp_path: Path
) -> None:
    settings = wandb.Settings(console="off", x_disable_stats=True)
    logger = WandbLogger(project="steplib-test", dir=str(tmp_path), settings=settings)
    logger.close()
    logger.close()
    with pytest.raises(LogWriteError, match="closed"):
        logger.write({"step": 1, "loss": 1.0})


def test_wandb_bad_arguments_say_the_fix() -> None:
    with pytest.raises(ConfigError, match="project"):
        WandbLogger(project="")
    with pytest.raises(ConfigError, match="'offline'"):
        WandbLogger(project="p", mode="cloud")
    with pytest.raises(ConfigError, match="mapping"):
        WandbLogger(project="p", config=[("lr", 0.1)])  # type: ignore[arg-type]


# --- MLflow --------------------------------------------------------------------------------


def test_mlflow_file_store_holds_the_logged_values(mlflow_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    with MLflowLogger(
        tracking_uri=mlflow_uri, experiment="steplib-test", run_name="r1", params={"lr": 0.1}
    ) as logger:
        run_id = logger.run_id
        assert run_id is not None
        seen = _train([logger])

    client = MlflowClient(tracking_uri=mlflow_uri)
    for name in ("loss", "grad_norm", "acc"):
        history = client.get_metric_history(run_id, name)
        assert [m.step for m in history] == [e["step"] for e in seen] == [1, 2, 3]
        for metric, expected in zip(history, seen, strict=True):
            assert metric.value == pytest.approx(expected[name], rel=1e-6)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "r1"
    assert got.data.params == {"lr": "0.1"}
    assert "time" not in got.data.metrics and "micro_step" not in got.data.metrics


def test_mlflow_run_fails_when_the_block_raises_and_reuses_the_experiment(
    mlflow_uri: str,
) -> None:
    from mlflow.tracking import MlflowClient

    first = MLflowLogger(tracking_uri=mlflow_uri, experiment="e")
    failed_id = first.run_id
    assert failed_id is not None
    with pytest.raises(RuntimeError, match="boom"), first:
        first.write({"step": 1, "loss": 2.0, "time": 1.0, "note": "text", "skipped": True})
        raise RuntimeError("boom")
    with MLflowLogger(tracking_uri=mlflow_uri, experiment="e") as second:
        finished_id = second.run_id
    assert finished_id is not None
    client = MlflowClient(tracking_uri=mlflow_uri)
    failed = client.get_run(failed_id)
    assert failed.info.status == "FAILED"
    assert failed.data.metrics == {"loss": 2.0}  # strings and booleans are not metrics
    assert client.get_metric_history(failed_id, "loss")[0].timestamp == 1000  # ms
    finished = client.get_run(finished_id)
    assert finished.info.status == "FINISHED"
    assert finished.info.experiment_id == failed.info.experiment_id  # found, not re-created
    with pytest.raises(LogWriteError, match="closed"):
        second.write({"step": 2, "loss": 1.0})


def test_mlflow_logs_a_sweeps_per_copy_values_as_one_metric_per_copy(mlflow_uri: str) -> None:
    # A list (a sweep's loss, one per copy) was skipped as "not a number": no metric at all.
    from mlflow.tracking import MlflowClient

    with MLflowLogger(tracking_uri=mlflow_uri, experiment="sweep") as logger:
        run_id = logger.run_id
        assert run_id is not None
        logger.write({"step": 1, "loss": [2.0, 0.5, 1.25], "matrix": [[1.0, 2.0]], "lr": 0.1})
    metrics = MlflowClient(tracking_uri=mlflow_uri).get_run(run_id).data.metrics
    assert metrics == {"loss/0": 2.0, "loss/1": 0.5, "loss/2": 1.25, "lr": 0.1}


def test_mlflow_continues_a_killed_run_by_its_run_id(mlflow_uri: str) -> None:
    # MLflowLogger had no run_id=: a run resumed after a kill logged to a new MLflow run,
    # the killed one left RUNNING with half the curve.
    from mlflow.tracking import MlflowClient

    killed = MLflowLogger(tracking_uri=mlflow_uri, experiment="resume", run_name="r")
    for step in (1, 2, 3):
        killed.write({"step": step, "loss": 1.0 / step})
    run_id = killed.run_id
    assert run_id is not None
    killed.client.set_terminated(run_id, status="KILLED")  # the process died
    with MLflowLogger(tracking_uri=mlflow_uri, experiment="resume", run_id=run_id) as logger:
        assert logger.run_id == run_id
        assert logger.client.get_run(run_id).info.status == "RUNNING"
        for step in (4, 5):
            logger.write({"step": step, "loss": 1.0 / step})
    client = MlflowClient(tracking_uri=mlflow_uri)
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 6)]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "r"
    assert len(client.search_runs([got.info.experiment_id])) == 1


def test_mlflow_run_id_of_another_experiment_or_unknown_says_the_fix(mlflow_uri: str) -> None:
    with MLflowLogger(tracking_uri=mlflow_uri, experiment="a") as logger:
        run_id = logger.run_id
    assert run_id is not None
    with pytest.raises(ConfigError, match="names a run in another experiment"):
        MLflowLogger(tracking_uri=mlflow_uri, experiment="b", run_id=run_id)
    with pytest.raises(LogWriteError, match="could not find the run 'f00'"):
        MLflowLogger(tracking_uri=mlflow_uri, experiment="a", run_id="f00")
    with pytest.raises(ConfigError, match="run_id"):
        MLflowLogger(tracking_uri=mlflow_uri, experiment="a", run_id="")


def test_mlflow_bad_arguments_say_the_fix() -> None:
    with pytest.raises(ConfigError, match="tracking_uri"):
        MLflowLogger(tracking_uri="", experiment="e")
    with pytest.raises(ConfigError, match="experiment"):
        MLflowLogger(tracking_uri="file:///tmp/x", experiment=None)  # type: ignore[arg-type]


def test_mlflow_unreachable_store_is_a_log_write_error(
    mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 then refuses the file store
    with pytest.raises(LogWriteError, match="MLFLOW_ALLOW_FILE_STORE"):
        MLflowLogger(tracking_uri=mlflow_uri, experiment="e")


def test_trackers_write_nothing_off_rank_zero(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trackers = importlib.import_module("steplib.handlers.logging.trackers")
    monkeypatch.setattr(trackers, "is_main", lambda: False)
    # Not even imported: a rank that is not 0 needs neither package.
    monkeypatch.setattr(trackers, "_import", lambda *a: pytest.fail("imported off rank 0"))
    wb = WandbLogger(project="p", dir=str(tmp_path / "wb"))
    mlf = MLflowLogger(tracking_uri=(tmp_path / "ml").as_uri(), experiment="e")
    for logger in (wb, mlf):
        logger.write({"step": 1, "loss": 1.0})
        logger.close()
    assert not (tmp_path / "wb").exists() and not (tmp_path / "ml").exists()


# --- a run started again with the same logger -----------------------------------------------


class _KilledError(Exception):
    pass


def _resumable_run(
    sink: Logger, directory: Path, *, kill_at: int | None = None, on_step_end: Any = None
) -> None:
    """8 updates, saved every 4 into ``directory`` and resumed from it, each logged to
    ``sink`` through an attached ``Log`` (and ``on_step_end`` attached, if given); killed after
    update ``kill_at``."""
    from steplib.checkpoint import checkpoint_every, resume_from
    from steplib.data import resumable_loader

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = resumable_loader(
        torch.randn(8, 2, generator=torch.Generator().manual_seed(1)), batch_size=1
    )
    ckpt = checkpoint_every(str(directory), every=4)

    def kill(event: Any) -> None:
        if event.step == kill_at:
            raise _KilledError

    events = Events(resume_from(ckpt), ckpt, Log(sink, every=1)).on("step_end", kill, last=True)
    if on_step_end is not None:
        events.on("step_end", on_step_end)
    run(make_train_step(lambda m, b: m(b).pow(2).mean()), state, data, events=events, max_steps=8)


def _started_again(sink: Logger, directory: Path, kept: str) -> None:
    """Killed after update 6, then the same sink in a run resumed from the save at 4 (a
    notebook cell run again): it warns what the tracker keeps of steps 5 and 6 (``kept``)."""
    with pytest.raises(_KilledError):
        _resumable_run(sink, directory, kill_at=6)
    match = rf"first record is at step 5, .* steps up to 6, .* {kept}"
    with pytest.warns(UserWarning, match=match) as seen:
        _resumable_run(sink, directory)
    assert len(seen) == 1  # once, at the run's first record


def test_wandb_warns_when_a_run_started_again_goes_back_over_its_steps(
    wandb: Any, tmp_path: Path
) -> None:
    # Before, nothing said that W&B dropped the resumed run's records at 5 (it keeps a step
    # only when it is not lower than its last) and merged those at 6 into the earlier run's.
    settings = wandb.Settings(console="off", x_disable_stats=True)
    logger = WandbLogger(project="steplib-test", dir=str(tmp_path / "runs"), settings=settings)
    with logger:
        _started_again(logger, tmp_path / "ckpt", r"W&B drops a record at a step lower")
    rows, _ = _wandb_history(logger.run.settings.sync_file)
    assert sorted(rows) == list(range(1, 9))  # one row per step: the earlier run's at 5


def test_mlflow_warns_when_a_run_started_again_goes_back_over_its_steps(
    mlflow_uri: str, tmp_path: Path
) -> None:
    # Before, MLflow's history silently held steps 5 and 6 twice, the curve going back; then
    # it warned and still held both. Now the resumed run's 5 and 6 are left out, as W&B does.
    from mlflow.tracking import MlflowClient

    with MLflowLogger(tracking_uri=mlflow_uri, experiment="again") as logger:
        run_id = logger.run_id
        assert run_id is not None
        _started_again(logger, tmp_path / "ckpt", r"steps 5 to 6 keep the earlier run's")
    history = MlflowClient(tracking_uri=mlflow_uri).get_metric_history(run_id, "loss")
    assert [m.step for m in history] == list(range(1, 9))


def test_a_tracker_continued_by_a_later_run_warns_nothing(mlflow_uri: str, tmp_path: Path) -> None:
    with (
        MLflowLogger(tracking_uri=mlflow_uri, experiment="on") as logger,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        _resumable_run(logger, tmp_path / "ckpt", kill_at=None)  # 8 updates, then 8 again:
        _resumable_run(logger, tmp_path / "ckpt")  # resumed at its end, nothing new
        logger.start_run()  # a later run: its first record after the last step
        logger.write({"step": 9, "loss": 1.0})


def test_mlflow_continuing_a_killed_run_leaves_out_the_steps_it_holds(
    mlflow_uri: str, tmp_path: Path
) -> None:
    # Before, MLflowLogger(run_id=) of a run resumed from the save at 4 logged steps 5 and 6
    # again beside the killed run's (10 points for 8 steps, the curve going back at 5), and
    # nothing said so: the new logger knew nothing of what its tracker run held.
    from mlflow.tracking import MlflowClient

    killed = MLflowLogger(tracking_uri=mlflow_uri, experiment="continued")
    run_id = killed.run_id
    assert run_id is not None
    with pytest.raises(_KilledError):
        _resumable_run(killed, tmp_path / "ckpt", kill_at=6)
    killed.client.set_terminated(run_id, status="KILLED")  # the process died
    client = MlflowClient(tracking_uri=mlflow_uri)
    before = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    match = r"first record is at step 5, .* steps up to 6, .* steps 5 to 6 keep the earlier"
    with (
        MLflowLogger(tracking_uri=mlflow_uri, experiment="continued", run_id=run_id) as logger,
        pytest.warns(UserWarning, match=match) as seen,
    ):
        _resumable_run(logger, tmp_path / "ckpt")
    assert len(seen) == 1  # once, at the run's first record
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert [s for s, _ in history] == list(range(1, 9))  # one value per step
    assert history[:6] == before  # the killed run's, as it logged them
    # An uninterrupted run's values: the killed run's at 5 and 6 equal the resumed run's.
    with MLflowLogger(tracking_uri=mlflow_uri, experiment="whole") as whole:
        whole_id = whole.run_id
        assert whole_id is not None
        _resumable_run(whole, tmp_path / "whole")
    assert [(m.step, m.value) for m in client.get_metric_history(whole_id, "loss")] == history

"""JsonlLogger: one parseable JSON line per event it is called for, reads only when called."""

from __future__ import annotations

import csv
import io
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import orjson
import pytest
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

import steplib.handlers.logging.console
import steplib.handlers.logging.file_sink
import steplib.handlers.logging.log
import steplib.handlers.logging.tensorboard
from steplib import ConfigError, Event, Events, TrainState, accumulate, clip, make_train_step, run
from steplib.handlers import (
    ConsoleLogger,
    CSVLogger,
    Evaluator,
    JsonlLogger,
    Log,
    Logger,
    LogWriteError,
    TensorBoardLogger,
    event_record,
    make_eval_step,
)
from steplib.handlers.logging.base import Sink
from tests.host_reads import on_host_read
from tests.reference import RecordingSink


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    # SGD: torch's Adam/AdamW read their step counter with .item(), which would blur the count.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for size in (5, 3, 6, 4, 2, 7):
        x = torch.randn(size, 4, generator=gen)
        y = torch.randint(0, 3, (size,), generator=gen)
        batches.append((x, y))

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits, y, reduction="sum"), y.numel(), {"acc": acc}

    step = accumulate(clip(make_train_step(loss_fn), max_norm=0.5), 2)
    return state, step, batches


def _read_lines(url: str) -> list[dict]:
    with fsspec.open(url, "rb") as f:
        return [orjson.loads(line) for line in f.read().splitlines()]


def _as_f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def test_jsonl_lines_parse_and_hold_the_step_outputs(tmp_path: Path) -> None:
    state, step, batches = _setup()
    seen: list[Event] = []
    url = str(tmp_path / "nested" / "dir" / "metrics.jsonl")  # parents are created
    events = Events().on("step_end", seen.append)
    with JsonlLogger(url) as log:
        events.on("step_end", log)
        final = run(step, state, batches, events=events, max_epochs=2)

    lines = _read_lines(url)
    assert len(lines) == len(seen) == final.step == 6
    for line, event in zip(lines, seen, strict=True):
        out = event.output
        assert (line["step"], line["epoch"], line["micro_step"]) == (
            event.step,
            event.epoch,
            event.micro_step,
        )
        # Written as the shortest decimal of the same float32: it parses back to the same value.
        assert _as_f32(line["loss"]) == out.loss
        assert _as_f32(line["grad_norm"]) == out.grad_norm
        assert _as_f32(line["acc"]) == out.aux["acc"]
        assert line["lr"] == pytest.approx(0.1)
        assert line["num_targets"] == int(out.num_targets) and isinstance(line["num_targets"], int)
        assert isinstance(line["time"], float) and line["time"] > 1.6e9
        assert "skipped" not in line
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [line["num_targets"] for line in lines] == [8, 10, 9] * 2


def test_memory_url_appends_or_starts_afresh() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    state, step, batches = _setup()
    with JsonlLogger(url) as log:
        run(step, state, batches, events=Events().on("step_end", log, every=2))
    assert [line["step"] for line in _read_lines(url)] == [2]

    with JsonlLogger(url) as log:  # append (the default): a resumed run continues the file
        log.write({"step": 7, "val_loss": 1.5})
    assert _read_lines(url) == [_read_lines(url)[0], {"step": 7, "val_loss": 1.5}]

    with JsonlLogger(url, append=False) as log:
        log.write({"step": 1})
    assert _read_lines(url) == [{"step": 1}]


def test_each_line_is_flushed_before_close() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    log = JsonlLogger(url)
    log.write({"step": 1})
    assert _read_lines(url) == [{"step": 1}]
    log.close()
    log.close()  # twice is harmless


READS = ("item", "tolist", "__float__")


def test_logger_reads_tensors_only_when_it_is_called() -> None:
    state, step, batches = _setup()
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    calls: list[bool] = []
    inside = [False]
    with JsonlLogger(url) as log:

        def logged(event: Event) -> None:
            inside[0] = True
            try:
                log(event)
            finally:
                inside[0] = False

        events = Events().on("step_end", logged, every=3)
        with on_host_read(lambda name: calls.append(inside[0]), READS):
            run(step, state, batches, events=events, max_epochs=2)

    assert calls, "the logger read nothing"
    assert all(calls), f"{calls.count(False)} tensor read(s) happened outside the logger"
    assert [line["step"] for line in _read_lines(url)] == [3, 6]


def _with(out: object, **changes: object) -> SimpleNamespace:
    """A stand-in for a StepOutput with some fields changed (the logger reads attributes only)."""
    names = ("loss", "num_targets", "did_update", "skipped", "grad_norm", "lr", "aux")
    return SimpleNamespace(**{**{name: getattr(out, name) for name in names}, **changes})


def test_event_without_output_logs_counters_only() -> None:
    record = event_record(Event("epoch_end", state=None, step=4, micro_step=8, epoch=2))
    assert set(record) == {"step", "epoch", "micro_step", "time"}
    assert (record["step"], record["micro_step"], record["epoch"]) == (4, 8, 2)


def test_aux_name_that_clashes_with_a_field_is_prefixed() -> None:
    state, step, batches = _setup()
    seen: list[Event] = []
    run(step, state, batches[:2], events=Events().on("step_end", seen.append))
    out = seen[0].output
    clashing = _with(out, aux={"loss": torch.tensor(9.0), "vec": torch.arange(3)})
    record = event_record(Event("step_end", state=None, output=clashing, step=1))
    assert record["aux.loss"] == 9.0
    assert record["loss"] == pytest.approx(float(out.loss))
    assert record["vec"] == [0, 1, 2]


def test_skipped_update_is_marked() -> None:
    state, step, batches = _setup()
    seen: list[Event] = []
    run(step, state, batches[:2], events=Events().on("step_end", seen.append))
    out = _with(seen[0].output, skipped=torch.tensor(True))
    assert event_record(Event("step_end", state=None, output=out))["skipped"] is True


def test_unopenable_url_fails_at_construction_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    url = str(blocker / "metrics.jsonl")
    with pytest.raises(LogWriteError, match="could not open") as info:
        JsonlLogger(url)
    assert url in str(info.value)
    assert isinstance(info.value, OSError)


def test_write_failure_names_the_url() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"

    class BrokenFile:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    log = JsonlLogger(url)
    log._file = BrokenFile()  # type: ignore[assignment]
    with pytest.raises(LogWriteError, match="could not write") as info:
        log.write({"step": 1})
    assert url in str(info.value) and "No space left" in str(info.value)
    log.close()


def test_write_after_close_and_unserialisable_values_are_clear_errors() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    with JsonlLogger(url) as log:
        with pytest.raises(LogWriteError, match="as JSON") as info:
            log.write({"step": 1, "model": object()})
        assert url in str(info.value)
    with pytest.raises(LogWriteError, match="is closed") as info:
        log.write({"step": 2})
    assert url in str(info.value)
    assert _read_lines(url) == []


@pytest.mark.parametrize("sink_type", [JsonlLogger, CSVLogger])
def test_a_sink_closed_by_its_with_block_is_refused_at_fit_start_of_a_later_run(
    sink_type: type[JsonlLogger] | type[CSVLogger],
) -> None:
    # It failed at the second run's first record (LogWriteError "is closed"), after its
    # first update had been made.
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics"
    state, step, batches = _setup()
    with sink_type(url) as sink:
        state = run(step, state, batches, events=Events(Log(sink, every=1)))
    calls = []
    events = Events(Log(sink, every=1)).on("step_end", lambda event: calls.append(event.step))
    with pytest.raises(ConfigError, match=r"is closed .*Build a new") as info:
        run(step, state, batches, events=events)
    assert calls == [] and url in str(info.value)


def test_a_users_sink_that_sets_closed_itself_is_refused_too() -> None:
    # A sink of the user's own that keeps a plain ``closed`` flag: a ``closed`` property on the
    # base class made its close() raise AttributeError (the property has no setter).
    class Records(Sink):
        def __init__(self) -> None:
            self.closed = False
            self.records: list[Any] = []

        def write(self, record: Any) -> None:
            self.records.append(record)

        def close(self) -> None:
            self.closed = True

    state, step, batches = _setup()
    with Records() as sink:
        state = run(step, state, batches, events=Events(Log(sink, every=1)))
    assert sink.records
    with pytest.raises(ConfigError, match="is closed"):
        run(step, state, batches, events=Events(Log(sink, every=1)))


def test_an_evaluator_refuses_a_closed_sink_at_fit_start() -> None:
    with JsonlLogger(f"memory://steplib-test-{uuid.uuid4().hex}/val.jsonl") as sink:
        pass
    evaluator = Evaluator(
        make_eval_step(lambda model, batch: model(batch[0]).pow(2).mean()),
        [(torch.ones(2, 4),)],
        metrics={"mean": MeanMetric()},
        every=2,
        sinks=sink,
    )
    state, step, batches = _setup()
    with pytest.raises(ConfigError, match="is closed"):
        run(step, state, batches, events=[evaluator])


@pytest.mark.parametrize("url", ["", None, 3])
def test_bad_url_is_a_config_error(url: object) -> None:
    with pytest.raises(ConfigError, match="JsonlLogger"):
        JsonlLogger(url)  # type: ignore[arg-type]


def test_logger_is_the_base_for_other_sinks() -> None:
    class ListLogger(Logger):
        def __init__(self) -> None:
            self.records: list[dict] = []

        def write(self, record: dict) -> None:
            self.records.append(record)

        def close(self) -> None:
            pass

    state, step, batches = _setup()
    with ListLogger() as sink:
        run(step, state, batches, events=Events().on("step_end", sink))
    assert [r["step"] for r in sink.records] == [1, 2, 3]
    assert all("loss" in r and "acc" in r for r in sink.records)


# --- CSV, TensorBoard, console, the Log composer, failures and rank 0 --------------------------


def _read_csv(url: str) -> list[list[str]]:
    with fsspec.open(url, "r") as f:
        return list(csv.reader(f))


def test_csv_has_a_header_and_one_row_per_record(tmp_path: Path) -> None:
    state, step, batches = _setup()
    seen: list[Event] = []
    url = str(tmp_path / "csv" / "metrics.csv")
    events = Events().on("step_end", seen.append)
    with CSVLogger(url) as log:
        events.on("step_end", log)
        run(step, state, batches, events=events)

    header, *rows = _read_csv(url)
    assert header[:4] == ["step", "epoch", "micro_step", "time"]
    assert {"loss", "lr", "num_targets", "grad_norm", "acc"} <= set(header)
    assert len(rows) == len(seen) == 3
    for row, event in zip(rows, seen, strict=True):
        line = dict(zip(header, row, strict=True))
        assert int(line["step"]) == event.step
        assert _as_f32(float(line["loss"])) == event.output.loss  # repr: reads back exactly
        assert int(line["num_targets"]) == int(event.output.num_targets)


def test_csv_widens_its_header_for_new_names_and_keeps_every_row() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.csv"
    with CSVLogger(url) as log:
        log.write({"step": 1, "loss": 2.5})
        log.write({"step": 2, "loss": 2.0})
        log.write({"step": 2, "val_loss": 3.0, "val_acc": 0.5})
        log.write({"step": 3, "loss": 1.5, "note": "a,b"})
    assert _read_csv(url) == [
        ["step", "loss", "val_loss", "val_acc", "note"],
        ["1", "2.5", "", "", ""],
        ["2", "2.0", "", "", ""],
        ["2", "", "3.0", "0.5", ""],
        ["3", "1.5", "", "", "a,b"],
    ]
    with CSVLogger(url) as log:  # append: the header is read back, rows continue under it
        log.write({"step": 4, "val_acc": 0.75})
    assert _read_csv(url)[-1] == ["4", "", "", "0.75", ""]
    with CSVLogger(url, append=False) as log:
        log.write({"step": 1})
    assert _read_csv(url) == [["step"], ["1"]]


class _FailAfter:
    """A file object whose writes fail after ``n`` successful ones."""

    def __init__(self, file, n: int) -> None:
        self.file, self.n = file, n

    def write(self, data: bytes) -> int:
        if self.n <= 0:
            raise OSError(28, "No space left on device")
        self.n -= 1
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@pytest.mark.parametrize("sink", [JsonlLogger, CSVLogger])
def test_a_failing_write_raises_naming_the_url_and_keeps_the_flushed_lines(sink) -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.log"
    log = sink(url)
    log.write({"step": 1, "loss": 1.0})
    log.write({"step": 2, "loss": 0.5})
    log._file = _FailAfter(log._file, 0)
    with pytest.raises(LogWriteError, match="could not write") as info:
        log.write({"step": 3, "loss": 0.25})
    assert url in str(info.value) and "No space left" in str(info.value)
    with fsspec.open(url, "rb") as f:
        lines = f.read().splitlines()
    assert len(lines) == (2 if sink is JsonlLogger else 3)  # CSV: the header and 2 rows
    log.close()


def test_tensorboard_scalars_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # the `tb` extra; CI installs it
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )

    state, step, batches = _setup()
    seen: list[Event] = []
    events = Events().on("step_end", seen.append)
    with TensorBoardLogger(str(tmp_path / "tb")) as tb:
        events.on("step_end", tb)
        run(step, state, batches, events=events, max_epochs=2)
        tb.write({"step": 6, "val_loss": 1.25, "note": "not a number", "skipped": True})

    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "acc", "val_loss"} <= tags
    # Counters are not curves unless keys= asks for them.
    assert not tags & {"step", "micro_step", "time", "note", "skipped", "epoch", "num_targets"}
    losses = reader.Scalars("loss")
    assert [s.step for s in losses] == [e.step for e in seen]
    assert [s.value for s in losses] == pytest.approx([float(e.output.loss) for e in seen])
    assert [(s.step, s.value) for s in reader.Scalars("val_loss")] == [(6, 1.25)]


def test_tensorboard_plots_the_chosen_keys_once_per_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )

    with TensorBoardLogger(str(tmp_path / "tb"), keys=["loss", "epoch"]) as tb:
        tb.write({"step": 2, "epoch": 0, "updates": 2, "loss": 1.5, "lr": 0.1})
        # A second record at the same step (an evaluation's, the one at fit_end): no new point.
        tb.write({"step": 2, "epoch": 0, "loss": 1.5, "val_loss": 2.0})
        tb.write({"step": 4, "epoch": 1, "loss": 1.0})
    reader = EventAccumulator(str(tmp_path / "tb"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == {"loss", "epoch"}
    assert [(s.step, s.value) for s in reader.Scalars("loss")] == [(2, 1.5), (4, 1.0)]
    assert [s.step for s in reader.Scalars("epoch")] == [2, 4]


@pytest.mark.parametrize("sink", ["jsonl", "csv"])
def test_file_sinks_write_the_chosen_keys_and_the_step(sink: str, tmp_path: Path) -> None:
    url = str(tmp_path / f"log.{sink}")
    logger = JsonlLogger(url, keys=["loss"]) if sink == "jsonl" else CSVLogger(url, keys=["loss"])
    with logger:
        logger.write({"step": 1, "epoch": 0, "loss": 0.5, "lr": 0.1})
    text = (tmp_path / f"log.{sink}").read_text()
    assert text.splitlines()[0] == ('{"step":1,"loss":0.5}' if sink == "jsonl" else "step,loss")


@pytest.mark.parametrize("keys", ["loss", [""], [1]])
def test_keys_that_are_not_a_list_of_names_are_refused(keys: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keys=\['loss', 'lr', 'val_loss'\]"):
        JsonlLogger(str(tmp_path / "log.jsonl"), keys=keys)  # type: ignore[arg-type]


def test_tensorboard_failure_is_a_log_write_error_and_keeps_what_was_flushed(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
        EventAccumulator,
    )

    tb = TensorBoardLogger(str(tmp_path))
    tb.write({"step": 1, "loss": 2.0})

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    tb._writer.add_scalar = broken
    with pytest.raises(LogWriteError, match="could not write") as info:
        tb.write({"step": 2, "loss": 1.0})
    assert str(tmp_path) in str(info.value)
    reader = EventAccumulator(str(tmp_path))
    reader.Reload()
    assert [(s.step, s.value) for s in reader.Scalars("loss")] == [(1, 2.0)]
    tb.close()
    with pytest.raises(LogWriteError, match="is closed"):
        tb.write({"step": 3})


def test_console_prints_lines_and_a_summary() -> None:
    stream = io.StringIO()
    console = ConsoleLogger(file=stream)
    console.write({"step": 10, "epoch": 0, "micro_step": 20, "time": 1.0, "loss": 2.34567})
    console.write({"step": 20, "epoch": 1, "val_loss": 1.5})
    console.close()
    console.close()  # the summary is printed once
    assert stream.getvalue().splitlines() == [
        "step 10  epoch 0  loss 2.346",
        "step 20  epoch 1  val_loss 1.5",
        # loss is update 10's: the summary at 20 says so (it read as update 20's)
        "summary after 2 records, at step 20: epoch 1  loss 2.346 (step 10)  val_loss 1.5",
    ]


def test_log_merges_sources_writes_every_sink_and_raises_after_a_failure() -> None:
    class Broken(Logger):
        def write(self, record: dict) -> None:
            raise LogWriteError("disk gone")

        def close(self) -> None:
            pass

    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    good = JsonlLogger(url)
    log = Log([Broken(), good], sources=[lambda e: {"a": 1}, lambda e: {"b": 2}])
    with pytest.raises(LogWriteError, match="disk gone"):
        log(Event("step_end", state=None, step=5, epoch=1))
    log.close()
    (line,) = _read_lines(url)
    assert (line["step"], line["epoch"], line["a"], line["b"]) == (5, 1, 1, 2)


def test_two_sources_that_write_one_name_are_refused_before_the_record_is_written() -> None:
    # TrainMetrics' lr (the rate its updates used) was replaced by LRMonitor's (the next
    # update's, after the scheduler's step) in silence: update 1 logged 0.5 where it used 0.25.
    from steplib.handlers import GradNormMonitor, LRMonitor, TrainMetrics
    from steplib.schedules import warmup_linear

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(warmup=4, total=8))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    url = f"memory://steplib-test-{uuid.uuid4().hex}/metrics.jsonl"
    train = TrainMetrics()

    def scheduled_lr(event) -> dict[str, Any]:  # LRMonitor's, under the name it had
        return {"lr": LRMonitor().read(event)["next_lr"]}

    log = Log(JsonlLogger(url), sources=[train.read, scheduled_lr], every=1)
    with pytest.raises(ConfigError, match=r"scheduled_lr writes \['lr'\]"):
        run(make_train_step(lambda m, b: m(b).pow(2).mean()), state, [torch.ones(2, 2)] * 2,
            events=[train, log])  # fmt: skip
    assert _read_lines(url) == []
    # Counters two sources share (TrainMetrics' and GradNormMonitor's updates) are one value.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState.create(model=model, optimizer=opt)
    train, norms = TrainMetrics(), GradNormMonitor()
    log = Log(JsonlLogger(url, append=False), sources=[train.read, norms.read], every=1)
    step = clip(make_train_step(lambda m, b: m(b).pow(2).mean()), max_norm=1.0)
    run(step, state, [torch.ones(2, 2)] * 2, events=[train, norms, log])
    assert [line["updates"] for line in _read_lines(url)] == [1, 1]


def test_log_checks_its_sinks_and_sources() -> None:
    with pytest.raises(ConfigError, match="not a Sink"):
        Log([print])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="not callable"):
        Log([], sources=[3])  # type: ignore[list-item]


def test_sinks_built_before_the_process_group_write_on_the_launchers_rank_zero_alone(
    monkeypatch, tmp_path: Path
) -> None:
    # torchrun's rank 1 before init_distributed(): before, it counted itself rank 0 (no group
    # yet), so every rank opened and wrote the same files.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    paths = [tmp_path / "m.jsonl", tmp_path / "m.csv"]
    sinks: list = [JsonlLogger(str(paths[0])), CSVLogger(str(paths[1])), ConsoleLogger()]
    Log(sinks)(Event("step_end", state=None, step=1))
    assert all(not sink.active for sink in sinks) and not any(p.exists() for p in paths)
    monkeypatch.setenv("RANK", "0")
    with JsonlLogger(str(paths[0])) as rank_zero:
        rank_zero.write({"step": 1})
    assert paths[0].exists()


def test_sinks_write_nothing_on_ranks_other_than_zero(monkeypatch, tmp_path: Path) -> None:
    logging = steplib.handlers.logging
    # Log and each kind of sink ask for the rank in their own module.
    for module in (logging.log, logging.file_sink, logging.tensorboard, logging.console):
        monkeypatch.setattr(module, "is_main", lambda: False)
    paths = [tmp_path / "m.jsonl", tmp_path / "m.csv"]
    sinks: list = [JsonlLogger(str(paths[0])), CSVLogger(str(paths[1])), ConsoleLogger()]
    sinks.append(TensorBoardLogger(str(tmp_path / "tb")))
    called: list[int] = []

    def source(event: Event) -> dict:
        called.append(event.step)
        return {"x": 1}

    log = Log(sinks, sources=[source])
    log(Event("step_end", state=None, step=1))
    for sink in sinks:
        sink.write({"step": 2, "x": 1})  # direct writes too
    log.close()
    assert called == [1]  # sources still run (they may all-reduce)
    assert not any(path.exists() for path in paths) and not (tmp_path / "tb").exists()
    assert all(not sink.active for sink in sinks)
    # rank_zero_only=False writes anyway.
    with JsonlLogger(str(paths[0]), rank_zero_only=False) as log_anyway:
        log_anyway.write({"step": 3})
    assert paths[0].exists()


def test_a_sink_that_writes_on_every_rank_writes_there_through_log_too(
    monkeypatch, tmp_path: Path
) -> None:
    # Rank 1's own file: registered alone the sink wrote it, through a Log it stayed empty
    # (Log wrote on rank 0 only, whatever the sink was built to do).
    logging = steplib.handlers.logging
    for module in (logging.log, logging.file_sink):
        monkeypatch.setattr(module, "is_main", lambda: False)
    alone, through_log = tmp_path / "alone.jsonl", tmp_path / "log.jsonl"
    with JsonlLogger(str(alone), rank_zero_only=False) as sink:
        sink(Event("step_end", state=None, step=1))
    with Log(JsonlLogger(str(through_log), rank_zero_only=False)) as log:
        log(Event("step_end", state=None, step=1))
    assert [orjson.loads(line)["step"] for line in through_log.read_bytes().splitlines()] == [1]
    assert len(alone.read_bytes().splitlines()) == 1


def test_a_tensor_from_a_log_source_is_written_as_the_number_it_holds(tmp_path: Path) -> None:
    # Before, the CSV wrote "tensor(0.1235)" (four digits, not a number), TensorBoard left it
    # out and the JSONL refused the record; a tensor of the step's own output was read.
    def source(event: Event) -> dict:
        return {"acc": torch.tensor(0.123456789), "vec": torch.tensor([1.5, 2.5])}

    path = tmp_path / "m.csv"
    with Log(CSVLogger(str(path)), sources=[source]) as log:
        log(Event("step_end", state=None, step=1))
    row = next(csv.DictReader(path.read_text().splitlines()))
    assert torch.tensor(float(row["acc"])) == torch.tensor(0.123456789)  # the same float32
    assert orjson.loads(row["vec"]) == [1.5, 2.5]


@pytest.mark.parametrize("stop_at", [5, 6, None])
def test_log_writes_the_last_update_of_a_run_that_ends_between_its_intervals(
    stop_at: int | None,
) -> None:
    # Log(every=N) wrote nothing for the updates after its last multiple: a run stopped early
    # (a time limit, a stop file) or one of 7 updates with every=3 ended its log at update 6,
    # without the last losses. The last update is now written at fit_end, with the means of
    # what came after the last record; a run that ends on a multiple gets no second record.
    from steplib.events import Stop
    from steplib.handlers import TrainMetrics

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [torch.randn(4, 2) for _ in range(7)]
    losses = []

    def loss_fn(model, batch):
        loss = model(batch).pow(2).mean()
        losses.append(loss.item())
        return loss

    def stopper(event: Event) -> Stop | None:
        return Stop("enough") if event.step == stop_at else None

    sink, train = RecordingSink(), TrainMetrics()
    events = Events(train, Log(sink, sources=[train.read], every=3)).on("step_end", stopper)
    run(make_train_step(loss_fn), state, batches, events=events)
    last = stop_at or 7
    assert [r["step"] for r in sink.records] == sorted({3, 6, last} & set(range(1, last + 1)))
    since = losses[(last - 1) // 3 * 3 : last]
    assert sink.records[-1]["updates"] == len(since)
    assert sink.records[-1]["loss"] == pytest.approx(sum(since) / len(since))


def test_log_writes_the_last_update_when_the_run_raises_on_one_process() -> None:
    # As at fit_end: updates 1 and 2, before the error, were in no record. On several ranks
    # nothing is written (a source may all-reduce): tests/test_log_crash.py.
    sink = RecordingSink()

    def loss_fn(model, batch):
        if batch == 2:
            raise RuntimeError("boom")
        return model(torch.ones(1, 2)).sum()

    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(RuntimeError, match="boom"):
        run(make_train_step(loss_fn), state, range(4), events=[Log(sink, every=5)])
    assert [record["step"] for record in sink.records] == [2]


@pytest.mark.parametrize("how", ["break", "stop"])
def test_the_record_of_a_run_stopped_inside_a_window_counts_its_last_update_once(
    how: str,
) -> None:
    # A run that ends inside an accumulation window (a `break` out of iterate in a notebook, a
    # Stop from a micro_step_end handler) gets its last update written at fit_end. The readers
    # had seen the open window's micro-batch since that update, so they took its output for a
    # new one and added its window again: num_targets and tokens_per_s counted it twice, and
    # so did the token-weighted loss mean of its interval.
    from steplib import iterate
    from steplib.events import Stop
    from steplib.handlers import Throughput, TrainMetrics

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (n + 1))
    state = TrainState.create(model=model, optimizer=opt, scheduler=decay)
    batches = [torch.randn(n, 2) for n in (3, 5, 2, 7, 4, 6, 1, 8, 5, 2, 3, 6)]
    windows: list[tuple[float, int]] = []  # each update's loss sum and targets

    def loss_fn(model, batch):
        return model(batch).pow(2).sum(), batch.shape[0]

    def record_window(event: Event) -> None:
        targets = int(event.output.num_targets)
        windows.append((float(event.output.loss) * targets, targets))

    sink, train, speed = RecordingSink(), TrainMetrics(), Throughput()
    events = Events(train, speed, Log(sink, sources=[train.read, speed.read], every=3))
    events.on("step_end", record_window)
    step = accumulate(make_train_step(loss_fn), 2)
    stop_at = 11  # the first micro-batch of the 6th window: the 5th update is the last
    if how == "stop":
        events.on("micro_step_end", lambda e: Stop("enough") if e.micro_step == stop_at else None)
        run(step, state, batches, events=events)
    else:
        for now, _ in iterate(step, state, batches, events=events):
            if now.micro_step == stop_at:
                break
    assert [r["step"] for r in sink.records] == [3, 5]
    last = sink.records[-1]
    loss_sum, targets = (sum(each) for each in zip(*windows[3:5], strict=True))
    assert (last["updates"], last["num_targets"]) == (2, targets)
    assert last["loss"] == pytest.approx(loss_sum / targets)
    assert last["tokens_per_s"] / last["steps_per_s"] == pytest.approx(targets / 2)
    assert last["lr"] == pytest.approx(0.1 / 5)  # the 5th update's, not the open window's


@pytest.mark.parametrize("cadence", [None, 2])
def test_a_log_built_with_every_and_registered_by_hand_is_refused_at_its_first_update(
    cadence: int | None,
) -> None:
    # Registered with events.on, a Log's every= was never applied: Log(sink, every=5) wrote a
    # record at each update (10 for 10), or every 2 with events.on(..., every=2).
    def fresh() -> TrainState:  # a run that raised trained its model in place: start anew
        model = torch.nn.Linear(2, 1)
        return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))

    sink = RecordingSink()
    events = Events().on("step_end", Log(sink, every=5), every=cadence)
    step = make_train_step(lambda m, b: m(b).sum())
    with pytest.raises(ConfigError, match=r"every= unused.*events.add\(log\)"):
        run(step, fresh(), [torch.ones(1, 2)] * 10, events=events)
    assert sink.records == []
    # Attached, or registered with its cadence given to events.on, it writes every 5.
    for log in (Log(sink, every=5), None):
        events = Events(log) if log else Events().on("step_end", Log(sink), every=5)
        run(step, fresh(), [torch.ones(1, 2)] * 10, events=events)
    assert [r["step"] for r in sink.records] == [5, 10, 5, 10]

"""JsonlLogger: one parseable JSON line per event it is called for, reads only when called."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import fsspec
import orjson
import pytest
import torch
import torch.nn.functional as F

from steplib import ConfigError, Event, Events, TrainState, accumulate, clip, make_train_step, run
from steplib.logging import JsonlLogger, Logger, LogWriteError, event_record


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


@contextlib.contextmanager
def _count_reads(calls: list[bool], inside: list[bool]) -> Iterator[None]:
    """Record every host read of a tensor, with whether the logger was running at the time."""
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__")}

    def spy(name):
        def read(self, *args, **kwargs):
            calls.append(inside[0])
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in originals:
            setattr(torch.Tensor, name, spy(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


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
        with _count_reads(calls, inside):
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

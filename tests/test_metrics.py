"""TrainMetrics: running means equal the values by hand; the device metrics read the host only
at the logging interval; across 2 ranks the aux means are reduced and only rank 0 writes."""

from __future__ import annotations

import io
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from steplib import Event, Events, TrainState, accumulate, clip, make_train_step, run
from steplib.handlers import (
    EMA,
    GradNormMonitor,
    Log,
    NonFiniteAlarm,
    ProgressBar,
    Throughput,
    TrainMetrics,
)
from steplib.testing import run_ranks
from tests.host_reads import on_host_read
from tests.reference import RecordingSink, make_batches, tiny_model, token_loss


class HostSyncError(AssertionError):
    """Raised by a patched host read outside the logging interval."""


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for size in (5, 3, 6, 4, 2, 7, 3, 5):
        batches.append((torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,))))

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits, y, reduction="sum"), y.numel(), {"acc": acc, "loss": acc}

    return state, accumulate(make_train_step(loss_fn), 2), batches


def test_running_means_equal_the_token_weighted_values_by_hand() -> None:
    state, step, batches = _setup()
    outputs: list = []
    micro: list = []  # every micro-batch's output: the aux means are over each window's
    sink = RecordingSink()
    train = TrainMetrics()
    events = Events().on("step_end", lambda e: outputs.append(e.output))
    events.on("micro_step_end", lambda e: micro.append(e.output))
    train.attach(events)
    events.on("step_end", Log(sink, sources=[train.read]), every=3)
    run(step, state, batches, events=events, max_epochs=2)  # 8 updates: read at 3, 6

    assert [r["step"] for r in sink.records] == [3, 6]
    intervals = zip(
        sink.records, (outputs[:3], outputs[3:6]), (micro[:6], micro[6:12]), strict=True
    )
    for record, window, batches in intervals:
        targets = sum(float(o.num_targets) for o in window)
        loss = sum(float(o.loss) * float(o.num_targets) for o in window) / targets
        assert record["loss"] == pytest.approx(loss, rel=1e-6)
        assert record["num_targets"] == int(targets) and record["updates"] == 3
        # Every micro-batch of the 3 windows: was the closing micro-batch's alone.
        assert record["acc"] == pytest.approx(sum(float(o.aux["acc"]) for o in batches) / 6)
        assert record["aux.loss"] == record["acc"]  # an aux named like a field is prefixed
        assert record["lr"] == pytest.approx(0.1)
        assert "skipped" not in record
    # What was not read yet (updates 7, 8) is still there, then reading resets.
    assert train.read(None)["updates"] == 2
    assert train.read(None) == {}


def test_skipped_updates_are_left_out_of_the_loss_mean() -> None:
    train = TrainMetrics(aux=[])

    def out(loss: float, targets: int, skipped: bool):
        return SimpleNamespace(
            loss=torch.tensor(loss),
            num_targets=torch.tensor(targets),
            skipped=torch.tensor(skipped),
            did_update=torch.tensor(not skipped),
            lr=torch.tensor(0.5, dtype=torch.float64),
            aux={"acc": torch.tensor(1.0)},
        )

    for o in (out(2.0, 4, False), out(float("nan"), 8, True), out(5.0, 2, False)):
        train.update(Event("step_end", state=None, output=o))
    values = train.read(None)
    assert values["loss"] == pytest.approx((2.0 * 4 + 5.0 * 2) / 6)
    assert values["num_targets"] == 6 and values["skipped"] == 1 and values["updates"] == 3
    assert "acc" not in values  # aux=[] keeps none


def test_skipped_updates_are_left_out_of_the_aux_means() -> None:
    train = TrainMetrics()

    def out(acc: float, skipped: bool):
        return SimpleNamespace(
            loss=torch.tensor(float("nan") if skipped else 1.0),
            num_targets=torch.tensor(4),
            skipped=torch.tensor(skipped),
            did_update=torch.tensor(not skipped),
            lr=torch.tensor(0.5),
            aux={"acc": torch.tensor(acc), "nll": torch.tensor(float("nan") if skipped else 2.0)},
        )

    for o in (out(0.5, False), out(0.0, True), out(1.0, False)):
        train.update(Event("step_end", state=None, output=o))
    values = train.read(None)
    # The two updates trained: their means, as the loss's (it was 0.5 and NaN).
    assert values["acc"] == pytest.approx(0.75) and values["nll"] == pytest.approx(2.0)
    assert values["skipped"] == 1
    train.update(Event("step_end", state=None, output=out(0.0, True)))
    assert math.isnan(train.read(None)["acc"])  # every update skipped: no mean


def _sync_free_run(every: int, extra_reader=None) -> tuple[list[str], RecordingSink]:
    model = tiny_model(0, dropout=0.1)
    # SGD with momentum: torch's non-fused Adam/AdamW read their step counter with .item().
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    step = accumulate(clip(make_train_step(token_loss), max_norm=1.0), 2)
    batches = make_batches(12, [2, 3, 1, 4] * 3)
    gate, reads = [False], list[str]()
    sink = RecordingSink()

    events = Events()
    # First on each event: open the gate on the logging interval only; last: close it again.
    events.on("step_end", lambda e: gate.__setitem__(0, e.step % every == 0))
    events.on("fit_end", lambda e: gate.__setitem__(0, True))
    train, grads, speed = TrainMetrics(), GradNormMonitor(), Throughput(samples_per_step=4)
    for handler in (train, grads, speed, NonFiniteAlarm(every=every), EMA(model, decay=0.9)):
        handler.attach(events)
    ProgressBar(every=every, file=io.StringIO()).attach(events)
    if extra_reader is not None:
        events.on("step_end", extra_reader)
    events.on("step_end", Log(sink, sources=[train.read, grads.read, speed.read]), every=every)
    events.on("step_end", lambda e: gate.__setitem__(0, False))

    def only_when_gated(name: str) -> None:
        """Every host read raises unless ``gate[0]``; the allowed ones are logged."""
        if not gate[0]:
            raise HostSyncError(f"Tensor.{name} outside the logging interval")
        reads.append(name)

    with on_host_read(only_when_gated):
        run(step, state, batches, events=events)
    return reads, sink


def test_device_metrics_read_the_host_only_at_the_logging_interval() -> None:
    reads, sink = _sync_free_run(every=3)  # 6 updates: the interval is at 3 and 6
    assert [r["step"] for r in sink.records] == [3, 6]
    assert reads, "nothing was read at the interval"
    for record in sink.records:
        assert {"loss", "grad_norm_mean", "tokens_per_s", "samples_per_s"} <= set(record)


def test_the_harness_catches_a_handler_that_reads_every_step() -> None:
    with pytest.raises(HostSyncError, match="outside the logging interval"):
        _sync_free_run(every=3, extra_reader=lambda e: float(e.output.loss))


def _two_ranks(rank: int, world: int) -> dict:
    from steplib.handlers import JsonlLogger, StopFile

    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt)

    def loss_fn(model, batch):
        loss_sum, count = token_loss(model, batch)
        return loss_sum, count, {"rank": torch.tensor(float(rank))}

    directory = os.environ["STEPLIB_TEST_DIR"]
    flag = os.path.join(directory, f"STOP-{rank}")
    train = TrainMetrics()
    sink = JsonlLogger(os.path.join(directory, "log.jsonl"))  # every rank builds it
    events = Events()
    train.attach(events)
    events.on("step_end", Log(sink, sources=[train.read]), every=2)
    if rank == 1:  # only rank 1 sees a stop file, after update 3
        events.on("step_end", lambda e: open(flag, "w").close() if e.step == 3 else None)
    events.on("step_end", StopFile(flag, every=1))  # each rank watches its own file
    final = run(make_train_step(loss_fn), state, make_batches(10), events=events)
    sink.close()
    return {"step": final.step, "active": sink.active}


def test_two_ranks_reduce_aux_means_write_on_rank_zero_and_stop_together(monkeypatch) -> None:
    import orjson

    with tempfile.TemporaryDirectory() as directory:
        monkeypatch.setenv("STEPLIB_TEST_DIR", directory)
        r0, r1 = run_ranks(_two_ranks)
        with open(os.path.join(directory, "log.jsonl"), "rb") as f:
            lines = [orjson.loads(line) for line in f.read().splitlines()]
    # Rank 1 alone saw the file at update 3; both stopped there (no hang, same step).
    assert r0["step"] == r1["step"] == 3
    assert (r0["active"], r1["active"]) == (True, False)
    assert [line["step"] for line in lines] == [2]  # written once, by rank 0
    assert lines[0]["rank"] == pytest.approx(0.5)  # the mean of rank 0's 0 and rank 1's 1


def test_an_open_windows_aux_sums_survive_a_state_dict_round_trip() -> None:
    # With accumulation the aux of a window's earlier micro-batches waits for the window to
    # close: a checkpoint taken mid-window carries it, so the resumed read equals the whole.
    import copy

    state, step, batches = _setup()  # windows of 2
    outs = []
    for batch in batches[:4]:
        state, out = step(state, batch)
        outs.append(out)
    whole, first, second = TrainMetrics(), TrainMetrics(), TrainMetrics()
    for out in outs:
        whole.update(Event("micro_step_end", state=None, output=out))
    for out in outs[:3]:  # stopped inside the second window
        first.update(Event("micro_step_end", state=None, output=out))
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    second.update(Event("micro_step_end", state=None, output=outs[3]))
    assert second.read(None) == whole.read(None)


def test_a_checkpoint_of_the_earlier_format_loads() -> None:
    train = TrainMetrics()
    sums = {"loss": torch.tensor(8.0), "targets": torch.tensor(4.0), "skipped": torch.tensor(0.0)}
    old = {**sums, "aux": {"acc": [torch.tensor(1.5), 2]}, "lr": torch.tensor(0.1), "updates": 2}
    train.load_state_dict(old)
    assert train.read(None) == pytest.approx(
        {"loss": 2.0, "num_targets": 4, "updates": 2, "lr": 0.1, "acc": 0.75}
    )

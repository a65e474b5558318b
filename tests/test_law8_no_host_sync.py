"""Law 8: no host sync inside a step.

Every way of reading a tensor on the host (``item``, ``__bool__``, ``__float__``, ``__int__``,
``__index__``, ``cpu``, ``tolist``, ``numpy``) is made to raise while the step runs.

Optimizer choice: torch's Adam/AdamW read their CPU step counter with ``.item()`` unless
``capturable=True`` (CUDA only) or ``fused=True``; that read is torch's, so these tests use SGD
with momentum (no such read) and a fused AdamW.

Skipping (a float16 scaler or ``skip_nonfinite``) decides on the device with a fused optimizer
and no scheduler or a ``LambdaLR`` (``steplib.step.device_skips``): a step with every wrapper then
runs with every read patched. The one read the harness lets through is ``HostCopy.read``, the
``max_consecutive`` check, which reads a host copy of the skip counter only once that copy has
landed (a CUDA event is queried, never waited on; on the CPU the copy is the tensor itself); the
test checks each such read is of a CPU tensor, and ``tests/test_gpu.py`` checks the CUDA path
with ``torch.cuda.set_sync_debug_mode("error")``. Other optimizers and schedulers read the
decision on the host once per update (as ``GradScaler.step`` does for non-fused optimizers),
never on a non-final micro-batch: the last test pins exactly that.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import pytest
import torch

from steplib import TrainState, accumulate, amp_wrap, clip, make_train_step, skip_nonfinite
from steplib.errors import TooManySkipsError
from steplib.step.device_skips import HostCopy
from tests.reference import make_batches, tiny_model, token_loss

HOST_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


class HostSyncError(AssertionError):
    """Raised by a patched host read."""


@contextlib.contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch, record: list[str] | None = None) -> Iterator[None]:
    """Make every host read raise; or, with ``record``, log where each one happened."""

    def patched(name: str):
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args, **kwargs):
            where = traceback.extract_stack(limit=2)[0]
            landed_copy = sys._getframe(1).f_code is HostCopy.read.__code__
            if landed_copy and self.device.type == "cpu" and record is None:
                return original(self, *args, **kwargs)
            if record is None:
                raise HostSyncError(f"Tensor.{name} called at {where.filename}:{where.lineno}")
            record.append(f"{name}@{where.name}")
            return original(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, patched(name))
        yield


def _state(optimizer: str = "sgd") -> TrainState:
    model = tiny_model(0, dropout=0.1)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainState.create(model=model, optimizer=opt, scheduler=sched)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-fused"])
def test_law8_no_host_sync_with_accumulate_clip_and_bf16(monkeypatch, optimizer) -> None:
    state = _state(optimizer)
    step = make_train_step(token_loss)
    step = amp_wrap(clip(accumulate(step, 3), max_norm=1.0, max_value=5.0), dtype=torch.bfloat16)
    batches = make_batches(7, [2, 3, 1, 4, 2, 2, 3])
    with host_reads(monkeypatch):
        for i, batch in enumerate(batches):
            state, out = step(state, batch, close_window=(i == len(batches) - 1))
    assert state.step == 3 and state.micro_step == 7  # it ran; outputs read after the step
    assert torch.isfinite(out.loss) and out.grad_norm is not None


def _poisoned(batches: list, *indices: int) -> list:
    for i in indices:
        x, y, mask = batches[i]
        batches[i] = (x * float("inf"), y, mask)
    return batches


@pytest.mark.parametrize("optimizer", ["sgd-fused", "adamw-fused"])
def test_law8_no_host_sync_with_every_wrapper_including_skips(monkeypatch, optimizer) -> None:
    model = tiny_model(0, dropout=0.1)
    if optimizer == "sgd-fused":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, fused=True
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    step = make_train_step(token_loss)
    step = accumulate(clip(step, max_norm=1.0, max_value=5.0), 3)
    step = skip_nonfinite(amp_wrap(step, dtype=torch.float16), max_consecutive=2)
    # 4 windows of 3 (the last one shorter); the second window holds an inf micro-batch.
    batches = _poisoned(make_batches(11, [2, 3, 1, 4, 2, 2, 3, 1, 2, 2, 3]), 4)
    with host_reads(monkeypatch):
        for i, batch in enumerate(batches):
            state, _ = step(state, batch, close_window=(i == len(batches) - 1))
    assert state.step == 4 and state.micro_step == 11
    assert int(state.skipped_updates) == 1 and int(state.consecutive_skips) == 0
    assert sched.last_epoch == 3  # advanced by the 3 applied updates only
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_law8_too_many_skips_raise_without_a_host_sync(monkeypatch) -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    state = TrainState.create(model=model, optimizer=opt)
    step = skip_nonfinite(make_train_step(token_loss), max_consecutive=2)
    batches = _poisoned(make_batches(4), 1, 2, 3)
    with host_reads(monkeypatch), pytest.raises(TooManySkipsError, match="3 consecutive"):
        for batch in batches:
            state, _ = step(state, batch)
    assert state.step == 3  # the error came with the third skip in a row


def test_law8_non_fused_skipping_reads_the_decision_once_per_update_never_mid_window(
    monkeypatch,
) -> None:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu")
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    step = make_train_step(token_loss)
    step = skip_nonfinite(amp_wrap(clip(accumulate(step, 3), max_norm=1.0), dtype=torch.float16))
    reads: list[str] = []
    with host_reads(monkeypatch, record=reads):
        for batch in make_batches(6):
            count = len(reads)
            state, _ = step(state, batch)
            closed = state.window.size == 0
            assert len(reads) - count == (1 if closed else 0), reads[count:]
    assert reads == ["__bool__@apply", "__bool__@apply"]


def test_law8_the_patch_catches_a_loss_fn_that_syncs(monkeypatch) -> None:
    """The harness itself: a step whose loss_fn calls .item() must fail under it."""

    def syncing_loss(model, batch):
        loss_sum, count = token_loss(model, batch)
        return loss_sum, int(count.item())

    state = _state()
    step = make_train_step(syncing_loss)
    with host_reads(monkeypatch), pytest.raises(HostSyncError, match=r"Tensor\.item"):
        step(state, make_batches(1)[0])

"""``skip_nonfinite(max_consecutive=n)`` in a sweep: a copy that skipped more than ``n``
updates in a row is stopped (as a stopped copy of ``SweepEarlyStopping``), with a warning that
names it, its hyper-parameters and the update; the other copies train on exactly as they would
have; when no copy is left, ``TooManySkipsError``, as outside a sweep. Each copy's count is
saved with the optimizer: a resume stops the copy at the same update.

Before, ``max_consecutive`` was not enforced in a sweep: a diverged copy skipped every update to
the end of the run, silently, and a sweep whose every copy diverged trained nothing and raised
nothing."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.checkpoint import load, save
from steplib.errors import TooManySkipsError
from steplib.step import device_skips
from steplib.sweep import Copies, SweepAdamW, active_copies, stop_copies, sweep_step
from tests.reference import make_batches, tiny_model
from tests.test_device_skips import _LandsAnUpdateLate

N, T, LIMIT = 4, 16, 3
LRS = [1e-3, 3e-3, 1e-2, 3e-2]
WDS = [0.0, 0.01, 0.1, 0.3]
# Copy 1's loss is inf at these batches (0-based): 3 skips in a row (not more than LIMIT), an
# update, then skips from batch 8 on: its 4th in a row is update 12, which stops it.
POISONED = {1: [3, 4, 5, 8, 9, 10, 11, 12, 13, 14, 15]}
STOPPED_AT = 12


def schedule(i: int) -> float:
    return sl.warmup_cosine(warmup=4, total=T)(i)


def model(i: int, poisoned: Iterable[int] = ()) -> nn.Module:
    """``tiny_model(i)`` in float64 with a ``poison`` buffer: where it and the batch's ``at``
    are both True, the loss is inf (the copy diverged at that batch; the other copies not)."""
    m = tiny_model(i).double()
    poison = torch.zeros(T, dtype=torch.bool)
    poison[list(poisoned)] = True
    m.register_buffer("poison", poison)
    return m


def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
    x, y, _, at = batch
    hit = (m.poison & at).any()
    return F.mse_loss(m(x), y) + torch.where(hit, torch.inf, 0.0)


def batches() -> list[Any]:
    out = []
    for t, (x, y, mask) in enumerate(make_batches(T, seed=3)):
        at = torch.zeros(T, dtype=torch.bool)
        at[t] = True
        out.append((x.double(), y.double(), mask, at))
    return out


def build(
    poisoned: dict[int, list[int]], limit: int | None = LIMIT
) -> tuple[Copies, sl.TrainState, Any]:
    copies = Copies.stack([model(i, poisoned.get(i, ())) for i in range(N)])
    opt = SweepAdamW(copies.parameters(), lr=LRS, weight_decay=WDS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    state = sl.TrainState.create(model=copies, optimizer=opt, scheduler=sched)
    inner = sl.skip_nonfinite(sl.make_train_step(loss_fn), max_consecutive=limit)
    return copies, state, sweep_step(inner, copies=copies, example_batch=batches()[0])


def train(
    state: sl.TrainState, step: Any, data: list[Any]
) -> tuple[sl.TrainState, list[sl.StepOutput], list[str]]:
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in data:
            state, out = step(state, batch)
            outs.append(out)
    return state, outs, [str(w.message) for w in caught]


def reference(i: int, poisoned: Iterable[int], stop: int = T) -> nn.Module:
    """Copy ``i``'s own run in plain PyTorch: an update whose loss is not finite is skipped
    (the sweep's one schedule still advances, docs/sweeps.md); it stops after ``stop``
    updates."""
    m = model(i, poisoned)
    opt = torch.optim.AdamW(m.parameters(), lr=LRS[i], weight_decay=WDS[i])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for batch in batches()[:stop]:
        loss = loss_fn(m, batch)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        opt.zero_grad()
        sched.step()
    return m


def per_copy(copies: Copies, i: int) -> list[torch.Tensor]:
    return [p.detach()[i].clone() for p in copies.parameters()]


def optimizer_state(opt: torch.optim.Optimizer, i: int) -> list[torch.Tensor]:
    return [v[i].clone() for p in opt.param_groups[0]["params"] for v in opt.state[p].values()]


def test_a_copy_past_max_consecutive_is_stopped_with_a_warning_and_the_others_train_on() -> None:
    copies, state, step = build(POISONED)
    state, outs, messages = train(state, step, batches())
    opt = state.optimizer
    assert active_copies(opt) == [0, 2, 3]
    assert opt.param_groups[0]["consecutive_skips"].tolist() == [0, LIMIT + 1, 0, 0]
    assert messages == [
        f"skip_nonfinite: copy 1 (lr=0.003, weight_decay=0.01) of this sweep skipped more than "
        f"max_consecutive={LIMIT} updates in a row, at step {STOPPED_AT}: diverged, and stopped "
        "(its parameters and optimizer state stay as they were; the other copies train on). "
        "Give it a lower learning rate in the next sweep, or resume a checkpoint saved before "
        "the stop with a higher max_consecutive."
    ]
    # Copy 1 skipped up to its stop, then is neither skipped nor updated (a stopped copy).
    assert [bool(o.skipped[1]) for o in outs] == [t in POISONED[1][:7] for t in range(T)]
    assert not any(bool(o.did_update[1]) for o in outs[STOPPED_AT:])
    # Each copy equals its own run (copy 1: stopped after update 12; its skips changed nothing).
    for i in range(N):
        own = reference(i, POISONED.get(i, ()), STOPPED_AT if i == 1 else T)
        for mine, theirs in zip(per_copy(copies, i), own.parameters(), strict=True):
            assert (mine - theirs).abs().max().item() <= 1e-12, i
    # The others bit for bit as in a sweep that never stops copy 1 (it skips to the end).
    never, never_state, never_step = build(POISONED, limit=None)
    never_state, never_outs, never_messages = train(never_state, never_step, batches())
    assert never_messages == [] and active_copies(never_state.optimizer) == [0, 1, 2, 3]
    assert [bool(o.skipped[1]) for o in never_outs] == [t in POISONED[1] for t in range(T)]
    for i in (0, 1, 2, 3):
        assert all(map(torch.equal, per_copy(copies, i), per_copy(never, i))), i
        held = optimizer_state(never_state.optimizer, i)
        assert all(map(torch.equal, optimizer_state(opt, i), held)), i
    for o, n in zip(outs, never_outs, strict=True):
        assert torch.equal(o.loss[[0, 2, 3]], n.loss[[0, 2, 3]])


def test_outside_a_sweep_the_same_copy_raises_at_the_same_update() -> None:
    """The stop's update is the one at which the copy's own steplib run raises."""
    m = model(1, POISONED[1])
    opt = torch.optim.AdamW(m.parameters(), lr=LRS[1], weight_decay=WDS[1])
    state = sl.TrainState.create(model=m, optimizer=opt)
    step = sl.skip_nonfinite(sl.make_train_step(loss_fn), max_consecutive=LIMIT)
    with pytest.raises(TooManySkipsError, match=f"at step {STOPPED_AT}:"):
        for batch in batches():
            state, _ = step(state, batch)


def test_a_sweep_whose_every_copy_diverged_raises_too_many_skips() -> None:
    """It trained nothing to the end of the run and raised nothing."""
    everyone = {i: list(range(2, T)) for i in range(N)}
    _, state, step = build(everyone)
    with pytest.raises(TooManySkipsError) as raised:
        train(state, step, batches())
    assert str(raised.value).startswith(
        "skip_nonfinite: every copy of this sweep is stopped: copy 0 (lr=0.001, "
        "weight_decay=0), copy 1 (lr=0.003, weight_decay=0.01), copy 2 (lr=0.01, "
        "weight_decay=0.1), copy 3 (lr=0.03, weight_decay=0.3) skipped more than "
        f"max_consecutive={LIMIT} updates in a row, at step {2 + LIMIT + 1}. Training has "
        "diverged"
    )


def test_a_sweep_resumed_from_a_save_made_after_its_last_copy_diverged_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA, where the stop lands an update or two after it was made: a save between
    holds no active copy. Resumed from it, the sweep updated no copy to the end of its run
    and raised nothing (only a copy stopped by the update itself raised)."""
    monkeypatch.setattr(device_skips, "HostCopy", _LandsAnUpdateLate)
    _LandsAnUpdateLate.made.clear()
    everyone = {i: list(range(2, T)) for i in range(N)}
    data, stop = batches(), 2 + LIMIT + 1
    _, state, step = build(everyone)
    state, _, _ = train(state, step, data[:stop])  # the stop at update 6 has not landed
    assert active_copies(state.optimizer) == []
    url = save(state, str(tmp_path / "ckpt"), step=step)
    _, state, step = build(everyone)  # a new process: everything rebuilt
    state = load(url, state, step=step)
    with pytest.raises(TooManySkipsError) as raised:
        train(state, step, data[stop:])
    assert str(raised.value).startswith(
        "skip_nonfinite: every copy of this sweep is stopped: copy 0 (lr=0.001, "
        "weight_decay=0), copy 1 (lr=0.003, weight_decay=0.01), copy 2 (lr=0.01, "
        "weight_decay=0.1), copy 3 (lr=0.03, weight_decay=0.3) skipped more than "
        f"max_consecutive={LIMIT} updates in a row, before step {stop + 1}. Training has "
        "diverged"
    )


def test_the_last_copy_stopped_for_skips_raises_after_others_were_stopped_by_hand() -> None:
    _, state, step = build(POISONED)
    for i in (0, 2, 3):
        stop_copies(state.optimizer, [i])
    with pytest.raises(TooManySkipsError, match=f"copy 1 .* at step {STOPPED_AT}, the others"):
        train(state, step, batches())


def test_a_stopped_copys_count_stays_and_an_applied_update_resets_it() -> None:
    _, state, step = build({1: [0, 1], 2: [0, 1, 2]})
    stop_copies(state.optimizer, [2])
    state, _, messages = train(state, step, batches()[:3])
    assert messages == []
    # copy 1: two skips, then an update; copy 2 was stopped before any (a stopped copy skips
    # nothing); copies 0 and 3 always updated
    assert state.optimizer.param_groups[0]["consecutive_skips"].tolist() == [0, 0, 0, 0]
    _, state, step = build({1: [0, 1]})
    state, _, _ = train(state, step, batches()[:2])
    assert state.optimizer.param_groups[0]["consecutive_skips"].tolist() == [0, 2, 0, 0]


def test_each_copys_count_survives_a_checkpoint_and_the_stop_comes_at_the_same_update(
    tmp_path: Path,
) -> None:
    """Saved at update 10, copy 1 two skips into its second run: resumed, it is stopped at
    update 12 as in the run without the save (a count started again stops it at 14)."""
    data = batches()
    whole, whole_state, whole_step = build(POISONED)
    whole_state, _, whole_messages = train(whole_state, whole_step, data)
    _, state, step = build(POISONED)
    state, _, _ = train(state, step, data[:10])
    url = save(state, str(tmp_path / "ckpt"), step=step)
    resumed, state, step = build(POISONED)  # a new process: everything rebuilt
    state = load(url, state, step=step)
    assert state.optimizer.param_groups[0]["consecutive_skips"].tolist() == [0, 2, 0, 0]
    state, _, messages = train(state, step, data[10:])
    assert messages == whole_messages and f"at step {STOPPED_AT}:" in messages[0]
    assert active_copies(state.optimizer) == [0, 2, 3]
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for i in range(N):
        assert all(map(torch.equal, optimizer_state(state.optimizer, i),
                       optimizer_state(whole_state.optimizer, i)))  # fmt: skip

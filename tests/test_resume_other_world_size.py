"""Resuming on another number of ranks (issue 16, defect 12): a sharded checkpoint written by
4 ranks (gloo, CPU) and resumed on 2 continues where an uninterrupted 2-rank run would be.

The recipe (``_build``): 48 samples, an MLP without dropout, AdamW with a step schedule,
``clip(accumulate(..., 2))`` under ``ddp_wrap``, and ``resumable_loader(..., shard=True)``
with 8 samples per micro-batch over all ranks (2 per rank on 4 ranks, 4 per rank on 2): 16
samples per update, 3 updates per epoch, 7 updates in all (into the third epoch).

The reference is the uninterrupted 2-rank run of that recipe (same initial weights, same
seed), 7 updates. The 4-rank run saves at update 2 (mid-epoch: 32 samples consumed) and at
update 3 (every batch of epoch 0 yielded, the epoch not yet counted), and stops. A resumed run
loads one of those on 2 ranks (``resume_from``, a fresh process state) and trains to update 7.
From the saved update on it must give, on every rank:

* exactly the samples the reference's rank trains on, micro-batch by micro-batch (bit-equal
  sample ids; the epoch counter and the step counter equal too);
* the reference's losses, parameters and optimizer state, up to the rounding of the first
  updates, which ran on 4 ranks: a 4-rank all-reduce adds the gradients in another order than
  a 2-rank one, and DCP reshards the result exactly (so the closeness bound is that of the
  4-rank and 2-rank runs at the save, measured here too).

Before the fix, the load refused the data position on another world size, and with
``data=None`` the run replayed from the first batch while the step counter went on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from steplib import ConfigError, Events, TrainState, accumulate, clip, ddp_wrap, run
from steplib import make_train_step as train_step
from steplib.checkpoint import latest, load, resume_from, save
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.errors import CheckpointWarning
from steplib.testing import run_ranks

GLOBAL_MICRO_BATCH = 8
UPDATES = 7
SAVES = (2, 3)


def _build(
    rank: int,
    world: int,
    *,
    seen: list[torch.Tensor],
    batch_size: int | None = None,
    shard: bool = True,
) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank and world size
    net = apply_ddp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = TrainState.create(
        model=net,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        ids, x, y = batch
        seen.append(ids.clone())
        return ((model(x) - y) ** 2).mean()

    step = ddp_wrap(clip(accumulate(train_step(loss_fn), 2), max_norm=1.0))
    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.arange(48), torch.randn(48, 8, generator=gen), torch.randn(48, 3, generator=gen)
    )
    per_rank = GLOBAL_MICRO_BATCH // world if batch_size is None else batch_size
    return state, step, resumable_loader(data, batch_size=per_rank, seed=3, shard=shard)


def _contents(state: TrainState, losses: list[torch.Tensor], seen: list[torch.Tensor]) -> Any:
    optimizer = state.optimizer
    return {
        "losses": torch.stack(losses),
        "seen": [s.tolist() for s in seen],
        "params": [p.detach().clone() for p in state.model.parameters()],
        "moments": [
            optimizer.state[p][k].clone()
            for p in state.model.parameters()
            for k in ("exp_avg", "exp_avg_sq")
        ],
        "counters": [state.step, state.micro_step, state.epoch, state.window.size],
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
    }


def _train(state: TrainState, step: Any, loader: Any, events: Events, max_steps: int) -> Any:
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss.detach().clone()))
    return run(step, state, loader, events=events, max_steps=max_steps), losses


def _record_params(into: list[torch.Tensor], event: Any) -> None:
    into.extend(p.detach().clone() for p in event.state.model.parameters())


def _four_ranks(rank: int, world: int, *, root: str) -> dict[str, Any]:
    seen: list[torch.Tensor] = []
    state, step, loader = _build(rank, world, seen=seen)
    events = Events()
    at_save: dict[int, Any] = {}

    def saving(event: Any) -> None:
        if event.step in SAVES:
            save(event.state, f"{root}/at{event.step}", data=loader, step=step)
            at_save[event.step] = [p.detach().clone() for p in event.state.model.parameters()]

    events.on("step_end", saving)
    state, _ = _train(state, step, loader, events, max_steps=max(SAVES))
    # A run whose loader positions are per rank (no shard=True): refused on 2 ranks.
    plain = _build(rank, world, seen=[], shard=False)[2]
    save(state, f"{root}/per-rank", data=plain, step=step)
    state = step = None  # free the DDP model before the process group goes
    return {"params_at": at_save}


def _two_ranks(rank: int, world: int, *, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    seen: list[torch.Tensor] = []
    state, step, loader = _build(rank, world, seen=seen)
    at_save: dict[int, Any] = {}
    events = Events().on(
        "step_end",
        lambda e: at_save.update(
            {e.step: [p.detach().clone() for p in e.state.model.parameters()]}
        ),
    )
    state, losses = _train(state, step, loader, events, max_steps=UPDATES)
    results["reference"] = _contents(state, losses, seen)
    results["reference"]["params_at"] = {at: at_save[at] for at in SAVES}

    for at in SAVES:
        seen = []
        state, step, loader = _build(rank, world, seen=seen)
        torch.manual_seed(999)  # nothing of this process's RNG may matter (no dropout)
        events = Events().on("fit_start", resume_from(f"{root}/at{at}", data=loader))
        loaded: list[torch.Tensor] = []
        events.on("fit_start", functools.partial(_record_params, loaded))  # after the resume
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            state, losses = _train(state, step, loader, events, max_steps=UPDATES)
        results[f"warned_at{at}"] = [
            str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)
        ]
        results[f"resumed_at{at}"] = _contents(state, losses, seen)
        results[f"resumed_at{at}"]["loaded"] = loaded

    # What cannot continue exactly is refused before anything changes, with the fix.
    for label, name, kwargs in (
        ("not_sharded_here", "at2", {"shard": False}),
        ("misaligned", "at2", {"batch_size": 3}),
        ("per_rank", "per-rank", {"shard": False}),
    ):
        state, step, loader = _build(rank, world, seen=[], **kwargs)
        try:
            load(str(latest(f"{root}/{name}")), state, data=loader, step=step)
        except ConfigError as err:
            results[f"{label}_error"] = str(err)
        results[f"{label}_step_after"] = state.step
    del state, step
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("other-world-size"))
    four = run_ranks(functools.partial(_four_ranks, root=root), world=4, timeout=90)
    two = run_ranks(functools.partial(_two_ranks, root=root), world=2, timeout=90)
    return {"four": four, "two": two}


def _micro_batches_before(update: int) -> int:
    return 2 * update  # accumulate(..., 2)


@pytest.mark.parametrize("at", SAVES)
def test_resumed_on_2_ranks_trains_on_the_samples_of_an_uninterrupted_2_rank_run(
    runs: dict[str, Any], at: int
) -> None:
    for result in runs["two"]:
        reference, resumed = result["reference"], result[f"resumed_at{at}"]
        assert resumed["seen"] == reference["seen"][_micro_batches_before(at) :]
        assert resumed["counters"] == reference["counters"]
        assert resumed["scheduler"] == reference["scheduler"]


@pytest.mark.parametrize("at", SAVES)
def test_resumed_on_2_ranks_matches_the_uninterrupted_2_rank_run(
    runs: dict[str, Any], at: int
) -> None:
    close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=1e-7)  # seen: 3e-8
    # The 4-rank run at the save is the 2-rank run up to rounding (law 6, across world sizes).
    four_at = runs["four"][0]["params_at"][at]
    for got, want in zip(four_at, runs["two"][0]["reference"]["params_at"][at], strict=True):
        close(got, want)
    for result in runs["two"]:
        reference, resumed = result["reference"], result[f"resumed_at{at}"]
        # DCP's reshard itself is exact: what 2 ranks load is what 4 ranks had.
        for got, want in zip(resumed["loaded"], four_at, strict=True):
            assert torch.equal(got, want)
        close(resumed["losses"], reference["losses"][at:])
        for key in ("params", "moments"):
            for got, want in zip(resumed[key], reference[key], strict=True):
                close(got, want)


def test_what_cannot_continue_exactly_is_refused_with_the_fix(runs: dict[str, Any]) -> None:
    for result in runs["two"]:
        assert "written by 4 ranks and is loaded on 2" in result["per_rank_error"]
        assert "Resume on 4 ranks" in result["per_rank_error"]
        assert "shard=True" in result["per_rank_error"]
        # Not only "shard=True": a loader without it may be tensor or pipeline parallel's.
        assert "tensor or pipeline parallelism" in result["per_rank_error"]
        assert "is not. Pass data=resumable_loader(" in result["not_sharded_here_error"]
        misaligned = result["misaligned_error"]
        assert "32 samples of epoch 0" in misaligned
        assert "batch_size=4 on 2 ranks" in misaligned
        for label in ("per_rank", "not_sharded_here", "misaligned"):
            assert result[f"{label}_step_after"] == 0  # nothing was loaded


@pytest.mark.parametrize("at", SAVES)
def test_a_resume_on_another_world_size_warns_once_that_no_rank_gets_its_rng(
    runs: dict[str, Any], at: int
) -> None:
    # Before, the 4 ranks' RNG states stayed in the checkpoint and both ranks went on from
    # their own generators (torch.manual_seed(999) here) without a word: a model with dropout
    # draws other masks than the saved run and than an uninterrupted 2-rank run.
    rank0, rank1 = (result[f"warned_at{at}"] for result in runs["two"])
    assert rank1 == []  # once for the run: rank 0 says it
    assert len(rank0) == 1
    message = rank0[0]
    assert f"{at} was written by 4 ranks and is loaded on 2" in message
    assert "none of its 4 states is restored and every rank here goes on" in message
    assert "Dropout masks" in message and "docs/seeding.md" in message

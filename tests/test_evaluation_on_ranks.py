"""Evaluation on several ranks equals a plain one-process loop over the whole validation set:
a sampler that repeats or drops samples to even out the ranks' shares is refused, unequal
shares without padding give the reference's value, and a value that differs across ranks (a
metric not synchronised) is refused before early stopping decides on it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    EarlyStopping,
    Events,
    NewState,
    TrainState,
    make_train_step,
    run,
)
from steplib.data import resumable_loader
from steplib.handlers import Evaluator, evaluate, make_eval_step
from steplib.testing import run_ranks

# 5 samples: 2 ranks do not divide them (DistributedSampler repeats one, or drops one).
_VAL = TensorDataset(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.arange(5))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 5)


def _per_sample_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _reference() -> float:
    """The plain loop: one process, every sample of the set once."""
    model, losses = _model().eval(), []
    with torch.no_grad():
        for x, y in DataLoader(_VAL, batch_size=2):
            losses.append(F.cross_entropy(model(x), y, reduction="none"))
    return torch.cat(losses).mean().item()


@pytest.mark.parametrize(("drop_last", "what"), [(False, "repeats 1"), (True, "drops 1")])
def test_a_distributed_sampler_that_repeats_or_drops_validation_samples_is_refused(
    drop_last: bool, what: str
) -> None:
    shares: DistributedSampler[Any] = DistributedSampler(
        _VAL, num_replicas=2, rank=0, shuffle=False, drop_last=drop_last
    )
    loader = DataLoader(_VAL, batch_size=2, sampler=shares)
    eval_step = make_eval_step(_per_sample_loss)
    message = rf"DistributedSampler {what} of the 5 samples.*sampler=range\(rank, len"
    with pytest.raises(ConfigError, match=message):  # at build time, before any training
        Evaluator(eval_step, {"val": loader}, metrics={"loss": MeanMetric()}, every=1)
    with pytest.raises(ConfigError, match=message):
        evaluate(eval_step, _model(), loader, metrics=MeanMetric())
    # The same sampler with a set the ranks divide is fine.
    even = TensorDataset(*_VAL[:4])
    shares = DistributedSampler(even, num_replicas=2, rank=0, drop_last=drop_last)
    Evaluator(eval_step, DataLoader(even, sampler=shares), metrics=MeanMetric(), every=1)


def _on_two_ranks(rank: int, world: int) -> tuple[float, str]:
    eval_step, metrics = make_eval_step(_per_sample_loss), {"loss": MeanMetric()}
    own_share = DataLoader(_VAL, batch_size=2, sampler=range(rank, len(_VAL), world))
    value = evaluate(eval_step, _model(), own_share, metrics=metrics)["loss"]
    try:
        evaluate(
            eval_step, _model(), resumable_loader(_VAL, batch_size=2, shard=True), metrics=metrics
        )
    except ConfigError as error:
        return value, str(error)
    return value, ""


def test_unequal_shares_on_two_ranks_equal_the_one_process_loop_and_dropping_is_refused() -> None:
    results = run_ranks(_on_two_ranks, world=2, timeout=120)
    for value, refusal in results:
        assert value == pytest.approx(_reference(), abs=1e-6)  # every sample once, none twice
        assert "ShardedSampler drops 1 of the 5 samples" in refusal


def _early_stopping_on_two_ranks(synchronised: bool) -> Any:
    def fn(rank: int, world: int) -> tuple[int, str]:
        model = _model()
        state = TrainState.create(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5)
        )
        step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        # Each rank its own share; without synchronisation, each its own value.
        share = DataLoader(_VAL, batch_size=2, sampler=range(rank, len(_VAL), world))
        metric = MeanMetric(sync_on_compute=synchronised)
        evaluator = Evaluator(
            make_eval_step(_per_sample_loss),
            share,
            metrics={"loss": metric},
            every=1,
            monitor="val_loss",
        )
        events = Events(evaluator, EarlyStopping(evaluator, patience=1))
        try:
            state = run(step, state, [_VAL[0::2]] * 6, events=events)  # rank 0's share
        except ConfigError as error:
            return state.step, str(error)
        return state.step, ""

    return run_ranks(fn, world=2, timeout=120)


def test_a_monitored_value_that_differs_across_ranks_is_refused_before_any_rank_decides() -> None:
    # The reference: synchronised, every rank has the value of the whole set and stops at the
    # same update.
    (step0, refused0), (step1, refused1) = _early_stopping_on_two_ranks(synchronised=True)
    assert step0 == step1 and not refused0 and not refused1
    # Not synchronised: rank 0's share improves where rank 1's does not; the old code let
    # rank 1 stop after 2 updates and rank 0 run all 6, in silence (a DDP run hangs there).
    # Now every rank refuses it at the sanity evaluation, before the first update.
    for step, refusal in _early_stopping_on_two_ranks(synchronised=False):
        assert step == 0
        assert "val_loss is" in refusal and "sync_on_compute=True" in refusal


def _stopper_on_a_value_of_its_own(rank: int, world: int) -> tuple[int, str]:
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    stopper = EarlyStopping("my_score", patience=1)

    def score(event: Any) -> Any:  # a value the user computes on each rank, not all-reduced
        value = float(event.step) if rank == 0 else -float(event.step)
        return NewState(event.state.replace(extras={**event.state.extras, "my_score": value}))

    events = Events().on("step_end", score).on("step_end", stopper)
    try:
        state = run(step, state, [_VAL[0::2]] * 6, events=events)
    except ConfigError as error:
        return state.step, str(error)
    return state.step, ""


def test_early_stopping_on_a_value_that_differs_across_ranks_is_refused_on_every_rank() -> None:
    # Rank 0's score got worse at each check, rank 1's better: rank 0 stopped at update 2
    # while rank 1 trained on, in silence (a DDP run hangs in its next all-reduce there).
    for step, refusal in run_ranks(_stopper_on_a_value_of_its_own, world=2, timeout=120):
        assert step == 0  # refused at the first check, on both ranks
        assert "EarlyStopping: my_score is" in refusal and "on rank" in refusal


def _one_rank_holds_the_set(rank: int, world: int) -> tuple[float | None, str]:
    # nanoGPT's way: rank 0 evaluates the whole set, the others none of it.
    eval_step, metrics = make_eval_step(_per_sample_loss), {"loss": MeanMetric()}
    share: Any = DataLoader(_VAL, batch_size=2) if rank == 0 else []
    value = evaluate(eval_step, _model(), share, metrics=metrics)["loss"]
    try:
        evaluate(eval_step, _model(), [], metrics=metrics)
    except ValueError as error:
        return value, str(error)
    return value, ""


def test_a_rank_with_no_batch_of_the_set_is_a_share_and_an_empty_set_is_refused_on_every_rank() -> (
    None
):
    # Before, the empty rank raised ValueError alone and the other waited in the metric's
    # synchronisation until gloo reset the connection.
    for value, refusal in run_ranks(_one_rank_holds_the_set, world=2, timeout=120):
        assert value == pytest.approx(_reference(), abs=1e-6)
        assert "data yielded no batches" in refusal

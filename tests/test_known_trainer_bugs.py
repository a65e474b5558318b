"""Silent bugs other trainers shipped (wrong numbers that looked right), one test per class,
each against a plain PyTorch loop (``tests/reference.py``) or the uninterrupted run, and each
citing the thread where users met it. Most pass: they pin steplib's behaviour where others
went wrong. The resume and checkpoint classes are in ``test_known_trainer_bugs_resume.py``;
the table is in ``docs/migration/README.md`` ("What other trainers got wrong").
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    EarlyStopping,
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_eval_step,
    make_train_step,
    run,
    skip_nonfinite,
)
from steplib.data import resumable_loader
from steplib.handlers import evaluate
from steplib.testing import run_ranks
from tests.reference import (
    concat,
    make_batches,
    mean_loss,
    params_of,
    reference_loop,
    tiny_model,
    token_loss,
)


def _sgd_state(seed: int = 0, *, lr: float = 0.1, double: bool = True, **create: Any) -> Any:
    model = tiny_model(seed)
    model = model.double() if double else model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainState.create(model=model, optimizer=opt, **create)


def _double(batches: list[Any]) -> list[Any]:
    return [(x.double(), y.double(), m) for x, y, m in batches]


def _max_diff(a: nn.Module | list[torch.Tensor], b: nn.Module | list[torch.Tensor]) -> float:
    a = list(a.parameters()) if isinstance(a, nn.Module) else a
    b = list(b.parameters()) if isinstance(b, nn.Module) else b
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))


def _per_micro_batch_mean_update(batches: list[Any], *, divide_by: int) -> nn.Module:
    """The buggy recipe: each micro-batch's own mean loss divided by ``divide_by``."""
    model = tiny_model(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        loss_sum, count = token_loss(model, batch)
        (loss_sum / count / divide_by).backward()
    opt.step()
    return model


# https://github.com/huggingface/transformers/pull/34191 (HF Trainer: mean of micro-batch means)
def test_token_weighted_accumulation_is_one_mean_over_the_window_not_a_mean_of_means() -> None:
    micro = _double(make_batches(3, [1, 5, 2], seed=3))  # 1 to 11 targets per micro-batch
    state = run(accumulate(make_train_step(token_loss), 3), _sgd_state(), micro)
    ref = tiny_model(0).double()
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [concat(micro)], token_loss)
    assert state.step == 1 and _max_diff(state.model, ref) < 1e-12
    # The bug's update is measurably another one: the test can tell them apart.
    assert _max_diff(_per_micro_batch_mean_update(micro, divide_by=3), ref) > 1e-3


# https://github.com/Lightning-AI/pytorch-lightning/issues/19987 (last window divided by k)
def test_the_short_last_window_of_an_epoch_is_divided_by_what_it_held() -> None:
    batches = _double(make_batches(5, 4, seed=5))  # windows of 3 and 2 in one epoch
    state = run(accumulate(make_train_step(mean_loss), 3), _sgd_state(), batches)
    ref = tiny_model(0).double()
    windows = [concat(batches[:3]), concat(batches[3:])]  # equal sizes: mean of means = mean
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows, mean_loss)
    assert state.step == 2 and _max_diff(state.model, ref) < 1e-12
    # Divided by 3 instead of 2, the last update is 2/3 of the right one.
    wrong = tiny_model(0).double()
    reference_loop(wrong, torch.optim.SGD(wrong.parameters(), lr=0.1), windows[:1], mean_loss)
    opt = torch.optim.SGD(wrong.parameters(), lr=0.1)
    for batch in batches[3:]:
        (mean_loss(wrong, batch) / 3).backward()
    opt.step()
    assert _max_diff(wrong, ref) > 1e-3


# https://github.com/huggingface/transformers/pull/22098 (a window ran across the epoch's end)
def test_an_accumulation_window_never_spans_two_epochs() -> None:
    batches = _double(make_batches(5, 4, seed=5))
    closed: list[int] = []  # the micro-batches counted at each update
    events = Events().on("step_end", lambda e: closed.append(e.state.micro_step))
    step = accumulate(make_train_step(mean_loss), 3)
    state = run(step, _sgd_state(), batches, events=events, max_epochs=2)
    assert closed == [3, 5, 8, 10]  # windows of 3 and 2 in each epoch, none of 3 across
    ref = tiny_model(0).double()
    windows = [concat(batches[:3]), concat(batches[3:])] * 2
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows, mean_loss)
    assert _max_diff(state.model, ref) < 1e-12


# https://github.com/huggingface/accelerate/issues/963 (scheduler stepped every micro-batch)
def test_a_per_update_schedule_advances_once_per_update_not_per_micro_batch() -> None:
    batches = _double(make_batches(12, 4, seed=2))

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    state = _sgd_state()
    sched = schedule(state.optimizer)
    state = state.replace(scheduler=sched)
    rates: list[float] = []
    events = Events().on("step_end", lambda e: rates.append(float(e.output.lr)))
    state = run(accumulate(make_train_step(mean_loss), 4), state, batches, events=events)
    assert rates == [0.1, 0.05, 0.025] and sched.last_epoch == 3
    ref = tiny_model(0).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    windows = [concat(batches[i : i + 4]) for i in (0, 4, 8)]
    reference_loop(ref, opt, windows, mean_loss, scheduler=schedule(opt))
    assert _max_diff(state.model, ref) < 1e-12


# https://github.com/pytorch/pytorch/issues/55585 and
# https://github.com/huggingface/transformers/pull/11144 (scheduler advanced over a skipped update)
def test_a_skipped_update_does_not_advance_the_schedule() -> None:
    batches = make_batches(6, 4, seed=4)
    x, y, m = batches[2]
    batches[2] = (x * float("inf"), y, m)  # a non-finite loss: this update is skipped

    def run_with(step: Any, **create: Any) -> tuple[list[bool], Any]:
        state = _sgd_state(double=False, **create)
        sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 0.5**s)
        applied: list[bool] = []
        events = Events().on("step_end", lambda e: applied.append(bool(e.output.did_update)))
        run(step, state.replace(scheduler=sched), batches, events=events)
        return applied, sched

    applied, sched = run_with(skip_nonfinite(make_train_step(mean_loss)))
    assert applied == [True, True, False, True, True, True]
    assert sched.last_epoch == 5
    assert sched.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**5
    # float16 with a scale so large the first updates overflow: the scaler skips them and
    # backs off; the schedule counts only the applied ones.
    batches += make_batches(10, 4, seed=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
    fp16 = skip_nonfinite(amp_wrap(make_train_step(mean_loss), dtype=torch.float16))
    applied, sched = run_with(fp16, scaler=scaler)
    assert not all(applied) and any(applied)
    assert sched.last_epoch == sum(applied)


# https://github.com/milesial/Pytorch-UNet/issues/468 and
# https://github.com/rwth-i6/returnn/issues/1590 (clipping the scaled gradients)
def test_clipping_under_a_grad_scaler_sees_the_unscaled_gradients() -> None:
    batches = make_batches(4, 6, seed=6)
    norms: dict[float, list[float]] = {}
    for init_scale in (2.0**4, 2.0**14):
        ref = tiny_model(0)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        records = reference_loop(
            ref,
            torch.optim.SGD(ref.parameters(), lr=0.1),
            batches,
            mean_loss,
            max_norm=0.5,
            autocast_dtype=torch.float16,
            scaler=ref_scaler,
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        step = clip(amp_wrap(make_train_step(mean_loss), dtype=torch.float16), max_norm=0.5)
        seen: list[float] = []

        def note(event: Any, seen: list[float] = seen) -> None:
            seen.append(float(event.output.grad_norm))

        events = Events().on("step_end", note)
        state = run(step, _sgd_state(double=False, scaler=scaler), batches, events=events)
        want = [float(r["grad_norm"]) for r in records]
        torch.testing.assert_close(seen, want, rtol=1e-6, atol=1e-7)
        assert _max_diff(state.model, ref) < 1e-6
        norms[init_scale] = seen
    # The norm of the scaled gradients would differ by 2**10 between the two scales.
    torch.testing.assert_close(norms[2.0**4], norms[2.0**14], rtol=1e-2, atol=0.0)


def _noisy_run(
    evaluator: Evaluator | None, modes: list[bool] | None = None
) -> tuple[list[float], nn.Module, TrainState]:
    torch.manual_seed(11)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 8, generator=gen), torch.randn(20, 3, generator=gen))
    train = DataLoader(data, batch_size=4, shuffle=True)  # order drawn from torch's generator
    model = tiny_model(0, dropout=0.5)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    losses: list[float] = []
    events = Events().on("step_end", lambda e: losses.append(float(e.output.loss)))
    if evaluator is not None:
        evaluator.attach(events)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        if modes is not None:
            modes.append(model.training)
        return F.mse_loss(model(batch[0]), batch[1].flatten())

    state = run(make_train_step(loss_fn), state, train, events=events, max_epochs=2)
    return losses, model, state


def _val_evaluator(every: int, modes: list[bool] | None = None) -> Evaluator:
    def eval_fn(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        if modes is not None:
            modes.append(model.training)
        return {"value": F.mse_loss(model(batch[0]), batch[1].flatten())}

    gen = torch.Generator().manual_seed(2)
    val = TensorDataset(torch.randn(12, 8, generator=gen), torch.randn(12, 3, generator=gen))
    return Evaluator(
        make_eval_step(eval_fn),
        DataLoader(val, batch_size=4, shuffle=True),  # draws from torch's generator too
        metrics={"loss": MeanMetric()},
        every=every,
        sanity_batches=2,
        at_epoch_end=True,
    )


# https://github.com/Lightning-AI/pytorch-lightning/issues/6988 (sanity pass moved the shuffle)
def test_validation_draws_nothing_from_the_training_shuffle_or_dropout() -> None:
    quiet, quiet_model, _ = _noisy_run(None)
    watched, watched_model, _ = _noisy_run(_val_evaluator(every=2))
    assert watched == quiet  # every loss, bit for bit: the same batches, the same masks
    assert _max_diff(params_of(watched_model), params_of(quiet_model)) == 0.0


# https://github.com/joeynmt/joeynmt/issues/184 and https://github.com/wkentaro/pytorch-fcn/pull/56
# (the model stayed in eval mode after a mid-epoch validation)
def test_training_after_a_mid_epoch_evaluation_runs_in_train_mode() -> None:
    train_modes: list[bool] = []
    eval_modes: list[bool] = []
    evaluator = _val_evaluator(every=1, modes=eval_modes)
    _, model, state = _noisy_run(evaluator, modes=train_modes)
    assert len(evaluator.history) >= state.step == 10  # an evaluation after every update
    assert train_modes == [True] * 10  # each training forward after one, in train mode
    assert eval_modes and not any(eval_modes)
    assert model.training


# https://github.com/Lightning-AI/pytorch-lightning/issues/2924 and
# https://github.com/catalyst-team/catalyst/issues/799 (epoch loss = mean of batch means)
def test_the_logged_epoch_loss_weighs_each_target_once_with_a_short_last_batch() -> None:
    batches = _double(make_batches(3, [6, 6, 1], seed=8))  # a short last batch
    train = TrainMetrics()
    read: list[dict[str, Any]] = []
    events = train.attach(Events()).on("epoch_end", lambda e: read.append(train.read(e)))
    run(make_train_step(token_loss), _sgd_state(lr=0.0), batches, events=events)
    model = tiny_model(0).double().requires_grad_(False)  # lr 0: the same weights throughout
    loss_sum, count = token_loss(model, concat(batches))
    assert read[0]["loss"] == pytest.approx(float(loss_sum / count), rel=1e-6)
    means = [float(s / n) for s, n in (token_loss(model, b) for b in batches)]
    assert abs(sum(means) / 3 - float(loss_sum / count)) > 1e-2  # the bug's number differs


# https://github.com/allenai/allennlp/pull/4706 (the reported loss was the last micro-batch's / k)
def test_the_reported_loss_under_accumulation_is_the_windows_loss() -> None:
    batches = _double(make_batches(6, [2, 5, 3, 4, 1, 6], seed=9))
    losses: list[torch.Tensor] = []
    events = Events().on("step_end", lambda e: losses.append(e.output.loss.clone()))
    run(accumulate(make_train_step(token_loss), 3), _sgd_state(), batches, events=events)
    ref = tiny_model(0).double()
    windows = [concat(batches[:3]), concat(batches[3:])]
    records = reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows, token_loss)
    torch.testing.assert_close(losses, [r["loss"] for r in records], rtol=1e-12, atol=1e-12)


class _Draws(Dataset[torch.Tensor]):
    """An augmentation drawn in ``__getitem__`` from numpy's, Python's and torch's generators."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(np.random.rand()), random.random(), float(torch.rand(()))])


# https://github.com/pytorch/pytorch/issues/5059 (numpy draws repeated across workers and epochs)
def test_loader_workers_draw_other_augmentations_per_worker_and_per_epoch() -> None:
    loader = resumable_loader(_Draws(), batch_size=2, num_workers=2, seed=0)
    epochs = [torch.cat(list(loader)) for _ in range(2)]
    for library in range(3):  # numpy, random, torch
        values = torch.cat([epoch[:, library] for epoch in epochs])
        assert values.unique().numel() == values.numel(), f"generator {library} repeated"


_VAL = TensorDataset(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.arange(5))


def _per_sample(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 5)


def _evaluated_on_two_ranks(rank: int, world: int) -> float:
    model = _linear()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    share = DataLoader(_VAL, batch_size=2, sampler=range(rank, len(_VAL), world))  # 3 and 2
    evaluator = Evaluator(
        make_eval_step(_per_sample), share, metrics={"loss": MeanMetric()}, every=1
    )
    run(make_train_step(lambda m, b: m(b[0]).sum() * 0), state, [_VAL[0:2]], events=[evaluator])
    return float(evaluator.history[-1][1]["val_loss"])


# https://github.com/pytorch/pytorch/issues/25162 and https://github.com/mosaicml/composer/pull/2218
# (DistributedSampler pads with repeated samples: a validation metric counts some twice)
def test_distributed_validation_counts_every_sample_once() -> None:
    with torch.no_grad():
        want = float(F.cross_entropy(_linear()(_VAL[:][0]), _VAL[:][1]))
    for value in run_ranks(_evaluated_on_two_ranks, world=2, timeout=120):
        assert abs(value - want) < 1e-6
    padded: DistributedSampler[Any] = DistributedSampler(
        _VAL, num_replicas=2, rank=0, shuffle=False
    )  # repeats one
    try:
        evaluate(make_eval_step(_per_sample), _linear(), DataLoader(_VAL, sampler=padded),
                 metrics=MeanMetric())  # fmt: skip
    except ConfigError as error:
        assert "repeats 1 of the 5 samples" in str(error)
    else:
        raise AssertionError("a padding DistributedSampler was not refused")


# https://github.com/huggingface/transformers/issues/1563 and
# https://github.com/facebookresearch/lingua/pull/59 (clipped after every micro-batch)
def test_clipping_with_accumulation_clips_the_windows_gradient_once() -> None:
    batches = _double(make_batches(6, [2, 5, 3, 4, 1, 6], seed=10))
    norms: list[torch.Tensor] = []
    events = Events().on("step_end", lambda e: norms.append(e.output.grad_norm.clone()))
    step = clip(accumulate(make_train_step(token_loss), 3), max_norm=0.05)
    state = run(step, _sgd_state(), batches, events=events)
    ref = tiny_model(0).double()
    windows = [concat(batches[:3]), concat(batches[3:])]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    records = reference_loop(ref, opt, windows, token_loss, max_norm=0.05)
    torch.testing.assert_close(norms, [r["grad_norm"] for r in records], rtol=1e-12, atol=0.0)
    assert all(float(n) > 0.05 for n in norms)  # every window was clipped
    assert _max_diff(state.model, ref) < 1e-12


# https://github.com/espnet/espnet/pull/3283 (a skipped window's gradients leaked into the next)
def test_a_skipped_window_leaves_no_gradient_in_the_next_one() -> None:
    batches = _double(make_batches(6, 4, seed=12))
    x, y, m = batches[1]
    batches[1] = (x * float("nan"), y, m)  # poisons the first window of 3
    step = skip_nonfinite(accumulate(make_train_step(mean_loss), 3))
    applied: list[bool] = []
    events = Events().on("step_end", lambda e: applied.append(bool(e.output.did_update)))
    state = run(step, _sgd_state(), batches, events=events)
    assert applied == [False, True]
    ref = tiny_model(0).double()  # the second window alone, from the initial weights
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [concat(batches[3:])], mean_loss)
    assert _max_diff(state.model, ref) < 1e-12


# https://github.com/deepspeedai/DeepSpeed/issues/8415 (every update skipped, nothing said)
def test_skipped_updates_are_counted_in_the_logged_metrics_and_left_out_of_the_loss() -> None:
    batches = _double(make_batches(4, 4, seed=13))
    x, y, m = batches[2]
    batches[2] = (x * float("inf"), y, m)
    train = TrainMetrics()
    read: list[dict[str, Any]] = []
    events = train.attach(Events()).on("epoch_end", lambda e: read.append(train.read(e)))
    losses: list[float] = []
    events.on("step_end", lambda e: losses.append(float(e.output.loss)))
    run(skip_nonfinite(make_train_step(mean_loss)), _sgd_state(), batches, events=events)
    assert read[0]["skipped"] == 1 and read[0]["updates"] == 4
    kept = [loss for i, loss in enumerate(losses) if i != 2]
    assert read[0]["loss"] == pytest.approx(sum(kept) / 3, rel=1e-6)


# https://github.com/keras-team/keras/issues/4360 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/9297 (min_delta and ties)
@pytest.mark.parametrize(("mode", "sign"), [("min", -1.0), ("max", 1.0)])
def test_early_stopping_min_delta_counts_only_a_gain_beyond_it_in_either_mode(
    mode: str, sign: float
) -> None:
    stopper = EarlyStopping("val", mode=mode, patience=2, min_delta=0.25)
    # 1.0, then a gain of exactly min_delta (no), one of 0.3 (yes), a tie (no), a loss (stop).
    values = [1.0, 1.0 + sign * 0.25, 1.0 + sign * 0.3, 1.0 + sign * 0.3, 1.0]
    stops = [stopper.update(v, step=i) is not None for i, v in enumerate(values)]
    assert stops == [False, False, False, False, True]
    assert (stopper.best.value, stopper.best.step) == (1.0 + sign * 0.3, 2)

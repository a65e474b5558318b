"""More silent bugs other trainers shipped (a second round), one test per class, each against a
plain PyTorch computation or the uninterrupted run, and each citing the thread where users
met it. The first rounds are in ``test_known_trainer_bugs.py`` and
``test_known_trainer_bugs_resume.py``; the table is in ``docs/migration/README.md`` ("What
other trainers got wrong").
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from steplib import (
    EMA,
    ConfigError,
    EarlyStopping,
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    accumulate,
    amp_wrap,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
)
from steplib.checkpoint import list_checkpoints, load_weights
from steplib.data import resumable_loader
from steplib.handlers import Log, LRMonitor, ProgressBar, Throughput, evaluate
from steplib.testing import run_ranks
from tests.reference import (
    RecordingSink,
    concat,
    make_batches,
    mean_loss,
    params_of,
    tiny_model,
    token_loss,
)
from tests.test_known_trainer_bugs_resume import COUNT, _counter, _kill, _run_or_killed


def _killed_at(events: Events, step: int | None) -> Events:
    """Kill the run after everything else at update ``step`` (its save included)."""
    if step is not None:
        events.on("step_end", _kill, once=step, last=True)
    return events


def _sgd_state(seed: int = 0, *, lr: float = 0.1) -> TrainState:
    model = tiny_model(seed).double()
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def _double(batches: list[Any]) -> list[Any]:
    return [(x.double(), y.double(), m) for x, y, m in batches]


def _capture(into: list[list[torch.Tensor]], module: nn.Module) -> Any:
    def capture(event: Any) -> None:
        into.append(params_of(module))

    return capture


def _set(module: nn.Module, params: list[torch.Tensor]) -> nn.Module:
    with torch.no_grad():
        for p, value in zip(module.parameters(), params, strict=True):
            p.copy_(value)
    return module


# https://github.com/huggingface/transformers/issues/35942 and
# https://github.com/huggingface/transformers/issues/28124 (the logged LR was the next update's)
def test_the_logged_lr_is_the_rate_the_update_used_not_the_next_ones() -> None:
    batches = _double(make_batches(6, 4, seed=21))
    cycle = [1.0, 0.1, 0.01]  # restarts every 3 updates: the next rate differs most there
    state = _sgd_state()
    sched = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: cycle[s % 3])
    train, sink = TrainMetrics(), RecordingSink()
    events = Events(train, Log(sink, sources=[train.read, LRMonitor().read], every=1))
    run(make_train_step(mean_loss), state.replace(scheduler=sched), batches, events=events)
    ref = tiny_model(0).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cycle[s % 3])
    used, following = [], []
    for batch in batches:  # the plain loop: the rate of each update is the one it steps with
        used.append(opt.param_groups[0]["lr"])
        mean_loss(ref, batch).backward()
        opt.step()
        opt.zero_grad()
        ref_sched.step()
        following.append(opt.param_groups[0]["lr"])
    assert [r["lr"] for r in sink.records] == pytest.approx(used)
    assert [r["next_lr"] for r in sink.records] == pytest.approx(following)  # named apart
    assert all(abs(a - b) > 1e-3 for a, b in zip(used, following, strict=True))


def _logged_every_two_updates() -> tuple[list[dict[str, Any]], list[Any]]:
    micro = _double(make_batches(8, [2, 5, 3, 4, 1, 6, 2, 3], seed=22))
    train, sink = TrainMetrics(), RecordingSink()
    events = Events(train, Log(sink, sources=[train.read], every=2))
    run(accumulate(make_train_step(token_loss), 2), _sgd_state(lr=0.0), micro, events=events)
    return sink.records, micro


# https://github.com/jmschrei/cherimoya/issues/19 and
# https://github.com/creafz/pytorch-cnn-finetune/issues/1 (the logged loss was the last batch's)
def test_a_loss_logged_every_n_updates_is_the_mean_over_all_of_them_not_the_last() -> None:
    records, micro = _logged_every_two_updates()
    model = tiny_model(0).double().requires_grad_(False)  # lr 0: the same weights throughout
    for record, interval in zip(records, (micro[:4], micro[4:]), strict=True):
        loss_sum, count = token_loss(model, concat(interval))
        assert record["loss"] == pytest.approx(float(loss_sum / count), rel=1e-6)
        last_sum, last_count = token_loss(model, concat(interval[2:]))  # the bug's number
        assert abs(record["loss"] - float(last_sum / last_count)) > 1e-3
    assert [r["num_targets"] for r in records] == [
        int(sum(int(m.sum()) for _, _, m in part)) for part in (micro[:4], micro[4:])
    ]


# https://github.com/Lightning-AI/pytorch-lightning/issues/835 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/4304 (the log's step axis counted
# batches, not updates, under accumulation)
def test_the_log_step_axis_counts_updates_under_accumulation() -> None:
    records, _ = _logged_every_two_updates()
    assert [(r["step"], r["micro_step"], r["updates"]) for r in records] == [(2, 4, 2), (4, 8, 2)]


def _model(seed: int) -> nn.Module:
    model = tiny_model(seed)
    assert isinstance(model, nn.Sequential)
    model[-1] = nn.Identity()  # outputs [batch, 3], as these sets' targets
    return model


def _per_sample(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    return {"value": F.mse_loss(model(batch[0]), batch[1], reduction="none").mean(dim=1)}


def _whole_set_mean(model: nn.Module, dataset: TensorDataset) -> float:
    x, y = dataset[:]
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _sets() -> dict[str, TensorDataset]:
    gen = torch.Generator().manual_seed(23)
    return {
        name: TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 3, generator=gen))
        for name, n in (("a", 10), ("b", 7))
    }


# https://github.com/JetBrains-Research/code2seq/pull/112 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/18282 (a metric never reset: each
# value covered every evaluation so far, or the sets evaluated before)
def test_each_evaluation_and_each_set_gets_a_metric_of_its_own() -> None:
    sets = _sets()
    model = _model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    evaluator = Evaluator(
        make_eval_step(_per_sample),
        {name: DataLoader(ds, batch_size=4) for name, ds in sets.items()},
        metrics={"loss": MeanMetric()},
        every=1,
        sanity_batches=0,
    )
    weights: list[list[torch.Tensor]] = []
    events = Events(evaluator).on("step_end", _capture(weights, model))
    data = [sets["a"][i : i + 5] for i in (0, 5)] * 2
    run(make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), state, data, events=events)
    assert [s for s, _ in evaluator.history] == [1, 2, 3, 4]
    probe = _model(1)
    for (_, values), params in zip(evaluator.history, weights, strict=True):
        for name, ds in sets.items():
            want = _whole_set_mean(_set(probe, params), ds)
            assert values[f"{name}_loss"] == pytest.approx(want, rel=1e-6)
    # Never reset, the 4th value would average all four evaluations: measurably another.
    running = [_whole_set_mean(_set(probe, p), sets["a"]) for p in weights]
    assert abs(sum(running) / 4 - evaluator.history[-1][1]["a_loss"]) > 1e-3


def _evaluated_under_accumulation() -> tuple[Evaluator, list[list[torch.Tensor]]]:
    sets = _sets()
    model = _model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    evaluator = Evaluator(
        make_eval_step(_per_sample), [sets["b"][:]], metrics={"loss": MeanMetric()}, every=2
    )
    weights: list[list[torch.Tensor]] = []
    events = Events(evaluator).on("step_end", _capture(weights, model))
    data = [sets["a"][i : i + 2] for i in range(0, 10, 2)]  # 5 batches: windows of 3 and 2
    step = accumulate(make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])), 3)
    run(step, state, data, events=events, max_epochs=2)
    return evaluator, weights


# https://github.com/Lightning-AI/pytorch-lightning/issues/12205 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/17207 (the validation interval
# counted batches, not updates, under accumulation, and drifted at each epoch's end)
def test_evaluating_every_n_updates_counts_updates_under_accumulation() -> None:
    evaluator, weights = _evaluated_under_accumulation()
    assert len(weights) == 4  # 2 epochs of windows 3 and 2
    assert [s for s, _ in evaluator.history] == [2, 4]  # every 2 updates, not 2 batches
    probe = _model(1)
    for (step, values), params in zip(evaluator.history, (weights[1], weights[3]), strict=True):
        want = _whole_set_mean(_set(probe, params), _sets()["b"])
        assert values["val_loss"] == pytest.approx(want, rel=1e-6), step


# https://github.com/ai2cm/ace/issues/647 and https://github.com/verl-project/verl/issues/78
# (a validation loader with drop_last=True scored part of the set)
def test_a_validation_set_is_scored_whole_with_a_short_last_batch() -> None:
    ds = _sets()["a"]  # 10 samples in batches of 4: 4, 4, 2
    model = _model(0)
    eval_step = make_eval_step(_per_sample)
    loss = {"loss": MeanMetric()}
    got = evaluate(eval_step, model, DataLoader(ds, batch_size=4), metrics=loss)["loss"]
    assert got == pytest.approx(_whole_set_mean(model, ds), rel=1e-6)
    with torch.no_grad():  # the mean of batch means is another number: the test tells them apart
        means = [float(F.mse_loss(model(ds[i : i + 4][0]), ds[i : i + 4][1])) for i in (0, 4, 8)]
    assert abs(sum(means) / 3 - got) > 1e-4
    with pytest.raises(ConfigError, match="drop_last=True"):
        evaluate(eval_step, model, DataLoader(ds, batch_size=4, drop_last=True), metrics=loss)


def _valued(values: dict[int, float]) -> Any:
    def value(model: nn.Module, batch: Any) -> torch.Tensor:
        return torch.full((1,), values.get(round(next(model.parameters()).item()), 9.0))

    return make_eval_step(value)


def _count_data(n: int) -> Any:
    return resumable_loader(TensorDataset(torch.zeros(n, 1)), batch_size=1, seed=0)


# https://github.com/Lightning-AI/pytorch-lightning/issues/6113 and
# https://github.com/facebookresearch/fairseq/issues/2080 (patience counted the checks that
# had no new validation value, and stopped early)
def test_early_stopping_counts_only_checks_that_saw_a_new_evaluation() -> None:
    # Evaluated every 3 updates: 1.0 at 3, then worse at 6, 9: patience 2 stops at 9. A check
    # that counted every update would count 4 and 5 against update 3's value and stop at 5.
    def evaluator() -> Evaluator:
        return Evaluator(
            _valued({3: 1.0, 6: 2.0, 9: 3.0, 12: 0.5}),
            [torch.zeros(1)],
            metrics={"loss": MeanMetric()},
            every=3,
            monitor="val_loss",
        )

    watched = evaluator()
    stopper = EarlyStopping(watched, patience=2)
    state = run(COUNT, _counter(), _count_data(20), events=[watched, stopper], max_steps=20)
    assert state.step == 9
    assert (stopper.best.value, stopper.best.step, stopper.wait) == (1.0, 3, 2)
    # By name, checked on every update: refused at the first, which has no value to check.
    by_name = Events(evaluator()).on("step_end", EarlyStopping("val_loss", patience=2))
    with pytest.raises(ConfigError, match="on the same event and interval"):
        run(COUNT, _counter(), _count_data(20), events=by_name, max_steps=20)


def _ema_run(root: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(24)
    train = [(torch.randn(4, 8, generator=gen), torch.randn(12, generator=gen)) for _ in range(4)]
    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    ema = EMA(model, decay=0.5)
    evaluator = Evaluator(
        make_eval_step(lambda m, b: {"value": F.mse_loss(m(b[0]), b[1])}),
        train[:1],
        metrics={"loss": MeanMetric()},
        every=2,
        model=ema.module,  # validation on the average, as fairchem or nequip do
    )
    ckpt = checkpoint_every(str(root), every=2)
    weights: list[list[torch.Tensor]] = []
    averages: list[list[torch.Tensor]] = []
    modes: list[bool] = []
    events = Events(ema, evaluator, ckpt)
    events.on("step_end", _capture(weights, model), last=True)
    events.on("step_end", _capture(averages, ema.module), last=True)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        modes.append(m.training)
        return F.mse_loss(m(b[0]), b[1])

    step = make_train_step(loss_fn)
    run(step, state, train, events=events)
    return {"weights": weights, "averages": averages, "modes": modes, "evaluator": evaluator,
            "ema": ema, "train": train}  # fmt: skip


# https://github.com/mir-group/nequip/pull/590 and
# https://github.com/PKU-YuanGroup/Open-Sora-Plan/issues/186 (the EMA weights were swapped into
# the model for validation: a checkpoint saved then held them, or training went on from them)
def test_validating_the_ema_leaves_the_trained_weights_in_the_model_and_its_checkpoints(
    tmp_path: Path,
) -> None:
    got = _ema_run(tmp_path)
    plain = tiny_model(0)
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in got["train"]:  # the same training without any EMA or validation
        F.mse_loss(plain(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(got["weights"][-1], plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert got["modes"] == [True] * 4
    for info in list_checkpoints(str(tmp_path)):  # at updates 2 and 4
        saved = tiny_model(1)
        load_weights(saved, info.url)
        for a, b in zip(saved.parameters(), got["weights"][info.step - 1], strict=True):
            assert torch.equal(a, b)
    for (step, values), average in zip(
        got["evaluator"].history, (got["averages"][1], got["averages"][3]), strict=True
    ):
        probe = _set(tiny_model(1), average)
        with torch.no_grad():
            want = float(F.mse_loss(probe(got["train"][0][0]), got["train"][0][1]))
        assert values["val_loss"] == pytest.approx(want, rel=1e-6), step
    # The average is another model than the trained one: a swap would be seen.
    last = zip(got["averages"][-1], got["weights"][-1], strict=True)
    assert max(float((a - b).abs().max()) for a, b in last) > 1e-3


def _bar_run(root: Path, *, kill_at: int | None = None) -> str:
    ckpt = checkpoint_every(str(root), every=2)
    stream = io.StringIO()
    bar = ProgressBar(total=8, every=1, file=stream)
    events = _killed_at(Events(resume_from(ckpt), bar, ckpt), kill_at)
    _run_or_killed(COUNT, _counter(), _count_data(8), events, max_steps=8)
    return stream.getvalue()


# https://github.com/huggingface/diffusers/issues/2636 and
# https://github.com/NVIDIA-NeMo/Speech/pull/7427 (a resumed run's bar started at 0, or counted
# to the updates left as its total)
def test_a_resumed_runs_progress_bar_goes_on_from_the_resumed_update_to_the_runs_total(
    tmp_path: Path,
) -> None:
    _bar_run(tmp_path, kill_at=4)  # saved at 4, killed after
    drawn = re.findall(r"(\d+)/(\d+)", _bar_run(tmp_path))
    assert drawn and {total for _, total in drawn} == {"8"}
    shown = [int(n) for n, _ in drawn]
    assert shown[0] == 4 and shown[-1] == 8 and shown == sorted(shown)


def _retained_run(root: Path, *, steps: int) -> tuple[TrainState, list[int]]:
    evaluator = Evaluator(
        _valued({1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 2.2, 6: 2.1}),
        [torch.zeros(1)],
        metrics={"loss": MeanMetric()},
        every=1,
        monitor="val_loss",
    )
    ckpt = checkpoint_every(str(root), every=1, keep_last=1, keep_best=1, metric=evaluator)
    seen: list[int] = []
    events = Events(resume_from(ckpt), evaluator, ckpt).on(
        "step_end", lambda e: seen.append(e.step)
    )
    state = run(COUNT, _counter(), _count_data(8), events=events, max_steps=steps)
    return state, seen


# https://github.com/huggingface/transformers/pull/11748 (with a save limit and the best kept,
# the newest checkpoint was deleted instead of the oldest; a resume went back to the best)
def test_keeping_the_best_and_the_last_keeps_both_and_a_resume_takes_the_last(
    tmp_path: Path,
) -> None:
    _retained_run(tmp_path, steps=5)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 5]  # the best, the newest
    state, seen = _retained_run(tmp_path, steps=6)
    weight = state.model.get_parameter("weight")
    assert seen == [6] and float(weight.detach()) == 6.0  # went on from 5, not from 2
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 6]


def _warmup_rates(root: Path, *, kill_at: int | None = None) -> list[float]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    state = TrainState.create(model=model, optimizer=opt, scheduler=warmup)
    ckpt = checkpoint_every(str(root), every=3)
    rates: list[float] = []
    events = _killed_at(Events(resume_from(ckpt), ckpt), kill_at)
    events.on("step_end", lambda e: rates.append(float(e.output.lr)))
    gen = torch.Generator().manual_seed(25)
    data = TensorDataset(torch.randn(8, 8, generator=gen), torch.randn(8, 3, generator=gen))
    step = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1].flatten()))
    _run_or_killed(step, state, resumable_loader(data, batch_size=1, seed=2), events, max_steps=8)
    return rates


# https://github.com/aqlaboratory/openfold/issues/181 and
# https://github.com/lightly-ai/lightly-train/pull/301 (the warmup started again after a resume)
def test_a_per_update_warmup_goes_on_after_a_resume_not_from_its_start(tmp_path: Path) -> None:
    whole = _warmup_rates(tmp_path / "whole")
    assert whole == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0])
    killed = _warmup_rates(tmp_path / "killed", kill_at=3)  # in the warmup
    assert killed + _warmup_rates(tmp_path / "killed") == whole


def _scaled_run(root: Path, *, kill_at: int | None = None) -> tuple[list[float], list[Any]]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A scale so large the first updates overflow and back off, then growing every 2 updates:
    # a scale forgotten at a resume starts again at 2**20 and skips updates the run made.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    ckpt = checkpoint_every(str(root), every=4)
    scales: list[float] = []
    events = _killed_at(Events(resume_from(ckpt), ckpt), kill_at)
    events.on("step_end", lambda e: scales.append(float(e.state.scaler.get_scale())))
    gen = torch.Generator().manual_seed(26)
    data = TensorDataset(torch.randn(12, 8, generator=gen), torch.randn(12, 3, generator=gen))
    step = amp_wrap(
        make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1].flatten())), dtype=torch.float16
    )
    loader = resumable_loader(data, batch_size=1, seed=3)
    _run_or_killed(step, state, loader, events, max_steps=12)
    return scales, params_of(model)


# https://github.com/huggingface/transformers/pull/11663 and
# https://github.com/ultralytics/ultralytics/pull/22189 (the GradScaler was not in the
# checkpoint: a resume started from the initial scale, overflowed and skipped updates)
def test_the_loss_scale_goes_on_after_a_resume(tmp_path: Path) -> None:
    whole, weights = _scaled_run(tmp_path / "whole")
    assert whole[0] < 2.0**20  # backed off, and grew again
    assert any(later > earlier for earlier, later in itertools.pairwise(whole))
    killed, _ = _scaled_run(tmp_path / "killed", kill_at=4)
    resumed, resumed_weights = _scaled_run(tmp_path / "killed")
    assert killed + resumed == whole
    for got, want in zip(resumed_weights, weights, strict=True):
        assert torch.equal(got, want)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# https://github.com/meta-pytorch/torchtune/issues/2296 and
# https://github.com/awslabs/sockeye/issues/1073 (tokens per second counted the padding)
def test_tokens_per_second_counts_the_targets_the_loss_counts_not_the_padding() -> None:
    micro = _double(make_batches(8, [3, 5, 2, 6, 4, 1, 5, 3], seed=27))  # masks: ~30% padding
    clock = _Clock()
    speed, sink = Throughput(clock=clock), RecordingSink()
    events = Events(Log(sink, sources=[speed.read], every=2), speed)
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0))  # 1 s per update
    run(accumulate(make_train_step(token_loss), 2), _sgd_state(), micro, events=events)
    # The first interval starts at fit_start (1 s before its 2nd update), the second 2 s long.
    targets = [sum(int(m.sum()) for _, _, m in part) for part in (micro[:4], micro[4:])]
    padded = [sum(y.numel() for _, y, _ in part) for part in (micro[:4], micro[4:])]
    assert [r["tokens_per_s"] for r in sink.records] == pytest.approx(
        [targets[0] / 1.0, targets[1] / 2.0]
    )
    assert all(t < p for t, p in zip(targets, padded, strict=True))


def _by_epoch_history(root: Path, *, kill_at: int | None = None) -> list[tuple[int, float]]:
    # A value of the update count plus the batch: a partial evaluation would give another mean.
    def value(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return next(model.parameters()).detach().reshape(1) + batch

    evaluator = Evaluator(
        make_eval_step(value),
        [torch.full((1,), float(i)) for i in range(3)],  # 3 batches: a mean of 1 over them
        metrics={"loss": MeanMetric()},
        at_epoch_end=True,
    )
    ckpt = checkpoint_every(str(root), every=1)
    events = _killed_at(Events(resume_from(ckpt), evaluator, ckpt), kill_at)
    _run_or_killed(COUNT, _counter(), _count_data(4), events, max_epochs=3)
    return [(step, values["val_loss"]) for step, values in evaluator.history]


# https://github.com/Nerogar/OneTrainer/pull/1470 and
# https://github.com/Lightning-AI/pytorch-lightning/issues/19549 (after a resume inside an
# epoch, that epoch's validation was skipped, or ran on one batch)
def test_the_epoch_end_evaluation_of_an_epoch_resumed_inside_runs_whole(tmp_path: Path) -> None:
    whole = _by_epoch_history(tmp_path / "whole")
    assert whole == [(4, 5.0), (8, 9.0), (12, 13.0)]
    killed = _by_epoch_history(tmp_path / "killed", kill_at=6)  # inside the 2nd epoch
    assert killed == whole[:1]
    assert _by_epoch_history(tmp_path / "killed") == whole


class ValidationCrashError(Exception):
    """The process dies inside a validation."""


def _crashed_validation(root: Path, *, crash_at: int | None = None) -> Any:
    def value(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        count = round(next(model.parameters()).item())
        if count == crash_at:
            raise ValidationCrashError
        return torch.full((1,), float(10 - count))

    evaluator = Evaluator(
        make_eval_step(value),
        [torch.zeros(1)],
        metrics={"loss": MeanMetric()},
        every=2,
        monitor="val_loss",
        sanity_batches=0,
    )
    # Registered before the evaluator: the save must still come after the evaluation.
    ckpt = checkpoint_every(str(root), every=2, keep_best=1, metric=evaluator)
    events = Events(resume_from(ckpt), ckpt, evaluator)
    with contextlib.suppress(ValidationCrashError):
        run(COUNT, _counter(), _count_data(8), events=events, max_steps=8)
    return evaluator


# https://github.com/open-mmlab/mmengine/issues/1394 (saved before the validation, which then
# crashed: the resumed run went on without ever validating that checkpoint)
def test_a_validation_that_crashed_after_its_updates_save_runs_again_on_resume(
    tmp_path: Path,
) -> None:
    whole = _crashed_validation(tmp_path / "whole")
    steps = [2, 4, 6, 8]
    assert [(s, v["val_loss"]) for s, v in whole.history] == [(s, 10.0 - s) for s in steps]
    crashed = _crashed_validation(tmp_path / "crashed", crash_at=4)
    assert [s for s, _ in crashed.history] == [2]
    resumed = _crashed_validation(tmp_path / "crashed")
    assert resumed.history == whole.history  # update 4 evaluated, once
    saved = {c.step: c.metrics.get("val_loss") for c in list_checkpoints(str(tmp_path / "crashed"))}
    assert saved == {8: 2.0}  # the best and the newest


def _epochs_seen(root: Path, *, max_epochs: int = 2, kill_at: int | None = None) -> Any:
    ckpt = checkpoint_every(str(root), every=3)
    seen: list[tuple[int, int, int | None]] = []
    events = _killed_at(Events(resume_from(ckpt), ckpt), kill_at)
    events.on("step_end", lambda e: seen.append((e.step, e.epoch, e.batch_index)))
    _run_or_killed(COUNT, _counter(), _count_data(4), events, max_epochs=max_epochs)
    return seen


# https://github.com/kohya-ss/sd-scripts/issues/1999 and https://github.com/NovaSky-AI/SkyRL/pull/589
# (a resumed run counted its epochs from 0 again: max_epochs trained that many more)
def test_a_resumed_run_counts_its_epochs_on_so_max_epochs_is_the_runs_total(
    tmp_path: Path,
) -> None:
    whole = _epochs_seen(tmp_path / "whole")
    assert whole == [(s, (s - 1) // 4, (s - 1) % 4) for s in range(1, 9)]  # 2 epochs of 4
    assert _epochs_seen(tmp_path / "whole") == []  # run again: its 2 epochs are done
    assert _epochs_seen(tmp_path / "whole", max_epochs=3) == [(s, 2, s - 9) for s in range(9, 13)]
    _epochs_seen(tmp_path / "killed", kill_at=5)  # saved at 3: the resume goes on from there
    assert _epochs_seen(tmp_path / "killed") == whole[3:]


class _Drawn(torch.utils.data.Dataset[torch.Tensor]):
    """An augmentation drawn in ``__getitem__`` from torch's generator (of the worker)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def _drawn_on_a_rank(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)  # the same seed on every rank, as most scripts do
    loader = resumable_loader(_Drawn(), batch_size=2, num_workers=1, seed=0, shard=True)
    return torch.cat(list(loader)).flatten().tolist()


# https://github.com/huggingface/transformers/issues/37932 and
# https://github.com/nnaisense/bayesian-flow-networks/issues/3 (the loader workers of every
# rank were seeded alike: the same random augmentations on every GPU)
def test_loader_workers_draw_other_augmentations_on_each_rank() -> None:
    first, second = run_ranks(_drawn_on_a_rank, world=2, timeout=120)
    assert len(first) == len(second) == 4  # each rank its half of the 8 samples
    assert not set(first) & set(second)


def _logged_tail(updates: int) -> tuple[list[dict[str, Any]], list[Any]]:
    micro = _double(make_batches(updates, [3, 5, 2, 6, 4, 1, 5, 3][:updates], seed=28))
    clock = _Clock()
    train, speed, sink = TrainMetrics(), Throughput(clock=clock), RecordingSink()
    events = Events(train, speed, Log(sink, sources=[train.read, speed.read], every=3))
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0), first=True)
    run(make_train_step(token_loss), _sgd_state(lr=0.0), micro, events=events)
    return sink.records, micro


# https://github.com/facebookresearch/neuroai/pull/140 and
# https://github.com/metatensor/metatrain/issues/206 (the updates after the last logging
# interval, or a whole run shorter than one, were never logged); and
# https://github.com/unslothai/unsloth-zoo/pull/873 (a forced last log divided its tokens by
# another window's time)
def test_the_updates_after_the_last_interval_are_logged_as_their_own_interval() -> None:
    records, micro = _logged_tail(7)
    assert [(r["step"], r["updates"]) for r in records] == [(3, 3), (6, 3), (7, 1)]
    model = tiny_model(0).double().requires_grad_(False)  # lr 0: the same weights throughout
    loss_sum, count = token_loss(model, micro[6])
    assert records[-1]["loss"] == pytest.approx(float(loss_sum / count), rel=1e-6)
    assert records[-1]["tokens_per_s"] == pytest.approx(float(count) / 1.0)  # 1 update, 1 s
    short, _ = _logged_tail(2)
    assert [(r["step"], r["updates"]) for r in short] == [(2, 2)]

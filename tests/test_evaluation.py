"""Evaluation: evaluate equals the metric by hand, modes restored, the Evaluator's schedule,
sanity evaluation before the first update, best-value tracking, and bad input."""

from __future__ import annotations

import uuid

import fsspec
import orjson
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from steplib import ConfigError, EarlyStopping, Events, TrainState, make_train_step, run
from steplib.handlers import Evaluator, JsonlLogger, evaluate, make_eval_step


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(3 + i % 3, 4, generator=gen), torch.randint(0, 3, (3 + i % 3,), generator=gen))
        for i in range(n)
    ]


def _eval_fn(model, batch):
    x, y = batch
    logits = model(x)
    return {"value": F.cross_entropy(logits, y, reduction="none"), "preds": logits, "target": y}


def _metrics() -> MetricCollection:
    return MetricCollection(
        {"loss": MeanMetric(), "acc": MulticlassAccuracy(num_classes=3, average="micro")}
    )


def _loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def test_evaluate_with_a_metric_collection_equals_the_metric_by_hand_with_limit_batches() -> None:
    model, data = _model(), _batches(5)
    values = evaluate(make_eval_step(_eval_fn), model, data, metrics=_metrics(), limit_batches=3)

    model.eval()
    x = torch.cat([b[0] for b in data[:3]])
    y = torch.cat([b[1] for b in data[:3]])
    with torch.no_grad():
        logits = model(x)
    assert set(values) == {"loss", "acc"}
    assert values["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    assert values["acc"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    # All 5 batches give another value: the limit was applied.
    everything = evaluate(make_eval_step(_eval_fn), model, data, metrics=_metrics())
    assert everything["loss"] != pytest.approx(values["loss"])


def test_evaluate_accepts_a_dict_and_a_single_metric_and_a_train_state() -> None:
    model, data = _model(), _batches(2)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))
    single = evaluate(step, state, data, metrics=MeanMetric())
    as_dict = evaluate(step, state, data, metrics={"loss": MeanMetric()})
    assert set(single) == {"MeanMetric"} and set(as_dict) == {"loss"}
    assert single["MeanMetric"] == pytest.approx(as_dict["loss"])


def test_eval_mode_and_grad_mode_are_restored_per_submodule() -> None:
    model = _model()
    model[1].eval()  # a part kept in eval mode on purpose must stay so
    seen: list[tuple[bool, bool, bool]] = []

    def fn(m, batch):
        seen.append((m.training, m[1].training, torch.is_grad_enabled()))
        return _eval_fn(m, batch)

    evaluate(make_eval_step(fn), model, _batches(2), metrics=_metrics())
    assert seen == [(False, False, False)] * 2
    assert (model.training, model[0].training, model[1].training) == (True, True, False)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        make_eval_step(fn)(model, _batches(1)[0])
        assert not torch.is_grad_enabled()  # a caller's no_grad is left as it was


def test_eval_step_restores_modes_when_fn_raises() -> None:
    model = _model()

    def broken(m, batch):
        raise RuntimeError("bad batch")

    with pytest.raises(RuntimeError, match="bad batch"):
        make_eval_step(broken)(model, _batches(1)[0])
    assert model.training and model[1].training and torch.is_grad_enabled()


def test_eval_step_autocasts_when_asked() -> None:
    model = _model()
    plain = make_eval_step(lambda m, b: m(b[0]))(model, _batches(1)[0])
    cast = make_eval_step(lambda m, b: m(b[0]), autocast_dtype=torch.bfloat16)(
        model, _batches(1)[0]
    )
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert not plain.requires_grad


def _train(evaluator: Evaluator, *, epochs: int = 2, batches: int = 5, record=None):
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    calls = record if record is not None else []

    def loss_fn(model, batch):
        calls.append("train")
        return _loss_fn(model, batch)

    events = evaluator.attach(Events())
    final = run(
        make_train_step(loss_fn), state, _batches(batches), events=events, max_epochs=epochs
    )
    return final


def test_evaluator_runs_every_n_steps_and_at_epoch_end_once_per_step() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/eval.jsonl"
    sink = JsonlLogger(url)
    evaluator = Evaluator(
        make_eval_step(_eval_fn),
        _batches(3, seed=7),
        metrics=_metrics(),
        every=2,
        at_epoch_end=True,
        monitor="val_loss",
        sinks=[sink],
    )
    final = _train(evaluator)
    sink.close()

    steps = [step for step, _ in evaluator.history]
    assert steps == [2, 4, 5, 6, 8, 10]  # epoch ends at 5 and 10; 10 is not evaluated twice
    last = evaluator.history[-1][1]
    assert set(last) == {"val_loss", "val_acc"}
    assert final.extras["val_loss"] == last["val_loss"]
    losses = [values["val_loss"] for _, values in evaluator.history]
    assert evaluator.best.value == min(losses)
    assert evaluator.best.step == steps[losses.index(min(losses))]
    assert final.extras["best_val_loss"] == min(losses)
    # The final weights, evaluated afresh, give the last value.
    again = evaluate(make_eval_step(_eval_fn), final, _batches(3, seed=7), metrics=_metrics())
    assert again["loss"] == pytest.approx(last["val_loss"])

    with fsspec.open(url, "rb") as f:
        lines = [orjson.loads(line) for line in f.read().splitlines()]
    assert [line["step"] for line in lines] == steps
    assert [line["val_loss"] for line in lines] == pytest.approx(losses)
    assert all({"epoch", "time", "val_acc"} <= set(line) for line in lines)


def test_sanity_evaluation_runs_before_the_first_step_and_keeps_nothing() -> None:
    calls: list[str] = []

    def fn(model, batch):
        calls.append("eval")
        return _eval_fn(model, batch)

    evaluator = Evaluator(
        make_eval_step(fn), _batches(4), metrics=_metrics(), every=3, sanity_batches=2
    )
    final = _train(evaluator, epochs=1, batches=3, record=calls)
    assert calls[:3] == ["eval", "eval", "train"]  # 2 sanity batches, then training
    assert calls[3:] == ["train", "train", "eval", "eval", "eval", "eval"]  # step 3: all 4
    assert evaluator.sanity_values is not None and set(evaluator.sanity_values) == {
        "val_loss",
        "val_acc",
    }
    assert [step for step, _ in evaluator.history] == [3]
    assert final.extras["val_loss"] == evaluator.history[0][1]["val_loss"]


def test_evaluator_can_evaluate_another_module() -> None:
    other = _model(seed=5)
    evaluator = Evaluator(
        make_eval_step(_eval_fn), _batches(2), metrics=_metrics(), every=5, model=other
    )
    _train(evaluator, epochs=1)
    expected = evaluate(make_eval_step(_eval_fn), other, _batches(2), metrics=_metrics())
    assert evaluator.history[0][1]["val_loss"] == pytest.approx(expected["loss"])


def test_unknown_monitor_fails_at_the_sanity_evaluation_listing_the_names() -> None:
    calls: list[str] = []
    evaluator = Evaluator(
        make_eval_step(_eval_fn), _batches(2), metrics=_metrics(), every=2, monitor="val_accuracy"
    )
    with pytest.raises(ConfigError, match="val_accuracy") as info:
        _train(evaluator, record=calls)
    assert "val_acc, val_loss" in str(info.value)
    assert calls == []  # before the first update


@pytest.mark.parametrize(
    "metrics",
    [lambda preds, target: 0.0, {"loss": "MeanMetric"}, [MeanMetric()], {}, torch.nn.Linear(1, 1)],
)
def test_a_metric_that_is_not_a_torchmetrics_metric_is_a_config_error(metrics) -> None:
    with pytest.raises(ConfigError, match="not a torchmetrics Metric"):
        evaluate(make_eval_step(_eval_fn), _model(), _batches(1), metrics=metrics)
    with pytest.raises(ConfigError, match="not a torchmetrics Metric"):
        Evaluator(make_eval_step(_eval_fn), _batches(1), metrics=metrics, every=1)


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_every_that_is_not_positive_is_a_config_error(every) -> None:
    with pytest.raises(ConfigError, match=r"every=\.\.\.\) received"):
        Evaluator(make_eval_step(_eval_fn), _batches(1), metrics=_metrics(), every=every)


def test_other_bad_settings_are_config_errors() -> None:
    step, data = make_eval_step(_eval_fn), _batches(1)
    with pytest.raises(ConfigError, match="mode"):
        Evaluator(step, data, metrics=_metrics(), every=1, monitor="val_loss", mode="median")
    with pytest.raises(ConfigError, match="neither every"):
        Evaluator(step, data, metrics=_metrics())
    with pytest.raises(ConfigError, match="limit_batches"):
        evaluate(step, _model(), data, metrics=_metrics(), limit_batches=0)
    with pytest.raises(ConfigError, match="sanity_batches"):
        Evaluator(step, data, metrics=_metrics(), every=1, sanity_batches=-1)
    with pytest.raises(ConfigError, match="not callable"):
        make_eval_step("model")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"fn\(model, batch\)"):
        make_eval_step(lambda batch: batch)  # type: ignore[arg-type,misc]
    with pytest.raises(ConfigError, match="bfloat16"):
        make_eval_step(_eval_fn, autocast_dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"TrainState or an nn\.Module"):
        evaluate(step, "model", data, metrics=_metrics())  # type: ignore[arg-type]


def test_outputs_the_metrics_cannot_take_are_a_config_error_showing_them() -> None:
    step = make_eval_step(lambda m, b: (m(b[0]), b[1], b[1]))
    with pytest.raises(ConfigError, match=r"tensor\(3, 3\), tensor\(3,\), tensor\(3,\)"):
        evaluate(step, _model(), _batches(1), metrics=MeanMetric())


def test_empty_data_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no batches"):
        evaluate(make_eval_step(_eval_fn), _model(), [], metrics=_metrics())


# Several validation sets ------------------------------------------------------------------


def test_named_sets_prefix_their_metrics_and_equal_evaluating_each_set_alone() -> None:
    url = f"memory://steplib-test-{uuid.uuid4().hex}/eval.jsonl"
    sink = JsonlLogger(url)
    sets = {"val": _batches(3, seed=7), "ood": _batches(2, seed=8)}
    evaluator = Evaluator(
        make_eval_step(_eval_fn), sets, metrics=_metrics(), every=5, monitor="ood_loss", sinks=sink
    )
    final = _train(evaluator, epochs=1)
    sink.close()

    ((step, values),) = evaluator.history
    assert step == 5
    assert set(values) == {"val_loss", "val_acc", "ood_loss", "ood_acc"}
    for name, data in sets.items():
        alone = evaluate(make_eval_step(_eval_fn), final, data, metrics=_metrics())
        assert values[f"{name}_loss"] == pytest.approx(alone["loss"])
        assert values[f"{name}_acc"] == pytest.approx(alone["acc"])
        assert final.extras[f"{name}_loss"] == values[f"{name}_loss"]
    assert values["val_loss"] != values["ood_loss"]  # two sets, not one evaluated twice
    assert evaluator.best.value == values["ood_loss"] == final.extras["best_ood_loss"]
    with fsspec.open(url, "rb") as f:
        (line,) = [orjson.loads(line) for line in f.read().splitlines()]
    assert line["ood_loss"] == pytest.approx(values["ood_loss"]) and "val_acc" in line
    # An explicit prefix goes in front of the set names.
    prefixed = Evaluator(make_eval_step(_eval_fn), sets, metrics=_metrics(), every=1, prefix="e/")
    assert set(prefixed.run(final)) == {"e/val_loss", "e/val_acc", "e/ood_loss", "e/ood_acc"}


def _signed_weight(model, sign):
    # A value that improves on one set and worsens on the other while the weight grows.
    return (model.weight.sum() * sign).reshape(1)


def _train_towards_one(events: Events, steps: int = 8) -> TrainState:
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.ones(4, 1)
    step = make_train_step(lambda m, b: F.mse_loss(m(b), b))  # the weight grows towards 1
    return run(step, state, [x] * steps, events=events)


@pytest.mark.parametrize(("monitor", "stop_step"), [("ood_loss", 3), ("val_loss", 8)])
def test_early_stopping_and_best_value_watch_the_named_set(monitor, stop_step) -> None:
    sets = {"val": [torch.tensor(-1.0)], "ood": [torch.tensor(1.0)]}
    evaluator = Evaluator(
        make_eval_step(_signed_weight),
        sets,
        metrics={"loss": MeanMetric()},
        every=1,
        sanity_batches=0,
        monitor=monitor,
    )
    events = evaluator.attach(Events())
    events.on("step_end", EarlyStopping(monitor, patience=2), every=1)
    final = _train_towards_one(events)
    assert final.step == stop_step  # ood_loss worsens from the first check: stop after 2 more
    watched = [values[monitor] for _, values in evaluator.history]
    assert evaluator.best.value == min(watched)
    assert evaluator.best.step == (1 if monitor == "ood_loss" else stop_step)


def test_bad_named_sets_and_an_unknown_monitor_name_the_sets() -> None:
    step = make_eval_step(_eval_fn)
    for data in ({}, {"": _batches(1)}, {1: _batches(1)}):
        with pytest.raises(ConfigError, match="non-empty string names"):
            Evaluator(step, data, metrics=_metrics(), every=1)
    evaluator = Evaluator(
        step,
        {"val": _batches(1), "ood": _batches(1)},
        metrics=_metrics(),
        every=1,
        monitor="loss",
    )
    with pytest.raises(ConfigError, match="'val_' or 'ood_'") as info:
        _train(evaluator, epochs=1)
    assert "ood_acc, ood_loss, val_acc, val_loss" in str(info.value)


def test_an_iterator_as_validation_data_is_refused_when_the_evaluator_is_built() -> None:
    # Before: the sanity evaluation took batches 0-1 (and pulled 2, lost), the first recorded
    # value was the mean of batches 3-5 alone, and the next evaluation found no batch at all.
    batches = _batches(6)
    eval_step, metrics = make_eval_step(_eval_fn), _metrics()
    for data in ((b for b in batches), iter(batches), {"val": iter(batches)}):
        with pytest.raises(ConfigError, match=r"an iterator, which yields its batches once"):
            Evaluator(eval_step, data, metrics=metrics, every=1)
    Evaluator(eval_step, batches, metrics=metrics, every=1)  # re-iterable: fine


def test_evaluate_pulls_no_batch_past_limit_batches() -> None:
    # Evaluating one iterator chunk by chunk: each chunk is its own batches, none lost between.
    batches, model = _batches(6), _model()
    eval_step = make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))
    remaining = iter(batches)
    chunks = [evaluate(eval_step, model, remaining, metrics=MeanMetric(), limit_batches=3)]
    chunks.append(evaluate(eval_step, model, remaining, metrics=MeanMetric(), limit_batches=3))
    model.eval()
    with torch.no_grad():  # the plain loop over each chunk
        for chunk, part in zip(chunks, (batches[:3], batches[3:]), strict=True):
            losses = torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in part])
            assert chunk["MeanMetric"] == pytest.approx(losses.mean().item(), abs=1e-6)


def test_a_validation_loader_that_drops_its_last_batch_is_refused():
    # DataLoader(drop_last=True) left the last 2 of 10 samples out of every evaluation: the
    # metric was over 8, not the set, with nothing said.
    data = TensorDataset(torch.randn(10, 4), torch.randint(0, 3, (10,)))
    loader = DataLoader(data, batch_size=4, drop_last=True)
    eval_step = make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))
    message = r"drop_last=True, which leaves 2 of its 10 samples out.*Pass drop_last=False"
    with pytest.raises(ConfigError, match=message):
        evaluate(eval_step, _model(), loader, metrics=MeanMetric())
    with pytest.raises(ConfigError, match=message):  # when built, before any training
        Evaluator(eval_step, {"val": loader}, metrics=MeanMetric(), every=1)
    # Batches that divide the set drop nothing: accepted.
    evaluate(
        eval_step, _model(), DataLoader(data, batch_size=5, drop_last=True), metrics=MeanMetric()
    )


@pytest.mark.parametrize("sanity_batches", [2, 0])
def test_two_evaluators_that_write_one_name_are_refused_before_either_value_is_read(
    sanity_batches: int,
) -> None:
    # An EMA copy evaluated with the default prefix wrote its val_loss over the model's: a
    # checkpoint's metric=evaluator, EarlyStopping("val_loss") read the copy's as the model's.
    from steplib.checkpoint import checkpoint_every, list_checkpoints

    def build(prefix: str | None) -> tuple[TrainState, list[Evaluator]]:
        model = _model()
        state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        evaluators = [
            Evaluator(
                make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1])),
                _batches(2),
                metrics={"loss": MeanMetric()},
                every=2,
                model=other,
                sanity_batches=sanity_batches,
                **({"monitor": "val_loss"} if other is None else {"prefix": prefix}),
            )
            for other in (None, _model(seed=5))
        ]
        return state, evaluators

    step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    state, (own, copy) = build(prefix=None)
    ckpt = checkpoint_every(f"memory://{uuid.uuid4().hex}/ckpt", every=2, metric=own)
    with pytest.raises(ConfigError, match=r"both write 'val_loss'.*prefix='ema_val_'"):
        run(step, state, _batches(4), events=[own, copy, ckpt])
    assert list_checkpoints(ckpt.directory) == []  # nothing recorded the copy's value
    # A prefix of its own: each checkpoint records the model's own loss.
    state, (own, copy) = build(prefix="ema_val_")
    ckpt = checkpoint_every(f"memory://{uuid.uuid4().hex}/ckpt", every=2, metric=own)
    run(step, state, _batches(4), events=[own, copy, ckpt])
    recorded = [c.metrics["val_loss"] for c in list_checkpoints(ckpt.directory)]
    assert recorded == [values["val_loss"] for _, values in own.history]
    assert recorded != [values["ema_val_loss"] for _, values in copy.history]


def test_an_evaluator_built_with_every_and_registered_by_hand_is_refused_at_its_first_call() -> (
    None
):
    # events.on("step_end", evaluator) called it at every update: every=2 unused, an
    # evaluation (and a validation_end) at each update.
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    evaluator = Evaluator(
        make_eval_step(_eval_fn), _batches(2), metrics=_metrics(), every=2, sanity_batches=0
    )
    step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    with pytest.raises(ConfigError, match=r"every= unused.*events.add\(evaluator\)"):
        run(step, state, _batches(4), events=Events().on("step_end", evaluator))
    assert evaluator.history == []
    # Attached, its every= applies (to a fresh run: the refused one trained an update in place).
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    run(step, state, _batches(4), events=[evaluator])
    assert [at for at, _ in evaluator.history] == [2, 4]

"""Evaluation: an eval step, ``evaluate`` with torchmetrics, and the :class:`Evaluator` handler.

* :func:`make_eval_step` builds ``eval_step(state, batch) -> outputs``: the user's
  ``fn(model, batch)`` under ``torch.no_grad()``, with the model in eval mode (each submodule's
  previous mode is restored after) and autocast when asked.
* :func:`evaluate` feeds the outputs to torchmetrics metrics and returns their computed values.
  torchmetrics reduces across ranks itself when a process group is initialised.
* :class:`Evaluator` is the handler: every N updates and/or at epoch end, a sanity evaluation of
  a few batches before training, best-value tracking, one or several named validation sets
  (``data={"val": ..., "ood": ...}`` gives ``val_loss`` and ``ood_loss``). It writes the values into
  ``state.extras`` (so ``EarlyStopping`` and the checkpoint's best-N retention see them) and to
  log sinks.

Why ``no_grad`` and not ``inference_mode``: a tensor made under inference mode can never take
part in autograd, so a model that caches a tensor during evaluation (a rotary table, a mask)
would then fail in the next training step.

Imports ``events``, ``state``, ``errors`` and other handlers (never ``loop`` or ``step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric, MetricCollection

from steplib import errors
from steplib.distributed import is_main
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, NewState
from steplib.handlers.logging.base import Log, Logger, event_counters
from steplib.handlers.stopping import BestValue
from steplib.state import TrainState

EvalFn = Callable[[nn.Module, Any], Any]
Metrics = Metric | MetricCollection | Mapping[str, Metric]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` inside, and every submodule's own previous mode restored after (a model
    may keep some parts in eval mode on purpose, e.g. frozen batch norms).

    Args:
        model: the module to put in eval mode.

    Yields:
        ``model``, in eval mode.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> model[1].eval()
        Dropout(p=0.5, inplace=False)
        >>> with eval_mode(model):
        ...     model.training
        False
        >>> model.training, model[1].training
        (True, False)
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@dataclasses.dataclass(frozen=True, slots=True)
class EvalStep:
    """``eval_step(state_or_model, batch) -> fn(model, batch)`` without gradients, in eval mode.

    Build it with :func:`make_eval_step`.

    Attributes:
        fn: the user's ``fn(model, batch)``.
        autocast_dtype: the autocast dtype (``None``: full precision).
    """

    fn: EvalFn
    autocast_dtype: torch.dtype | None = None

    def __call__(self, state: TrainState | nn.Module, batch: Any) -> Any:
        """Run ``fn`` on one batch.

        Args:
            state: a ``TrainState`` (its model is used) or a module (e.g. an EMA copy).
            batch: whatever ``fn`` consumes.

        Returns:
            What ``fn`` returned.
        """
        model = _model_of(state)
        with eval_mode(model), torch.no_grad(), self.autocast(model):
            return self.fn(model, batch)

    def autocast(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for ``model``'s device (a no-op without ``autocast_dtype``)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        first = next(iter(model.parameters()), None)
        device = first.device.type if first is not None else "cpu"
        return torch.autocast(device, dtype=self.autocast_dtype)


def make_eval_step(fn: EvalFn, *, autocast_dtype: torch.dtype | None = None) -> EvalStep:
    """Build an eval step from ``fn(model, batch)``.

    ``fn`` returns what the metrics' ``update`` takes: a tuple is passed as positional
    arguments (``(preds, target)``), a dict as keyword arguments (a ``MetricCollection`` gives
    each metric the names its ``update`` accepts), anything else as the one argument.

    Args:
        fn: ``fn(model, batch)``.
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to run under autocast, as the
            train step does after ``amp_wrap(step, dtype=...)``; ``None`` for full precision.

    Returns:
        An :class:`EvalStep`: ``outputs = eval_step(state, batch)``.

    Raises:
        ConfigError: ``fn`` is not callable with ``(model, batch)``, or ``autocast_dtype`` is
            not bfloat16/float16/None.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> eval_step = make_eval_step(lambda m, b: m(b))
        >>> out = eval_step(model, torch.ones(3, 2))
        >>> out.shape, out.requires_grad, model.training
        (torch.Size([3, 1]), False, True)
    """
    errors.model_batch_fn("make_eval_step", "fn", fn, "x, y = batch; return model(x), y")
    if autocast_dtype is not None and autocast_dtype not in _FLOAT_DTYPES:
        raise ConfigError(
            f"make_eval_step(autocast_dtype=...) received {describe(autocast_dtype)}; pass "
            "torch.bfloat16 or torch.float16 (the train step's amp dtype), or None."
        )
    return EvalStep(fn=fn, autocast_dtype=autocast_dtype)


def as_metrics(metrics: Any, *, owner: str = "evaluate") -> Metric | MetricCollection:
    """``metrics`` as one torchmetrics object (a dict becomes a ``MetricCollection``; the
    metrics themselves are not copied).

    Args:
        metrics: a torchmetrics ``Metric``, ``MetricCollection`` or non-empty dict of ``Metric``.
        owner: the caller named in the error message.

    Returns:
        ``metrics`` itself, or a ``MetricCollection`` of the dict's metrics.

    Raises:
        ConfigError: something that is not a torchmetrics ``Metric``, ``MetricCollection`` or a
            dict of ``Metric``.

    Example:
        >>> import torchmetrics
        >>> type(as_metrics({"mse": torchmetrics.MeanSquaredError()})).__name__
        'MetricCollection'
    """
    if isinstance(metrics, Metric | MetricCollection):
        return metrics
    if isinstance(metrics, Mapping) and metrics:
        bad = {name: m for name, m in metrics.items() if not isinstance(m, Metric)}
        if not bad and all(isinstance(name, str) for name in metrics):
            return MetricCollection(dict(metrics))
        metrics = next(iter(bad.values())) if bad else metrics
    raise ConfigError(
        f"{owner}(metrics=...) received {describe(metrics)}, which is not a torchmetrics Metric. "
        "Pass a torchmetrics Metric, a MetricCollection, or a dict of them, e.g. "
        "metrics={'loss': torchmetrics.MeanMetric(), "
        "'acc': torchmetrics.classification.MulticlassAccuracy(num_classes=10)}."
    )


def evaluate(
    eval_step: Callable[[Any, Any], Any],
    state: TrainState | nn.Module,
    data: Iterable[Any],
    *,
    metrics: Metrics,
    limit_batches: int | None = None,
) -> dict[str, Any]:
    """Run ``eval_step`` over ``data``, update ``metrics`` with its outputs, return the values.

    The metrics are moved to the model's device, reset before and after. The whole loop runs
    under ``torch.no_grad()`` with the model in eval mode; both are restored after.

    Args:
        eval_step: from :func:`make_eval_step` (or any ``f(state, batch)``).
        state: the ``TrainState`` (its model is evaluated) or a module (e.g. ``ema.module``).
        data: an iterable of batches.
        metrics: a torchmetrics ``Metric``, ``MetricCollection`` or dict of ``Metric``.
        limit_batches: evaluate at most this many batches (``None``: all).

    Returns:
        ``{name: value}``: a dict's or collection's names (a single metric is named by its
        class, as ``MetricCollection`` names it); one-element tensors become numbers, larger
        ones lists; a metric that returns a dict gives ``name/key`` entries.

    Raises:
        ConfigError: bad ``metrics`` or ``limit_batches``; outputs the metrics cannot take
            (the message shows both).
        ValueError: ``data`` yielded no batches.

    Example:
        >>> import torchmetrics
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = torch.nn.init.zeros_(model.weight), torch.nn.init.ones_(model.bias)
        >>> eval_step = make_eval_step(lambda m, b: (m(b).squeeze(1), torch.zeros(len(b))))
        >>> data = [torch.ones(4, 2)] * 3
        >>> metrics = {"mse": torchmetrics.MeanSquaredError()}
        >>> evaluate(eval_step, model, data, metrics=metrics, limit_batches=2)
        {'mse': 1.0}
    """
    limit_batches = errors.optional_positive_int("evaluate", "limit_batches", limit_batches)
    collection = as_metrics(metrics)
    model = _model_of(state)
    first = next(iter(model.parameters()), None)
    if first is not None:
        collection.to(first.device)
    collection.reset()
    batches = 0
    with eval_mode(model), torch.no_grad():
        for batch in data:
            if limit_batches is not None and batches >= limit_batches:
                break
            _update(collection, eval_step(state, batch))
            batches += 1
    if batches == 0:
        raise ValueError(
            "evaluate: data yielded no batches, so there is nothing to compute. Pass a "
            "re-iterable with at least one batch (a DataLoader or a list)."
        )
    computed = collection.compute()
    collection.reset()
    if isinstance(collection, Metric):
        computed = {type(collection).__name__: computed}
    return _host_values(computed)


def _model_of(state: Any) -> nn.Module:
    if isinstance(state, nn.Module):
        return state
    model = getattr(state, "model", None)
    if isinstance(model, nn.Module):
        return model
    raise ConfigError(
        f"evaluation received {describe(state)} where a TrainState or an nn.Module was "
        "expected. Pass the state (its model is evaluated) or a module, e.g. ema.module."
    )


def _update(collection: Metric | MetricCollection, outputs: Any) -> None:
    try:
        if isinstance(outputs, tuple | list):
            collection.update(*outputs)
        elif isinstance(outputs, Mapping):
            collection.update(**outputs)
        else:
            collection.update(outputs)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"evaluate: the metrics could not take the eval step's outputs "
            f"({_shape_of(outputs)}): {error}. Make fn(model, batch) return what the metrics' "
            "update() takes: a tuple for positional arguments, e.g. (preds, target), or a dict "
            "of keyword arguments, e.g. {'preds': ..., 'target': ..., 'value': loss}."
        ) from error


def _shape_of(outputs: Any) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        return type(value).__name__

    if isinstance(outputs, tuple | list):
        return "(" + ", ".join(one(v) for v in outputs) + ")"
    if isinstance(outputs, Mapping):
        return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in outputs.items()) + "}"
    return one(outputs)


def _host_values(computed: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, value in computed.items():
        if isinstance(value, Mapping):
            values.update(_host_values(value, f"{prefix}{name}/"))
        elif isinstance(value, torch.Tensor):
            values[prefix + name] = value.item() if value.numel() == 1 else value.tolist()
        else:
            values[prefix + name] = value
    return values


class Evaluator:
    """Evaluate during training, as an event handler; register it with :meth:`attach`.

    On each evaluation the values (named ``prefix + name``: ``val_loss``) go into
    ``state.extras`` (the handler returns a ``NewState``), into :attr:`history`, and to the
    ``sinks``. With ``monitor``, the best value is tracked (:attr:`best`, :attr:`improved`) and
    ``best_<monitor>`` is added to the extras.

    Several validation sets: pass ``data={"val": val_loader, "ood": ood_loader}``. Each set is
    evaluated with the same metrics (reset between sets) and its values are named
    ``<set>_<metric>`` (``val_loss``, ``ood_loss``); ``monitor="ood_loss"`` tracks that one,
    and ``EarlyStopping("ood_loss")`` or ``export_best(monitor="ood_loss")`` watch it in the
    extras. One evaluation gives one history entry and one log record with every set's values.

    Args:
        eval_step: from :func:`make_eval_step`.
        data: the held-out batches (re-iterable), or a mapping ``{name: batches}`` of several
            sets.
        metrics: a torchmetrics ``Metric``, ``MetricCollection`` or dict of ``Metric``.
        every: evaluate every this many optimizer updates.
        at_epoch_end: evaluate at the end of each epoch (skipped when the last update was
            just evaluated).
        at_fit_end: evaluate when the run ends (skipped when the last update was just
            evaluated): the final weights always get a value.
        limit_batches: at most this many batches per evaluation.
        sanity_batches: at ``fit_start``, evaluate this many batches and discard the values,
            so that a broken eval step or a wrong ``monitor`` fails before the first update
            (0: no sanity evaluation). Avoid a shuffling loader here without its own generator:
            starting its iteration draws from the global RNG.
        prefix: put in front of every name; by default ``"val_"`` for one set and ``""`` for
            a mapping (whose set names already say which set a value is from).
        monitor: the (prefixed) name whose best value to track, e.g. ``"val_loss"``.
        mode: ``"min"`` or ``"max"``, for ``monitor``.
        model: evaluate this module instead of ``state.model`` (e.g. ``ema.module``).
        sinks: loggers that get ``{step, epoch, micro_step, time, values...}`` (rank 0).

    Raises:
        ConfigError: a bad argument: non-Metric metrics, ``every`` <= 0, neither ``every``
            nor ``at_epoch_end``, a ``mode`` other than min/max, an empty ``data`` mapping or
            one with a name that is not a non-empty string; at the first (sanity)
            evaluation, a ``monitor`` that is not among the values (the message lists them).

    Example:
        >>> import torchmetrics
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> evaluator = Evaluator(
        ...     make_eval_step(lambda m, b: m(b).pow(2)), [torch.ones(2, 2)],
        ...     metrics={"loss": torchmetrics.MeanMetric()}, every=2, monitor="val_loss")
        >>> state = run(step, state, [torch.ones(2, 2)] * 4, events=evaluator.attach(Events()))
        >>> [s for s, _ in evaluator.history], sorted(state.extras)
        ([2, 4], ['best_val_loss', 'val_loss'])
    """

    def __init__(
        self,
        eval_step: Callable[[Any, Any], Any],
        data: Iterable[Any],
        *,
        metrics: Metrics,
        every: int | None = None,
        at_epoch_end: bool = False,
        at_fit_end: bool = False,
        limit_batches: int | None = None,
        sanity_batches: int = 2,
        prefix: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        model: nn.Module | None = None,
        sinks: Logger | Sequence[Logger] = (),
    ) -> None:
        self.metrics = as_metrics(metrics, owner="Evaluator")
        self.every = errors.optional_positive_int("Evaluator", "every", every)
        if self.every is None and not at_epoch_end and not at_fit_end:
            raise ConfigError(
                "Evaluator received neither every=... nor at_epoch_end=True nor "
                "at_fit_end=True, so it would never evaluate. Pass Evaluator(..., every=500) "
                "and/or at_epoch_end=True."
            )
        errors.optional_positive_int("Evaluator", "limit_batches", limit_batches)
        if isinstance(sanity_batches, bool) or not isinstance(sanity_batches, int):
            raise ConfigError(
                f"Evaluator(sanity_batches=...) received {describe(sanity_batches)}; pass an "
                "int >= 0 (0 turns the sanity evaluation off)."
            )
        if sanity_batches < 0:
            raise ConfigError(f"Evaluator(sanity_batches={sanity_batches}) must be >= 0.")
        if not callable(eval_step):
            raise ConfigError(
                f"Evaluator(eval_step) received {describe(eval_step)}; build one with "
                "make_eval_step(fn)."
            )
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError(
                f"Evaluator(model=...) received {describe(model)}; pass a module (e.g. "
                "ema.module) or None to evaluate state.model."
            )
        self.eval_step = eval_step
        self.data = data
        # Named sets: their names say which set a value is from, so no "val_" by default.
        self.prefix = (
            prefix if prefix is not None else ("" if isinstance(data, Mapping) else "val_")
        )
        # Label -> set: the label goes in front of the metric names ("val_", "ood_").
        self.datasets = _named_datasets(data, self.prefix)
        self.at_epoch_end = at_epoch_end
        self.at_fit_end = at_fit_end
        self.limit_batches = limit_batches
        self.sanity_batches = sanity_batches
        self.monitor = monitor
        self.best = BestValue(mode=mode)
        self.improved = False
        self.model = model
        self._log = Log(sinks, sources=())
        self.history: list[tuple[int, dict[str, Any]]] = []
        self.sanity_values: dict[str, Any] | None = None
        self._evaluated_step: int | None = None

    def attach(self, events: Events) -> Events:
        """Register on ``fit_start`` (sanity), ``step_end`` (``every``), ``epoch_end`` and
        ``fit_end``, as configured.

        Returns:
            ``events``, so calls chain.
        """
        if self.sanity_batches:
            events.on("fit_start", self.sanity_check)
        if self.every is not None:
            events.on("step_end", self, every=self.every)
        if self.at_epoch_end:
            events.on("epoch_end", self.unless_evaluated)
        if self.at_fit_end:
            events.on("fit_end", self.unless_evaluated)
        return events

    def run(self, state: TrainState, *, limit_batches: int | None = None) -> dict[str, Any]:
        """Evaluate every set now and return the prefixed values (no state change, no
        logging)."""
        target = self.model if self.model is not None else state
        values: dict[str, Any] = {}
        for label, data in self.datasets.items():
            computed = evaluate(
                self.eval_step,
                target,
                data,
                metrics=self.metrics,  # evaluate resets them before and after each set
                limit_batches=limit_batches if limit_batches is not None else self.limit_batches,
            )
            values.update({label + name: value for name, value in computed.items()})
        return values

    def sanity_check(self, event: Event) -> None:
        """Evaluate ``sanity_batches`` batches; check ``monitor``; keep nothing but
        :attr:`sanity_values`."""
        self.sanity_values = self.run(event.state, limit_batches=self.sanity_batches)
        self._monitored(self.sanity_values)

    def __call__(self, event: Event) -> NewState:
        """Evaluate, record, log; return the state with the values in its extras."""
        values = self.run(event.state)
        self._evaluated_step = event.step
        self.history.append((event.step, values))
        extras = dict(event.state.extras)
        extras.update(values)
        monitored = self._monitored(values)
        if monitored is not None:
            self.improved = self.best.update(monitored, step=event.step)
            extras[f"best_{self.monitor}"] = self.best.value
        if is_main():
            self._log.write({**event_counters(event), **values})
        return NewState(event.state.replace(extras=types.MappingProxyType(extras)))

    def unless_evaluated(self, event: Event) -> NewState | None:
        """Evaluate unless this update was evaluated already (e.g. ``every`` divides it)."""
        if self._evaluated_step == event.step:
            return None
        return self(event)

    def close(self) -> None:
        """Close the sinks."""
        self._log.close()

    def _monitored(self, values: Mapping[str, Any]) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor not in values:
            raise ConfigError(
                f"Evaluator(monitor={self.monitor!r}) is not among the evaluated values; they "
                f"are: {', '.join(sorted(values))}. Pass one of those (names start with "
                f"{' or '.join(repr(label) for label in self.datasets)})."
            )
        return float(values[self.monitor])


def _named_datasets(data: Any, prefix: str) -> dict[str, Any]:
    """``{label: batches}``: one set labelled ``prefix``, or each set of a mapping labelled
    ``prefix + name + "_"``."""
    if not isinstance(data, Mapping):
        return {prefix: data}
    bad = [name for name in data if not isinstance(name, str) or not name]
    if not data or bad:
        raise ConfigError(
            f"Evaluator(data=...) received a mapping with the names {list(data)}; several "
            "validation sets need non-empty string names, which prefix their values. Pass "
            "e.g. data={'val': val_loader, 'ood': ood_loader} (values val_loss, ood_loss)."
        )
    return {f"{prefix}{name}_": batches for name, batches in data.items()}

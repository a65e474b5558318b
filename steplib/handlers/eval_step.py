"""The eval step and ``evaluate``: the user's function without gradients, fed to torchmetrics.

* :func:`make_eval_step` builds ``eval_step(state, batch) -> outputs``: the user's
  ``fn(model, batch)`` under ``torch.no_grad()``, with the model in eval mode (each submodule's
  previous mode is restored after) and autocast when asked.
* :func:`evaluate` feeds the outputs to torchmetrics metrics and returns their computed values.
  torchmetrics reduces across ranks itself when a process group is initialised.

The handler that evaluates during training is :class:`~steplib.handlers.evaluation.Evaluator`.

Why ``no_grad`` and not ``inference_mode``: a tensor made under inference mode can never take
part in autograd, so a model that caches a tensor during evaluation (a rotary table, a mask)
would then fail in the next training step.

Imports ``state`` and ``errors`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from steplib import errors
from steplib.data import on_model_device
from steplib.data.shards import ShardedSampler
from steplib.distributed.collectives import max_over_ranks
from steplib.errors import ConfigError, describe
from steplib.seeding import forked_rng
from steplib.state import TrainState

if TYPE_CHECKING:
    # torchmetrics (with matplotlib, and transformers where installed) costs more to import
    # than the rest of steplib: it is imported at the first evaluation, not with steplib.
    from torchmetrics import Metric, MetricCollection

    Metrics = Metric | MetricCollection | Mapping[str, Metric]

EvalFn = Callable[[nn.Module, Any], Any]

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


def make_eval_step(
    fn: EvalFn, *, autocast_dtype: torch.dtype | None = None, to_device: bool = False
) -> EvalStep:
    """Build an eval step from ``fn(model, batch)``.

    ``fn`` returns what the metrics' ``update`` takes: a tuple is passed as positional
    arguments (``(preds, target)``), a dict as keyword arguments (a ``MetricCollection`` gives
    each metric the names its ``update`` accepts), anything else as the one argument.

    Args:
        fn: ``fn(model, batch)``.
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to run under autocast, as the
            train step does after ``amp_wrap(step, dtype=...)``; ``None`` for full precision.
        to_device: move every tensor of each batch to the model's device first
            (``steplib.data.to_device``), as ``make_train_step(..., to_device=True)`` does.

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
    return EvalStep(fn=on_model_device(fn) if to_device else fn, autocast_dtype=autocast_dtype)


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
    from torchmetrics import Metric, MetricCollection

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
        "'acc': torchmetrics.classification.MulticlassAccuracy(num_classes=10, average='micro')}."
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
    under ``torch.no_grad()`` with the model in eval mode, and under a forked RNG
    (:func:`steplib.seeding.forked_rng`): what the loop draws from the global generators (a
    ``DataLoader``'s base seed, a shuffling sampler, the eval step itself) is forgotten after,
    so evaluating never changes what training draws next (law 10). All are restored after.

    Args:
        eval_step: from :func:`make_eval_step` (or any ``f(state, batch)``).
        state: the ``TrainState`` (its model is evaluated) or a module (e.g. ``ema.module``).
        data: an iterable of batches.
        metrics: a torchmetrics ``Metric``, ``MetricCollection`` or dict of ``Metric``.
        limit_batches: evaluate at most this many batches (``None``: all); no batch past
            them is pulled from ``data``, so an iterator goes on where the last call stopped.

    Returns:
        ``{name: value}``: a dict's or collection's names (a single metric is named by its
        class, as ``MetricCollection`` names it); one-element tensors become numbers, larger
        ones lists; a metric that returns a dict gives ``name/key`` entries.

    Raises:
        ConfigError: bad ``metrics`` or ``limit_batches``; outputs the metrics cannot take
            (the message shows both); a loader whose sampler repeats or drops samples to
            share the set among ranks (:func:`check_whole_set`).
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
    from torchmetrics import Metric

    limit_batches = errors.optional_positive_int("evaluate", "limit_batches", limit_batches)
    check_whole_set(data, owner="evaluate")
    collection = as_metrics(metrics)
    model = _model_of(state)
    first = next(iter(model.parameters()), None)
    if first is not None:
        collection.to(first.device)
    collection.reset()
    batches = 0
    # Under a forked RNG: what evaluation draws (a loader's base seed, a shuffle, the eval
    # step's own randomness) must not move training's generators (law 10).
    devices = [first.device] if first is not None else []
    with eval_mode(model), torch.no_grad(), forked_rng(devices):
        # islice: no batch past the limit is pulled (from an iterator, it would be lost).
        for batch in itertools.islice(data, limit_batches):
            _update(collection, eval_step(state, batch))
            batches += 1
    # Metrics that synchronise meet the other ranks in compute (a collective): the count of
    # batches is agreed there too, so a rank with none of the set (rank 0 alone evaluating, as
    # nanoGPT does) is a share like any other, and an empty set is refused on every rank alike.
    synced = [m for m in _metrics_of(collection) if m.sync_on_compute]
    if synced:
        device = None if first is None else first.device
        batches = int(max_over_ranks(batches, device=device, group=synced[0].process_group))
    if batches == 0:
        raise ValueError(
            "evaluate: data yielded no batches, so there is nothing to compute. Pass a "
            "re-iterable with at least one batch (a DataLoader or a list)."
        )
    with warnings.catch_warnings():  # torchmetrics' "compute before update", for an empty share
        warnings.filterwarnings("ignore", "The ``compute`` method", UserWarning)
        computed = collection.compute()
    collection.reset()
    if isinstance(collection, Metric):
        computed = {type(collection).__name__: computed}
    return _host_values(computed)


def _metrics_of(collection: Metric | MetricCollection) -> list[Metric]:
    from torchmetrics import Metric

    return [collection] if isinstance(collection, Metric) else list(collection.values())


def check_whole_set(data: Any, *, owner: str) -> None:
    """Refuse a loader whose sampler shares the set among ranks by repeating or dropping
    samples, or which drops a last, shorter batch (``drop_last=True``): the synchronised
    metrics would then be over other samples than the set's.

    ``DistributedSampler`` pads a set that the ranks do not divide with repeated samples
    (``drop_last=False``) or drops the rest (``drop_last=True``), and ``resumable_loader(...,
    shard=True)`` drops it: right for training, where an epoch only needs equal shares, wrong
    for a metric, which would count a repeated sample twice or leave a dropped one out.

    Args:
        data: the batches (a ``DataLoader`` is looked into; anything else passes).
        owner: the caller named in the error message.

    Raises:
        ConfigError: the loader's sampler repeats or drops samples, or it drops a last batch
            (the message gives the fix).

    Example:
        >>> from torch.utils.data import DataLoader, DistributedSampler
        >>> shares = DistributedSampler(range(5), num_replicas=2, rank=0, shuffle=False)
        >>> check_whole_set(DataLoader(range(5), sampler=shares), owner="evaluate")
        Traceback (most recent call last):
        ...
        steplib.errors.ConfigError: evaluate(data=...) received a DataLoader whose ...
    """
    batch_sampler: Any = getattr(data, "batch_sampler", None)
    if getattr(batch_sampler, "drop_last", False) is True:
        sampler, batch_size = batch_sampler.sampler, batch_sampler.batch_size
        size = len(sampler) if isinstance(sampler, Sized) else None  # an iterable set: unknown
        if size is None or size % batch_size:
            left = "an unknown number of" if size is None else f"{size % batch_size} of its {size}"
            raise ConfigError(
                f"{owner}(data=...) received a DataLoader with drop_last=True, which leaves "
                f"{left} samples out (the last, shorter batch of {batch_size}): the metrics "
                "would not be over the whole set. Pass drop_last=False (the default: a shorter "
                "last batch counts by its samples)."
            )
    for sampler in (getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            # total_size: the samples the ranks draw together (DistributedSampler's own count)
            size, ranks = len(cast(Sized, sampler.dataset)), sampler.num_replicas
            used = sampler.total_size
        elif isinstance(sampler, ShardedSampler):
            size, ranks = sampler.size, sampler.world_size
            used = size - size % ranks
        else:
            continue
        if used == size:
            continue
        what = f"repeats {used - size}" if used > size else f"drops {size - used}"
        raise ConfigError(
            f"{owner}(data=...) received a DataLoader whose {type(sampler).__name__} {what} of "
            f"the {size} samples to give each of {ranks} ranks an equal share, so the metrics "
            f"(synchronised over the ranks) would be over {used} samples, not the set's {size}. "
            "Give each rank its own share without padding: DataLoader(val_set, batch_size=..., "
            "sampler=range(rank, len(val_set), world_size)) (the metrics synchronise unequal "
            f"shares exactly), or a set whose length {ranks} divides."
        )


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

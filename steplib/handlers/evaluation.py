"""The :class:`Evaluator` handler: evaluate during training, on a schedule, into the state.

Every N updates and/or at epoch end, a sanity evaluation of a few batches before training,
best-value tracking, one or several named validation sets (``data={"val": ..., "ood": ...}``
gives ``val_loss`` and ``ood_loss``). It writes the values into ``state.extras`` (so
``EarlyStopping`` and the checkpoint's best-N retention see them) and to log sinks. The
evaluation itself is :func:`~steplib.handlers.eval_step.evaluate`.

Imports ``events``, ``state``, ``errors``, ``distributed`` and other handlers (never ``loop`` or
``step``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from steplib import errors
from steplib.cadence import Batches, check_every, check_not_by_hand, due
from steplib.data.shards import ShardedSampler
from steplib.distributed import is_main
from steplib.errors import ConfigError, describe
from steplib.events import Emitted, Event, Handler, NewState
from steplib.handlers.eval_sets import (
    combined_value,
    named_datasets,
    same_on_every_rank,
    weighted_mean,
)
from steplib.handlers.eval_step import as_metrics, check_whole_set, evaluate
from steplib.handlers.logging.base import Sink, event_counters
from steplib.handlers.logging.log import Log
from steplib.handlers.watched_value import BestValue, one_number
from steplib.state import EVALUATED_AT, TrainState

if TYPE_CHECKING:
    from steplib.handlers.eval_step import Metrics


class Evaluator(Handler):
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
    ``combine="loss"`` adds their weighted mean, ``mean_loss``, and monitors it: the one
    metric that ``EarlyStopping(evaluator)``, ``checkpoint_every(metric=evaluator)`` and
    ``best_checkpoint(directory, evaluator)`` then watch.

    After each evaluation (not the sanity one) the evaluator emits ``validation_end`` on the
    ``Events`` that emitted the event it evaluated at (``event.events``), with the recorded
    values in ``event.metrics`` and the state that holds them in ``event.state``; a ``Stop`` or
    ``NewState`` returned by those handlers reaches the loop.

    Args:
        eval_step: from :func:`~steplib.handlers.eval_step.make_eval_step`.
        data: the held-out batches (re-iterable), or a mapping ``{name: batches}`` of several
            sets.
        metrics: a torchmetrics ``Metric``, ``MetricCollection`` or dict of ``Metric``.
        every: evaluate every this many optimizer updates, or every n batches with
            ``Batches(n)`` (on the update holding the n-th batch).
        at_epoch_end: evaluate at the end of each epoch (skipped when the last update was
            just evaluated).
        at_fit_end: evaluate when the run ends (skipped when the last update was just
            evaluated): the final weights always get a value.
        limit_batches: at most this many batches per evaluation.
        sanity_batches: at ``fit_start``, evaluate this many batches and discard the values,
            so that a broken eval step or a wrong ``monitor`` fails before the first update
            (0: no sanity evaluation). Every evaluation runs under a forked RNG (law 10): what
            it draws, a shuffling loader's order included, never changes training's.
        prefix: put in front of every name; by default ``"val_"`` for one set and ``""`` for
            a mapping (whose set names already say which set a value is from).
        monitor: the (prefixed) name whose best value to track, e.g. ``"val_loss"``; with
            ``combine``, the combined value by default.
        mode: ``"min"`` or ``"max"``, for ``monitor``.
        combine: with several sets, the metric (e.g. ``"loss"``) whose weighted mean over the
            sets is recorded as ``prefix + "mean_" + combine`` (``mean_loss``).
        weights: ``{set name: weight >= 0}`` for ``combine``, one per set (``None``: equal);
            the combined value is ``sum(weight * value) / sum(weight)``.
        model: evaluate this module instead of ``state.model`` (e.g. ``ema.module``).
        sinks: loggers that get ``{step, epoch, micro_step, time, values...}`` (rank 0).

    Raises:
        ConfigError: a bad argument: non-Metric metrics, ``every`` <= 0, neither ``every``
            nor ``at_epoch_end``, a ``mode`` other than min/max, an empty ``data`` mapping or
            one with a name that is not a non-empty string, a set that is an iterator (it
            yields its batches once; pass a list or a DataLoader), ``combine`` without several sets,
            ``weights`` without ``combine`` or not one number >= 0 per set; a set whose
            sampler repeats or drops samples to share it among ranks (a
            ``DistributedSampler`` of a set the ranks do not divide); at the first
            (sanity) evaluation, a ``monitor`` or ``combine`` metric that is not among the
            values (the message lists them); at any evaluation in a process group of several
            ranks, a value that differs across the ranks (a metric not synchronised).

    Example:
        >>> import torch, torchmetrics
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.handlers import make_eval_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> evaluator = Evaluator(
        ...     make_eval_step(lambda m, b: m(b).pow(2)), [torch.ones(2, 2)],
        ...     metrics={"loss": torchmetrics.MeanMetric()}, every=2, monitor="val_loss")
        >>> state = run(step, state, [torch.ones(2, 2)] * 4, events=evaluator.attach(Events()))
        >>> [s for s, _ in evaluator.history], sorted(state.extras)
        ([2, 4], ['best_val_loss', 'evaluated_at', 'val_loss'])
    """

    def __init__(
        self,
        eval_step: Callable[[Any, Any], Any],
        data: Iterable[Any],
        *,
        metrics: Metrics,
        every: int | Batches | None = None,
        at_epoch_end: bool = False,
        at_fit_end: bool = False,
        limit_batches: int | None = None,
        sanity_batches: int = 2,
        prefix: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        model: nn.Module | None = None,
        sinks: Sink | Sequence[Sink] = (),
        combine: str | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.metrics = as_metrics(metrics, owner="Evaluator")
        self.every = check_every("Evaluator(every=...)", every)
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
        self.datasets = named_datasets(data, self.prefix)
        for batches in self.datasets.values():
            check_whole_set(batches, owner="Evaluator")
        # Label -> weight of the combined value, and its name; {} and None without combine.
        self.weights, self.combined = combined_value(data, self.prefix, combine, weights)
        self.combine = combine
        if monitor is None:
            monitor = self.combined
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
        self.names: frozenset[str] = frozenset()  # what it writes into extras, once evaluated

    @property
    def mode(self) -> str:
        """``"min"`` or ``"max"``: whether a lower or higher ``monitor`` is better."""
        return self.best.mode

    def on_fit_start(self, event: Event) -> None:
        """Refuse a closed sink (:meth:`~steplib.handlers.Log.check_open`), then the sanity
        evaluation (:meth:`sanity_check`), unless ``sanity_batches=0``.

        Raises:
            ConfigError: a sink is closed.
        """
        self._log.check_open()
        if self.sanity_batches:
            self.sanity_check(event)

    def on_step_end(self, event: Event) -> NewState | Emitted | None:
        """Evaluate every ``every`` updates (or batches)."""
        if self.every is None or not due(self.every, event):
            return None
        return self._evaluate(event)

    def on_epoch_end(self, event: Event) -> NewState | Emitted | None:
        """With ``at_epoch_end``: evaluate, unless this update was evaluated already."""
        return self.unless_evaluated(event) if self.at_epoch_end else None

    def on_fit_end(self, event: Event) -> NewState | Emitted | None:
        """With ``at_fit_end``: evaluate, unless this update was evaluated already."""
        return self.unless_evaluated(event) if self.at_fit_end else None

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
        if self.combined is not None:
            values[self.combined] = self._weighted_mean(values)
        same_on_every_rank(values)
        return values

    def sanity_check(self, event: Event) -> None:
        """Evaluate ``sanity_batches`` batches; check ``monitor``; keep nothing but
        :attr:`sanity_values`."""
        # The sets' orders as they were: the discarded pass must not change which samples,
        # in which order, the next evaluation draws (nor a resumed run's, which makes a
        # sanity pass of its own).
        drawn = self._orders()
        try:
            self.sanity_values = self.run(event.state, limit_batches=self.sanity_batches)
        finally:
            self._set_orders(drawn)
        self._check_names_apart(event, self.sanity_values)
        self._monitored(self.sanity_values)

    def __call__(self, event: Event) -> NewState | Emitted:
        """Evaluate, record, log; emit ``validation_end`` on ``event.events`` with the state that
        holds the values in its extras (and return that emission), or return that state when
        the event came from no ``Events``. ``ConfigError`` at a step event when built with
        ``every`` (registered by hand, it would evaluate at each call: attach it)."""
        check_not_by_hand("Evaluator", self.every, event, obj="evaluator")
        return self._evaluate(event)

    def _evaluate(self, event: Event) -> NewState | Emitted:
        values = self.run(event.state)
        self._check_names_apart(event, values)
        self._evaluated_step = event.step
        self.history.append((event.step, values))
        extras = dict(event.state.extras)
        extras.update(values)
        # Which update these values belong to: a later save must not record them as its own.
        # A new plain dict each time (a checkpoint holds plain data), never changed in place.
        extras[EVALUATED_AT] = {**extras.get(EVALUATED_AT, {}), **dict.fromkeys(values, event.step)}
        monitored = self._monitored(values)
        if monitored is not None:
            self.improved = self.best.update(monitored, step=event.step)
            extras[f"best_{self.monitor}"] = self.best.value
        if is_main():
            self._log.write({**event_counters(event), **values})
        state = event.state.replace(extras=types.MappingProxyType(extras))
        if event.events is None:
            return NewState(state)
        return event.events.emit(
            Event.at("validation_end", state, metrics=types.MappingProxyType(values))
        )

    def _check_names_apart(self, event: Event, values: Mapping[str, Any]) -> None:
        # Two evaluators writing one name: the later's value would stand for both, read by
        # name (EarlyStopping, a checkpoint's metric) as the other model's.
        self.names = frozenset(values)
        attached = event.events.attached() if event.events is not None else ()
        for index, other in enumerate(h for h in attached if isinstance(h, Evaluator)):
            if other is not self and (shared := sorted(self.names & other.names)):
                raise ConfigError(
                    f"Evaluator: this evaluator and Evaluator[{index}] both write "
                    f"{', '.join(map(repr, shared))} into state.extras, where the later's value "
                    "would replace the earlier's and be read by name (EarlyStopping, "
                    "checkpoint_every's metric, a Scheduler) as the other model's. Give one a "
                    "prefix of its own: Evaluator(..., prefix='ema_val_'); or, for a notebook "
                    "cell run again on one Events, events.remove(the_old_one) first."
                )

    def unless_evaluated(self, event: Event) -> NewState | Emitted | None:
        """Evaluate unless this update was evaluated already (e.g. ``every`` divides it)."""
        if self._evaluated_step == event.step:
            return None
        return self(event)

    def close(self) -> None:
        """Close the sinks."""
        self._log.close()

    def state_dict(self) -> dict[str, Any]:
        """What decides its later records: the best value and its step, whether the last
        evaluation improved it, the history, the last evaluated update, and what each set's
        next order is drawn from: its own generator's state (a shuffling ``DataLoader``'s or
        ``resumable_loader``'s) and a sharded loader's epoch. Attached to a run,
        it is saved with each checkpoint and restored on resume (``checkpoint.contents``).

        Example:
            >>> import torchmetrics
            >>> evaluator = Evaluator(lambda m, b: b, [], metrics=torchmetrics.MeanMetric(),
            ...                       every=10, monitor="val_mean")
            >>> evaluator.best.update(0.5, step=10)
            True
            >>> fresh = Evaluator(lambda m, b: b, [], metrics=torchmetrics.MeanMetric(),
            ...                   every=10, monitor="val_mean")
            >>> fresh.load_state_dict(evaluator.state_dict())
            >>> fresh.best.value, fresh.best.step
            (0.5, 10)
        """
        return {
            **self._built(),  # which evaluator's: checked at load
            "best": self.best.state_dict(),
            "improved": self.improved,
            "history": [[step, dict(values)] for step, values in self.history],
            "evaluated_step": self._evaluated_step,
            **self._orders(),  # "generators" and "samplers"
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ConfigError`` for another evaluator's,
        as a run attaching its evaluators in another order gives it: the run stops there)."""
        errors.same_handler("Evaluator", self._built(), state)
        self.best.load_state_dict(state["best"])
        self.improved = bool(state["improved"])
        self.history = [(int(step), dict(values)) for step, values in state["history"]]
        self._evaluated_step = state["evaluated_step"]
        self._set_orders(state)

    def _orders(self) -> dict[str, dict[str, Any]]:
        """What the order of each set's next pass is drawn from: its own generator's state,
        where it has one (``DataLoader(..., generator=...)``, ``resumable_loader``), and for a
        sharded ``resumable_loader(..., shard=True)`` its sampler's epoch (the order is drawn
        from ``seed + epoch``, and the generator reseeded from it, at every pass). A set
        without either draws from the global generators, which each evaluation forks (law 10).
        """
        generators, samplers = {}, {}
        for label, data in self.datasets.items():
            if isinstance(getattr(data, "generator", None), torch.Generator):
                generators[label] = data.generator.get_state()
            if isinstance(sampler := getattr(data, "sampler", None), ShardedSampler):
                samplers[label] = [sampler.epoch, sampler.offset, sampler.begun]
        return {"generators": generators, "samplers": samplers}

    def _set_orders(self, orders: Mapping[str, Any]) -> None:
        """Set the sets' orders to what :meth:`_orders` returned (either part may be absent
        from a state saved by an earlier steplib: the sets then draw from their seeds)."""
        for label, drawn in orders.get("generators", {}).items():
            if label in self.datasets:  # a checkpoint may hold it on another device
                generator = self.datasets[label].generator
                generator.set_state(torch.as_tensor(drawn, dtype=torch.uint8).cpu())
        for label, (epoch, offset, begun) in orders.get("samplers", {}).items():
            if label in self.datasets:
                sampler = self.datasets[label].sampler
                sampler.epoch, sampler.offset, sampler.begun = int(epoch), int(offset), bool(begun)

    def _built(self) -> dict[str, Any]:
        return {"labels": list(self.datasets), "monitor": self.monitor}

    def _monitored(self, values: Mapping[str, Any]) -> float | None:
        if self.monitor is None:
            return None
        if self.monitor not in values:
            raise ConfigError(
                f"Evaluator(monitor={self.monitor!r}) is not among the evaluated values; they "
                f"are: {', '.join(sorted(values))}. Pass one of those (names start with "
                f"{' or '.join(repr(label) for label in self.datasets)})."
            )
        return one_number("Evaluator", self.monitor, values[self.monitor])

    def _weighted_mean(self, values: Mapping[str, Any]) -> float:
        return weighted_mean(values, self.combine, self.weights)

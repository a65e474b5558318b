"""The validation sets of an :class:`~steplib.handlers.evaluation.Evaluator`: their labels,
the checks that each evaluation is over the whole set and the same on every rank, and the
weights of a combined value.

Imports ``errors`` and ``distributed`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from math import inf
from typing import Any

from steplib.distributed.collectives import first_other
from steplib.errors import ConfigError, describe


def same_on_every_rank(values: Mapping[str, Any], owner: str = "Evaluator") -> None:
    """Refuse values that differ across ranks (one ``all_gather_object`` per evaluation in a
    process group of several ranks): each rank would keep its own best, and early stopping,
    keep-best checkpoints and ``export_best`` would decide differently on each."""
    mine = {name: repr(value) for name, value in values.items()}  # repr: exact, NaN == NaN
    other = first_other(mine)
    if other is None:
        return
    rank, theirs = other
    name = next(name for name in mine if theirs.get(name) != mine[name])
    raise ConfigError(
        f"{owner}: {name} is {mine[name]} on this rank but {theirs.get(name)} on rank {rank}: "
        "a metric that is not synchronised gives each rank the value of its own share of the "
        "set, so each rank would keep its own best and early stopping would stop the ranks "
        "at different updates. Let torchmetrics synchronise it (its default, "
        "sync_on_compute=True), or give every rank the same value."
    )


def named_datasets(data: Any, prefix: str) -> dict[str, Any]:
    """``{label: batches}``: one set labelled ``prefix``, or each set of a mapping labelled
    ``prefix + name + "_"``."""
    if not isinstance(data, Mapping):
        re_iterable(data)
        return {prefix: data}
    bad = [name for name in data if not isinstance(name, str) or not name]
    if not data or bad:
        raise ConfigError(
            f"Evaluator(data=...) received a mapping with the names {list(data)}; several "
            "validation sets need non-empty string names, which prefix their values. Pass "
            "e.g. data={'val': val_loader, 'ood': ood_loader} (values val_loss, ood_loss)."
        )
    sets = {f"{prefix}{name}_": batches for name, batches in data.items()}
    for batches in sets.values():
        re_iterable(batches)
    return sets


def re_iterable(batches: Any) -> None:
    """Refuse an iterator: it yields its batches once, and every evaluation starts over."""
    if isinstance(batches, Iterator):
        raise ConfigError(
            f"Evaluator(data=...) received {describe(batches)}, an iterator, which yields its "
            "batches once: the sanity evaluation would take the first ones, the first "
            "evaluation only the rest, and every later evaluation none. Pass what each "
            "evaluation can iterate from its start: a DataLoader or a list of batches (e.g. "
            "data=list(batches))."
        )


def combined_value(
    data: Any, prefix: str, combine: Any, weights: Any
) -> tuple[dict[str, float], str | None]:
    """``({label: weight}, name)`` of the combined value, checked; ``({}, None)`` without
    ``combine``."""
    if combine is None:
        if weights is not None:
            raise ConfigError(
                f"Evaluator(weights=...) received {describe(weights)} without combine=...; the "
                "weights weigh the sets' values of one metric. Pass combine='loss' too."
            )
        return {}, None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"Evaluator(combine={combine!r}) needs several validation sets, but data is one "
            f"({describe(data)}). Pass data={{'wiki': wiki_loader, 'code': code_loader}}, or "
            "with one set leave combine out and monitor its value: monitor='val_loss'."
        )
    if not isinstance(combine, str) or not combine:
        raise ConfigError(
            f"Evaluator(combine=...) received {describe(combine)}; pass the name of the "
            "metric whose values to combine over the sets, e.g. combine='loss'."
        )
    if weights is None:
        weights = dict.fromkeys(data, 1.0)
    if not isinstance(weights, Mapping) or set(weights) != set(data):
        raise ConfigError(
            f"Evaluator(weights=...) received {describe(weights)}; it must give one weight per "
            f"validation set ({', '.join(map(repr, data))}), e.g. weights="
            f"{ {name: 1.0 for name in data} }."
        )
    for set_name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < inf:
            raise ConfigError(
                f"Evaluator(weights=...) received {describe(weight)} for the set {set_name!r}; "
                "a weight is a finite number >= 0 (0 leaves that set out of the mean), e.g. "
                f"weights={ {name: 1.0 for name in data} }."
            )
    numbers = {set_name: float(weight) for set_name, weight in weights.items()}
    if not sum(numbers.values()) > 0:
        raise ConfigError(
            f"Evaluator(weights={dict(weights)!r}) are all 0, so there is no weighted mean. "
            "Give at least one set a positive weight."
        )
    name = f"{prefix}mean_{combine}"
    if "mean" in data:
        raise ConfigError(
            f"Evaluator(combine={combine!r}): a validation set named 'mean' would give its "
            f"value the combined value's name {name!r}. Rename that set."
        )
    return {f"{prefix}{set_name}_": w for set_name, w in numbers.items()}, name


def weighted_mean(values: Mapping[str, Any], combine: Any, weights: Mapping[str, float]) -> float:
    """The combined value: ``sum(weight * value) / sum(weight)`` of each set's ``combine``
    value (``weights``: label -> weight, from :func:`combined_value`).

    Raises:
        ConfigError: a set's value is missing, or is a sweep's (a list, one per copy).
    """
    names = {label + str(combine): label for label in weights}
    missing = [name for name in names if name not in values]
    if missing:
        raise ConfigError(
            f"Evaluator(combine={combine!r}) found no {', '.join(map(repr, missing))} "
            f"among the evaluated values ({', '.join(sorted(values))}). Pass the name of "
            "one of the metrics, as the sets' values name it after their prefix."
        )
    for name in names:
        if isinstance(values[name], list | tuple):  # float() would fail with no word of why
            raise ConfigError(
                f"Evaluator(combine={combine!r}) weighs one number per set, and {name!r} is a "
                f"list of {len(values[name])} (a sweep's, one per copy), whose combined value "
                "would be one per copy, and the Evaluator would monitor it as one number. "
                "Leave combine out: each set's value is recorded per copy, and "
                f"SweepEarlyStopping({name!r}) or SuccessiveHalving({name!r}) watches one."
            )
    total = sum(weights.values())
    return sum(weights[label] * float(values[name]) for name, label in names.items()) / total

"""The exceptions steplib raises, and the argument checks that raise them, so that every part
of steplib words its errors the same way: what was received, why it is wrong and the fix.

Imports nothing from steplib, so every module may use it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any


class StepLibError(Exception):
    """Base class of every error steplib raises on purpose."""


class ConfigError(StepLibError, ValueError):
    """A bad argument or an impossible composition, found when the step or state is built."""


class LossFnError(StepLibError, TypeError):
    """The user's ``loss_fn`` returned something steplib cannot train on."""


class TooManySkipsError(StepLibError, RuntimeError):
    """Training diverged: ``skip_nonfinite`` saw more consecutive non-finite updates than it
    was allowed, or the float16 loss scale fell below ``amp_wrap``'s ``min_loss_scale``."""


class EmptyWindowError(StepLibError, RuntimeError):
    """A window held no targets and its update could not be skipped without a host read (a
    non-fused optimizer, nothing else deciding a skip): raised once a host copy of the count
    has landed, with the fix."""


class AnomalyError(StepLibError, RuntimeError):
    """The backward pass failed under ``detect_anomaly``; the message holds the forward
    traceback of the operation whose backward failed."""


class NonFiniteError(StepLibError, FloatingPointError):
    """``NonFiniteAlarm`` saw a NaN or infinite loss or gradient norm."""


class CheckpointError(StepLibError):
    """A checkpoint could not be written, found or read (I/O, a missing filesystem package)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match its manifest (truncated or altered)."""


class CheckpointWarning(UserWarning):
    """Part of a checkpoint was skipped: a corrupt checkpoint, for an older one (``latest``,
    ``resume_from``), or weights whose names the model lacks (``load_weights(strict=False)``)."""


class ExportError(StepLibError, RuntimeError):
    """Writing an export failed (on rank 0; the other ranks raise this too, so none hangs)."""


class LogWriteError(StepLibError, OSError):
    """A logger could not open, write or close its destination."""


def listed(items: Sequence[str], *, shown: int = 10) -> str:
    """``items`` joined, the first ``shown`` of them, and how many more."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def describe(value: object) -> str:
    """A short description of a received value for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (type {type(value).__name__})"


def boolean(owner: str, label: str, value: Any, choices: str) -> bool:
    """``value`` when it is a bool (``"no"`` or ``0`` would read as intended), else a
    ConfigError; ``choices`` says what True and False mean."""
    if not isinstance(value, bool):
        raise ConfigError(
            f"{owner}({label}=...) received {describe(value)}; it must be True or False: pass "
            f"{choices}."
        )
    return value


def optional_positive_int(owner: str, label: str, value: Any) -> int | None:
    """``None``, or :func:`positive_int` of ``value``."""
    return None if value is None else positive_int(owner, label, value)


def positive_int(owner: str, label: str, value: Any) -> int:
    """``value`` when it is an int >= 1, else a ConfigError that names ``owner(label=...)``,
    what was received and a working example."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{owner}({label}=...) received {describe(value)}; it must be a positive int "
            f"(>= 1), e.g. {owner}(..., {label}=10)."
        )
    return value


def non_negative(owner: str, label: str, value: Any) -> float:
    """``value`` as a float when it is a finite real number >= 0, else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(
            f"{owner}({label}=...) received {describe(value)}; it must be a number >= 0, "
            f"e.g. {owner}(..., {label}=0.0)."
        )
    if value == float("inf"):
        raise ConfigError(f"{owner}({label}=...) received inf; pass a finite number >= 0.")
    return float(value)


def mode(owner: str, value: Any) -> str:
    """``value`` when it is ``"min"`` or ``"max"``, else a ConfigError."""
    if value not in ("min", "max"):
        raise ConfigError(
            f"{owner}(mode=...) received {describe(value)}; mode says which direction is "
            f"better and must be 'min' (e.g. a loss) or 'max' (e.g. an accuracy): "
            f"{owner}(..., mode='min')."
        )
    return str(value)


def required_arguments(obj: Any, method: str) -> list[str]:
    """The names of the arguments that ``obj.method(...)`` cannot be called without (read from
    the class's function: LBFGS's ``step(closure)``, timm's ``Scheduler.step(epoch)``); ``[]``
    when it needs none or has no signature to read.

    Example:
        >>> import torch
        >>> required_arguments(torch.optim.LBFGS([torch.zeros(1, requires_grad=True)]), "step")
        ['closure']
        >>> required_arguments(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), "step")
        []
    """
    try:  # the class's: torch replaces an optimizer's bound step with a wrapper taking self
        parameters = list(inspect.signature(getattr(type(obj), method)).parameters.values())[1:]
    except (AttributeError, TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.default is p.empty and p.kind in positional]


def stepped_without_arguments(owner: str, scheduler: Any, when: str) -> None:
    """Raise ConfigError if ``scheduler.step()`` needs an argument (timm's ``step(epoch)``):
    ``owner`` calls it with none ``when``, which would fail there (at the first update, or
    the first epoch's end), not where it is built."""
    needed = required_arguments(scheduler, "step")
    if needed:
        kind = type(scheduler).__name__
        raise ConfigError(
            f"{owner} received {kind}, whose step() needs {', '.join(needed)}: {owner} calls "
            f"scheduler.step() {when}, with no argument. A scheduler told the count itself "
            "(timm's) is called from a handler, the state created without it: "
            "events.on('step_end', lambda e: scheduler.step_update(num_updates=e.step)) per "
            "update, or events.on('epoch_end', lambda e: scheduler.step(e.epoch)) per epoch "
            "(e.epoch: the epochs completed)."
        )


def model_batch_fn(owner: str, label: str, fn: Any, example: str) -> None:
    """Raise ConfigError unless ``fn`` is callable as ``fn(model, batch)``.

    ``example`` is the body of a working function, shown in the fix.
    """
    if not callable(fn):
        raise ConfigError(
            f"{owner} received {label}={describe(fn)}, which is not callable. Pass a "
            f"function: def {label}(model, batch): {example}"
        )
    try:
        inspect.signature(fn).bind(object(), object())
    except TypeError as err:
        raise ConfigError(
            f"{owner}: {label} {getattr(fn, '__name__', fn)!r} cannot be called as "
            f"{label}(model, batch) ({err}). Give it exactly two positional parameters: "
            f"def {label}(model, batch): ..."
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust the caller


def monitor_and_mode(owner: str, source: Any, mode: str | None) -> tuple[str, str]:
    """The monitored value's name and mode, from a name (``"val_loss"``; mode ``"min"`` unless
    given) or from an evaluator built with ``monitor=...`` (its name and mode), so that a metric
    is named once and shared by the evaluator, early stopping and keep-best checkpoints.

    Raises:
        ConfigError: neither a name nor an evaluator with a ``monitor``; a ``mode`` that
            contradicts the evaluator's.

    Example:
        >>> monitor_and_mode("EarlyStopping", "val_loss", None)
        ('val_loss', 'min')
    """
    if isinstance(source, str) and source:
        return source, "min" if mode is None else mode
    name, its_mode = getattr(source, "monitor", None), getattr(source, "mode", None)
    if not (isinstance(name, str) and name and isinstance(its_mode, str)):
        raise ConfigError(
            f"{owner} received {describe(source)} as the metric; pass the name of a value in "
            f"state.extras ('val_loss'), or an Evaluator built with monitor='val_loss' (its "
            "name and mode are then shared)."
        )
    if mode is not None and mode != its_mode:
        raise ConfigError(
            f"{owner} received mode={mode!r} with an evaluator that monitors {name!r} in mode "
            f"{its_mode!r}; leave mode out: the evaluator's is used."
        )
    return name, its_mode


def evaluator_attached(owner: str, evaluator: Any, events: Any) -> None:
    """Refuse an evaluator given to ``owner`` (``EarlyStopping(evaluator)``, ``Scheduler(...,
    metric=evaluator)``) that is not attached to the run's ``events``: it would never
    evaluate, so ``owner`` would never act, in silence.

    Raises:
        ConfigError: ``evaluator`` is not among ``events.attached()``.
    """
    if events is not None and not any(h is evaluator for h in events.attached()):
        raise ConfigError(
            f"{owner} was given an Evaluator that is not attached to this run, so it never "
            f"evaluates and {owner} would never act on its values. Attach the evaluator too: "
            "run(..., events=[evaluator, ...])."
        )


def same_mode(owner: str, name: str, mode: str, handlers: Any, *, fix: str) -> bool:
    """Refuse ``mode`` for the value ``name`` where another handler of the run that monitors
    it (an ``Evaluator`` built with ``monitor=name, mode=...``) ranks it the other way: one of
    the two would take the worst value for the best, in silence (a ``ReduceLROnPlateau`` in
    its default mode ``'min'`` fed an accuracy lowers the rate at each improvement;
    ``export_best`` in mode ``'min'`` keeps the least accurate model).

    Args:
        owner: the caller, for the message.
        name: the watched value's name (``"val_acc"``).
        mode: the caller's ``"min"`` or ``"max"``.
        handlers: the run's ``Events`` (its attached handlers; ``None``: none), or a list.
        fix: the literal fix, for the message.

    Returns:
        Whether a handler monitors ``name`` (it will score it: the name is not misspelt).

    Raises:
        ConfigError: a handler whose ``monitor`` is ``name`` has the other ``mode``.

    Example:
        >>> from types import SimpleNamespace
        >>> evaluator = SimpleNamespace(monitor="val_acc", mode="max")
        >>> same_mode("export_best", "val_acc", "max", [evaluator], fix="")
        True
        >>> same_mode("export_best", "val_acc", "min", [evaluator], fix="Pass mode='max'.")
        Traceback (most recent call last):
        ...
        steplib.errors.ConfigError: export_best ranks 'val_acc' in mode 'min' (lower is ...
    """
    if hasattr(handlers, "attached"):
        handlers = handlers.attached()
    for handler in handlers or ():
        its = getattr(handler, "mode", None)
        if getattr(handler, "monitor", None) == name and its in ("min", "max") and its != mode:
            better = "lower" if mode == "min" else "higher"
            raise ConfigError(
                f"{owner} ranks {name!r} in mode {mode!r} ({better} is better), but the "
                f"{type(handler).__name__} of this run that monitors it ranks it in mode "
                f"{its!r}: one of the two would take the worst value for the best. {fix}"
            )
    return any(getattr(handler, "monitor", None) == name for handler in handlers or ())


def reader_attached(owner: str, reader: Any, event: Any, example: str) -> None:
    """Refuse a log source that sums the updates since its last read (``TrainMetrics``,
    ``Throughput``, ``GradNormMonitor``) read at an event of a run it is not attached to: it
    saw only the updates it was read at, and would report them as the whole interval's (a
    ``Log(every=50)`` would write one update's loss as the mean of fifty), in silence.

    Args:
        owner: the reader's class name, for the message.
        reader: the reader whose ``read`` was called.
        event: the event it was read at.
        example: a variable name for the reader in the message's fix (``train``, ``speed``).

    Raises:
        ConfigError: ``event.events`` (the run's) does not hold ``reader``.
    """
    events = getattr(event, "events", None)
    if events is not None and not any(h is reader for h in events.attached()):
        raise ConfigError(
            f"{owner}.read was called at {event.name} (step {event.step}) of a run that this "
            f"{owner} is not attached to, so it saw only the updates it was read at, not every "
            "update since its last read. Attach it to the run as well: run(..., events=["
            f"{example}, Log(sinks, sources=[{example}.read], every=50)]), or "
            f"{example}.attach(events)."
        )


def step_optimizers(owner: str, event: Any) -> dict[str, str]:
    """For a handler that follows each step's optimizer (its window, the model it updates),
    in a run of several steps over a state of several optimizers: each step's name -> the name
    of the optimizer it updates (``make_train_step(..., optimizer="D")``; a step that names
    none, by its own name). ``{}`` for one step or a state of one optimizer.

    Raises:
        ConfigError: a step of the run (``fit_start``'s ``train_step``) updates no optimizer
            of ``event.state`` that it names or is named after: its window is not known.
    """
    names = getattr(event.state, "names", ())
    run = getattr(event, "train_step", None)
    if not names or not isinstance(run, Mapping):
        return {}
    found = {name: getattr(step, "optimizer", None) or name for name, step in run.items()}
    if unknown := [name for name, optimizer in found.items() if optimizer not in names]:
        raise ConfigError(
            f"{owner} follows the optimizer each step updates, but the run's steps {unknown} "
            f"name none of the state's optimizers {list(names)}. Build each step with the "
            f"optimizer it updates: make_train_step(loss_fn, optimizer={names[0]!r})."
        )
    return found


def same_handler(owner: str, built: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Refuse a saved handler state that a handler built otherwise wrote. ``built`` is what
    tells this handler from another of its class (an evaluator's sets and monitor, an EMA's
    decay); its ``state_dict`` saves it. A checkpoint matches a run's handlers of one class by
    their order, so another order, or other settings, would carry on from another handler's
    best, patience or averages, in silence.

    Raises:
        ConfigError: ``state`` records other settings (one it lacks counts as ``built``'s).

    Example:
        >>> same_handler("EarlyStopping", {"monitor": "val_loss"}, {"monitor": "val_loss"})
    """
    saved = {key: state.get(key, value) for key, value in built.items()}
    if saved != dict(built):
        settings = [", ".join(f"{k}={v!r}" for k, v in kept.items()) for kept in (built, saved)]
        raise ConfigError(
            f"{owner} built with {settings[0]} was given the state of one built with "
            f"{settings[1]}: a checkpoint matches a run's handlers of one class by their order, "
            "and this run attaches them in another order or built this one otherwise. Attach "
            "them, with their settings, as the run that saved it did; or load the state alone "
            "by hand, the handlers starting afresh: load(latest(directory), state)."
        )

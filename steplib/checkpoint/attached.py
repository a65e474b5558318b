"""What a run holds beyond its ``TrainState``, found without being named: the state of the
handlers attached to it and the position of its data.

One protocol: an object attached to the run's ``Events`` (``Events(evaluator, stopper)``,
``handler.attach(events)`` or ``events.on(name, handler)``) that has ``state_dict()`` and
``load_state_dict()`` is part of the run's state. ``checkpoint_every`` saves it with every
checkpoint and ``resume_from`` restores it: the evaluator's best and history, early stopping's
patience, ``export_best``'s best, ``TrainMetrics``' open interval, an ``EMA``, a handler of
yours. Each is keyed by its class name and its index among the attached objects of that class
(``Evaluator[0]``, ``Evaluator[1]``), so the same handlers built and attached in the same
order get the same keys after a restart. The data is the stateful loader (one with
``state_dict()`` / ``load_state_dict()``, e.g. ``steplib.data.resumable_loader``) that ``run``
draws from, which its ``fit_start`` event carries.

Imports ``errors``, ``events`` and the checkpoint package only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from steplib.checkpoint.contents import is_stateful
from steplib.errors import CheckpointWarning, ConfigError
from steplib.events import Event, Events

HANDLERS = "handlers"  # the name of the attached handlers' states among a checkpoint's objects


class HandlerStates:
    """The handlers with state attached to a run, by key; saved as one extra object.

    Args:
        handlers: ``{key: handler}``, each with ``state_dict()`` and ``load_state_dict()``.

    Example:
        >>> from steplib.handlers.stopping import EarlyStopping
        >>> states = HandlerStates({"EarlyStopping[0]": EarlyStopping("val_loss")})
        >>> states.state_dict()
        {'EarlyStopping[0]': {'best': {'value': None, 'step': None}, 'wait': 0, 'evaluations': 0}}
    """

    def __init__(self, handlers: Mapping[str, Any]) -> None:
        self.handlers = dict(handlers)

    def state_dict(self) -> dict[str, Any]:
        """Each handler's ``state_dict()`` by key."""
        return {key: handler.state_dict() for key, handler in self.handlers.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Load each handler's saved state (checked first by :meth:`check`)."""
        for key, handler in self.handlers.items():
            handler.load_state_dict(saved[key])

    def check(self, saved: Mapping[str, Any] | None, *, checkpoint: str) -> None:
        """Refuse a checkpoint whose saved handlers are not these (nothing is loaded then).

        ``saved`` is ``None`` for a checkpoint written before handler states were saved: it
        loads, and the handlers with state keep the state they were built with (a warning
        names them).

        Raises:
            ConfigError: a saved handler with no counterpart attached, or an attached handler
                with state that the checkpoint does not hold.
        """
        if saved is None:
            if self.handlers:
                warnings.warn(
                    f"checkpoint {checkpoint} was written before steplib saved the state of the "
                    f"handlers attached to a run; {', '.join(self.handlers)} start from the "
                    "state they were built with.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return
        missing, extra = sorted(saved.keys() - self.handlers), sorted(self.handlers - saved.keys())
        if not (missing or extra):
            return
        parts = [f"not attached now: {', '.join(missing)}"] if missing else []
        parts += [f"attached now, not in the checkpoint: {', '.join(extra)}"] if extra else []
        raise ConfigError(
            f"load: checkpoint {checkpoint} holds the state of the handlers "
            f"{sorted(saved) or 'none'}; the handlers with state attached to this run are "
            f"{sorted(self.handlers) or 'none'} ({'; '.join(parts)}). A resumed run continues "
            "the saved handlers: build and attach the same ones, in the same order, as the "
            "run that saved it (Events(resume_from(ckpt), evaluator, stopper, ckpt)); or load "
            "the state alone by hand: load(latest(directory), state)."
        )


def with_handlers(
    caller: str, extras: Mapping[str, Any] | None, events: Events | None
) -> dict[str, Any]:
    """``extras`` and, under :data:`HANDLERS`, the handlers with state attached to ``events``
    (leaving out those ``extras`` names already).

    Args:
        caller: the function's name, for the error message.
        extras: the objects named by the user (``checkpoint_every(extras=...)``), or ``None``.
        events: the run's ``Events``; ``None`` adds no handlers.

    Returns:
        The objects to save or load, by name.

    Raises:
        ConfigError: ``extras`` uses the reserved name ``"handlers"``.

    Example:
        >>> from steplib.handlers.stopping import EarlyStopping
        >>> stopper = EarlyStopping("val_loss")
        >>> objects = with_handlers("doc", None, Events().on("step_end", stopper, every=10))
        >>> sorted(objects[HANDLERS].handlers)
        ['EarlyStopping[0]']
    """
    named = dict(extras or {})
    if HANDLERS in named:
        raise ConfigError(
            f"{caller}(extras=...) received the name {HANDLERS!r}, which a checkpoint keeps for "
            "the state of the handlers attached to the run (saved without being named). Give "
            "that object another name."
        )
    if events is None:
        return named
    skip = {id(obj) for obj in named.values()}
    counts: dict[str, int] = {}
    found = {}
    for handler in events.attached():
        if id(handler) in skip or not is_stateful(handler):
            continue
        kind = type(handler).__name__
        counts[kind] = counts.get(kind, -1) + 1
        found[f"{kind}[{counts[kind]}]"] = handler
    return {**named, HANDLERS: HandlerStates(found)}


def run_data(data: Any, event: Event) -> Any:
    """The loader whose position to save or load: ``data`` if given, else the data of a
    ``fit_start`` event when it is a stateful loader, else ``None``.

    Example:
        >>> run_data(None, Event("fit_start", None, data=[1, 2, 3])) is None  # a list: no state
        True
    """
    if data is not None:
        return data
    return event.data if is_stateful(event.data) else None

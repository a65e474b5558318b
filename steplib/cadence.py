"""How often a handler runs: ``every=`` in optimizer updates (an int) or in batches
(:class:`Batches`), and :func:`due`, the one rule that the emitter and every handler with an
``every=`` of its own follow; the :class:`Registration` of a function on an event, with its
``every=`` / ``once=``. Imports ``errors`` only."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from steplib.errors import ConfigError, describe

# The counter that `every` (an int) and `once` count for each event; the others fire every time.
COUNTER = types.MappingProxyType(
    dict(micro_step_end="micro_step", step_end="step", epoch_start="epoch", epoch_end="epoch")
)
# The events whose every= may count batches (Batches(n)).
COUNTER_BATCHES = ("micro_step_end", "step_end")


@dataclasses.dataclass(frozen=True, slots=True)
class Batches:
    """A cadence counted in batches, for ``every=`` (a plain int counts optimizer updates):
    ``Evaluator(..., every=Batches(100))``, ``Log(sinks, every=Batches(10))``,
    ``checkpoint_every(dir, every=Batches(1000))``, ``events.on("step_end", f,
    every=Batches(10))``.

    At ``step_end`` it fires on the update whose window holds the n-th batch: with
    ``accumulate(step, 4)``, ``every=Batches(10)`` fires on the updates that hold batches 10,
    20, 30, ... (the 3rd, 5th, 8th, ...). At ``micro_step_end`` it fires on every n-th batch.
    Batches are counted over the whole run (``state.micro_step``, which a resume restores), not
    from 0 in each epoch.

    Attributes:
        n: the number of batches between two calls (an int >= 1).

    Raises:
        ValueError: ``n`` is not an int >= 1.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(
                f"Batches(n) received {self.n!r}; it is the number of batches between two "
                "calls and must be an int >= 1, e.g. every=Batches(10)."
            )


def due(every: int | Batches, event: Any) -> bool:
    """Whether ``event`` is on the cadence ``every``.

    Args:
        every: an int counts the event's counter (``step`` for ``step_end``, ``micro_step``
            for ``micro_step_end``, ``epoch`` for the epoch events); :class:`Batches` counts
            batches (``event.micro_step``, and ``event.batches``, those the event covers).
        event: an :class:`~steplib.events.Event`.

    Returns:
        ``True`` when a handler with this cadence runs at ``event``.

    Example:
        >>> from steplib.events import Event
        >>> due(2, Event("step_end", None, step=4)), due(3, Event("step_end", None, step=4))
        (True, False)

        Updates of 2 batches each: every 3 batches is the 2nd, 3rd, 5th, 6th, ... update.

        >>> [s for s in range(1, 7)
        ...  if due(Batches(3), Event("step_end", None, step=s, micro_step=2 * s, batches=2))]
        [2, 3, 5, 6]
    """
    if getattr(event, "flushed", False):
        return False  # a flush's micro_step_end: no micro-batch ran, so no cadence counts it
    if isinstance(every, Batches):
        # The event covers batches micro_step - batches + 1 .. micro_step: due when one of them
        # is a multiple of n.
        return bool(event.micro_step // every.n > (event.micro_step - event.batches) // every.n)
    return bool(getattr(event, COUNTER.get(event.name, "step")) % every == 0)


def check_every(call: str, every: Any, *, batches: bool = True) -> int | Batches | None:
    """``every`` when it is ``None``, an int >= 1 or (where ``batches``) a :class:`Batches`.

    Args:
        call: how the argument was passed, for the message (``"Evaluator(every=...)"``).
        every: the cadence received.
        batches: whether :class:`Batches` is accepted here.

    Returns:
        ``every``.

    Raises:
        ConfigError: anything else (says what was received and what to pass).

    Example:
        >>> check_every("Log(every=...)", Batches(10))
        Batches(n=10)
        >>> check_every("Log(every=...)", 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steplib.errors.ConfigError: Log(every=...) received 0 (type int); it must be ...
    """
    if every is None or (batches and isinstance(every, Batches)):
        return every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        counts = " or Batches(n) (batches)" if batches else ""
        example = " or every=Batches(100)" if batches else ""
        raise ConfigError(
            f"{call} received {describe(every)}; it must be a positive int (a number of "
            f"optimizer updates){counts}, e.g. every=100{example}."
        )
    return every


def check_every_or_once(
    name: str, every: Any, once: Any, handler: Any = None, registered: Sequence[Any] = ()
) -> None:
    """The checks of ``events.on(name, handler, every=..., once=...)``; ``registered``: the
    event's :class:`Registration` list.

    Raises:
        ConfigError: ``every`` is neither a positive int nor (step events) :class:`Batches`.
        ValueError: ``once`` not a positive int, both given, or given for an event that has no
            counter; ``handler`` registered for the event already, with the same cadence.
    """
    check_every(f"Events.on({name!r}, every=...)", every, batches=name in COUNTER_BATCHES)
    if once is not None and (isinstance(once, bool) or not isinstance(once, int) or once < 1):
        raise ValueError(
            f"Events.on({name!r}, once=...) received {once!r}; it must be a positive int, "
            "e.g. once=100."
        )
    if every is not None and once is not None:
        raise ValueError(
            f"Events.on({name!r}) received both every={every} and once={once}; choose one "
            "(register the handler twice to get both)."
        )
    if (every is not None or once is not None) and name not in COUNTER:
        raise ValueError(
            f"Events.on({name!r}) received every/once, but {name!r} has no counter to "
            "count them by; register it without them (its handler sees event.step). "
            f"every/once apply to: {', '.join(COUNTER)}."
        )
    for r in registered:  # it would run twice at each event; on two cadences, as asked
        if r.handler == handler and r.every == every and r.once == once:
            raise ValueError(
                f"Events.on({name!r}, ...) received {handler!r}, which is registered for "
                f"{name!r} already with every={every!r}, once={once!r}: it would run twice at "
                "each event (a notebook cell run again?). Register it once (events.remove("
                "handler) first to register it anew); for two cadences, give each its own "
                "every= or once=."
            )


def attached_to(handlers: Mapping[str, Sequence[Any]], obj: Any) -> bool:
    """Whether ``obj`` runs at some event of ``handlers`` (event name -> its
    :class:`Registration` list) already: added (it owns registrations), or one of its
    ``on_<event>`` methods registered by hand for that event (``events.on``)."""
    return any(
        r.owner is obj or (r.owner is None and r.handler == getattr(obj, f"on_{name}", None))
        for name, registrations in handlers.items()
        for r in registrations
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """One function registered on an event (``events.on``): when it runs, and for whom.

    Attributes:
        handler: the function of one event.
        every: ``every=``, or ``None``.
        once: ``once=``, or ``None``.
        owner: the handler object ``Events.add`` registered it for (``Events.remove``).
        last: whether it runs after the functions registered without ``last=True``.
        first: whether it runs before the functions registered without ``first=True``.
    """

    handler: Callable[[Any], Any]
    every: int | Batches | None
    once: int | None
    owner: Any
    last: bool
    first: bool = False

    def runs_at(self, event: Any) -> bool:
        """Whether it runs at ``event`` (an event without a counter, e.g. ``fit_end``:
        always)."""
        counter = COUNTER.get(event.name)
        if counter is None:
            return True
        if self.every is not None:
            return due(self.every, event)
        if self.once is None:
            return True
        # A flush's micro_step_end has the micro_step of the batch before it: not again.
        return not getattr(event, "flushed", False) and getattr(event, counter) == self.once

    def belongs_to(self, handler: Any) -> bool:
        """Whether removing ``handler`` removes it: the same function, or an object's."""
        # A bound method compares equal to another of the same object and function; an object
        # owns what was registered for it (its on_ methods, what its attach registered).
        return (
            self.handler == handler
            or self.owner is handler
            or getattr(self.handler, "__self__", None) is handler
        )


def placement(name: str, handler: Any, last: bool, first: bool) -> tuple[bool, bool]:
    """``(last, first)`` for ``events.on(name, handler, last=, first=)``: also ``True`` where
    the handler's object says so, as ``Events.add`` reads them.

    Raises:
        ValueError: both ``last`` and ``first``.
    """
    # An object given whole (the docs' events.on("fit_start", resume_from(...))) keeps the
    # place its class asks for: a resume after the others let them start from the fresh state
    # (an early stopper that had stopped trained on to its next check).
    owner = handler.__self__ if isinstance(handler, types.MethodType) else handler
    last = last or getattr(owner, "last", None) is True
    first = first or getattr(owner, "first", None) is True
    if last and first:
        raise ValueError(
            f"Events.on({name!r}, {handler!r}) was asked to run it last and first (by its "
            "arguments or its object's last/first): give one of the two, not both."
        )
    return last, first


def inserted(registrations: Sequence[Registration], new: Registration) -> list[Registration]:
    """A new list with ``new`` after its peers: ``first`` ones at the front, ``last`` at the end."""
    # A new list, not an insert: an emission under way iterates the old one (a handler
    # registered during it runs from the next event).
    old = list(registrations)
    last, first = new.last, new.first
    at = len(old) if last else sum(1 for r in old if r.first or not (first or r.last))
    return [*old[:at], new, *old[at:]]


def check_not_by_hand(owner: str, every: Any, event: Any, *, obj: str) -> None:
    """``ConfigError`` for a handler built with a cadence of its own (``every``) and called at a
    step event by hand (``events.on("step_end", obj)``): it would act at each call, its
    ``every`` unused. Attached, its own ``on_step_end`` applies it."""
    if every is not None and event.name in COUNTER_BATCHES:
        raise ConfigError(
            f"{owner}(every={every!r}) was called at {event.name} by hand (events.on("
            f"{event.name!r}, {obj})): it would act at each call, its every= unused. Attach "
            f"it (events.add({obj}), or the run's handler list), where its every= applies."
        )

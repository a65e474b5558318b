"""The event emitter and its payloads. Imports nothing from steplib but ``cadence``.

A handler is a plain function of one :class:`Event` (``events.on("step_end", fn)``), or an
object whose ``on_step_end``, ``on_fit_end``, ... methods ``Events(obj)`` registers. It may
return ``None``, a :class:`Stop` (the loop stops after the current step), or a
:class:`NewState` (the loop goes on with that state: how a resume handler swaps in a loaded
state). A handler that emits an event of its own on ``event.events`` (the evaluator's
``validation_end``, the checkpointer's ``checkpoint_end``) returns the :class:`Emitted` of that
emission, so that its handlers' state and stop reach the loop.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import steplib.cadence as cadence
from steplib.cadence import Batches, Registration, attached_to, check_every_or_once

EVENT_NAMES = (
    "fit_start", "epoch_start", "micro_step_end", "step_end", "epoch_end", "fit_end",
    "exception", "validation_end", "checkpoint_end",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """What a handler receives.

    Attributes:
        name: one of ``EVENT_NAMES``.
        state: the ``TrainState`` at the moment of the event.
        output: the ``StepOutput`` of the step call that caused it (``micro_step_end``,
            ``step_end``), else ``None``; in a run of several steps, the last step's.
        step: optimizer updates so far (``state.step``).
        micro_step: micro-batches so far (``state.micro_step``).
        epoch: completed epochs (``state.epoch``).
        batch_index: index of the batch within the epoch, for step events (counted from the
            epoch's start also in a pass that a ``resumable_loader`` continues).
        error: the exception, for ``exception``.
        metrics: the values an evaluation recorded (``{"val_loss": ...}``), for
            ``validation_end``.
        checkpoint: the ``CheckpointInfo`` (``url``, ``step``, ``epoch``, ``metrics``, ...) of
            the checkpoint just committed, for ``checkpoint_end``.
        data, train_step: for ``fit_start``, the batches ``run`` draws from and the step it
            calls (or its steps by name): a checkpoint saves their position and composition.
        events: the :class:`Events` emitting this event (:meth:`Events.emit` sets it): where a
            handler emits an event of its own and finds the attached handlers.
        outputs: in a run of several steps, each one's ``StepOutput`` by name (those that ran).
        batches: the batches this event covers, for step events: 1 for ``micro_step_end``
            (0 if ``flushed``), the update's window for ``step_end`` (``every=Batches(n)``).
        flushed: ``True`` at the ``micro_step_end`` a run of several steps emits after it
            flushed the windows open when unsized data ended (``outputs``: the steps whose
            window it closed, also one whose optimizer the run does not count, which no
            ``step_end`` carries): no micro-batch ran, so ``every=`` and ``once=`` skip it.
        closes_epoch: at step events, the epoch's ``epoch_end`` comes next (its last batch).
    """

    name: str
    state: Any
    output: Any = None
    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    batch_index: int | None = None
    error: BaseException | None = None
    metrics: Mapping[str, Any] | None = None
    checkpoint: Any = None
    data: Any = None
    train_step: Any = None
    events: Events | None = None
    outputs: Mapping[str, Any] | None = None
    batches: int = 0
    flushed: bool = False
    closes_epoch: bool = False

    @classmethod
    def at(cls, name: str, state: Any, **payload: Any) -> Event:
        """An event whose counters are ``state``'s (``step``, ``micro_step``, ``epoch``).

        Args:
            name: one of ``EVENT_NAMES``.
            state: the ``TrainState`` at the moment of the event.
            **payload: the other fields (``output``, ``metrics``, ``checkpoint``, ...).

        Example:
            >>> import types
            >>> state = types.SimpleNamespace(step=4, micro_step=8, epoch=1)
            >>> event = Event.at("validation_end", state, metrics={"val_loss": 0.5})
            >>> event.step, event.micro_step, event.epoch, event.metrics
            (4, 8, 1, {'val_loss': 0.5})
        """
        return cls(name, state, **_counters(state), **payload)


def _counters(state: Any, before: Event | None = None) -> dict[str, Any]:
    """``state``'s ``step``, ``micro_step`` and ``epoch`` (``before``'s, else 0, if it has none)."""
    return {k: getattr(state, k, getattr(before, k, 0)) for k in ("step", "micro_step", "epoch")}


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """Returned by a handler to stop the loop after the current step, with a reason.

    Attributes:
        reason: why the loop stopped, for the logs (e.g. ``"loss is NaN"``); when several
            handlers stop at the same event, :meth:`Events.emit` keeps the first.

    Example:
        >>> events = Events().on("step_end", lambda e: Stop("enough") if e.step >= 3 else None)
        >>> events.emit(Event("step_end", state=None, step=2)).stop is None
        True
        >>> events.emit(Event("step_end", state=None, step=3)).stop
        Stop(reason='enough')
    """

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class NewState:
    """Returned by a handler to replace the loop's state (e.g. with a loaded checkpoint).

    Attributes:
        state: the ``TrainState`` the loop goes on with; the handlers after this one see it
            too, with the event's counters taken from it.

    Example:
        >>> events = Events().on("fit_start", lambda e: NewState(state="loaded"))
        >>> events.emit(Event("fit_start", state="fresh")).state
        'loaded'
    """

    state: Any


class Handler:
    """The base of steplib's handler objects, optional for yours: :meth:`Events.add` registers
    the methods named ``on_<event>`` of any object. It adds :meth:`attach`, ``last``, ``first``.

    Attributes:
        last: ``True`` to register every ``on_`` method with ``last=True`` (a checkpoint's
            save: it must hold what the other handlers did at that event).
        first: ``True`` to register them with ``first=True`` (a resume: the others start from it).
    """

    last: bool = False
    first: bool = False

    def attach(self, events: Events) -> Events:
        """Register its ``on_<event>`` methods on ``events`` (``events.add(self)``); return it."""
        return events.add(self)


@dataclasses.dataclass(frozen=True, slots=True)
class Emitted:
    """The outcome of :meth:`Events.emit`: ``state`` after the handlers (the event's own, or
    one a handler swapped in) and ``stop``, the first :class:`Stop` one returned, or ``None``.
    A handler that emits an event of its own returns it: the emitter then goes on with its
    state (as for a :class:`NewState`) and keeps its stop (as for a :class:`Stop`)."""

    state: Any
    stop: Stop | None


class Events:
    """Handlers by event name, called in registration order (those registered with
    ``first=True`` before the others, with ``last=True`` after). Nothing is global.

    Args:
        *handlers: handler objects to :meth:`add` now, in order.

    Example:
        >>> events = Events()
        >>> seen = []
        >>> _ = events.on("step_end", lambda e: seen.append(e.step), every=2)
        >>> for s in range(1, 6):
        ...     _ = events.emit(Event("step_end", state=None, step=s))
        >>> seen
        [2, 4]
    """

    def __init__(self, *handlers: Any) -> None:
        self._handlers: dict[str, list[Registration]] = {name: [] for name in EVENT_NAMES}
        self._adding: Any = None  # the handler object add() is registering
        self.add(*handlers)

    def add(self, *handlers: Any) -> Events:
        """Register handler objects, in order: each one's methods named ``on_<event>`` (in
        ``EVENT_NAMES`` order), after its ``on_attach(events)`` if it has one (where it refuses
        a configuration), with its ``last`` and ``first``. A cadence is the handler's own
        (``if not due(self.every, event): return None``). An object whose class defines its
        own ``attach(events)`` is registered by calling it.

        Args:
            *handlers: objects with ``on_<event>`` methods, with or without :class:`Handler`.

        Returns:
            ``self``, so calls chain.

        Raises:
            ValueError: a handler with no ``on_<event>`` method (a plain function needs an
                event name: :meth:`on`), whose ``last`` or ``first`` is not a bool, or twice.

        Example:
            >>> from steplib.cadence import due
            >>> class Counter:  # no base class needed
            ...     calls = 0
            ...     def on_step_end(self, event):
            ...         if due(2, event):  # every 2 updates
            ...             self.calls += 1
            >>> counter = Counter()
            >>> events = Events(counter)  # or counter.attach(Events()) for a Handler
            >>> for s in range(1, 5):
            ...     _ = events.emit(Event("step_end", state=None, step=s))
            >>> counter.calls
            2
        """
        for handler in handlers:
            if self._adding is not handler and attached_to(self._handlers, handler):  # twice
                raise ValueError(f"Events received {handler!r} twice: attach each handler once.")
            outer, self._adding = self._adding, handler
            try:
                own = getattr(type(handler), "attach", None)
                # `outer is handler`: its own attach called add(self) (or Handler's, by super()).
                if callable(own) and own is not Handler.attach and outer is not handler:
                    handler.attach(self)
                else:
                    self._register(handler)
            finally:
                self._adding = outer
        return self

    def _register(self, handler: Any) -> None:
        found = [(name, getattr(handler, f"on_{name}", None)) for name in EVENT_NAMES]
        methods = [(name, method) for name, method in found if callable(method)]
        if not methods:
            raise ValueError(
                f"Events received the handler {handler!r}, which has no on_<event> method, so it "
                "does not say on which event it runs. Define one (on_step_end(self, event), "
                f"... for {', '.join(EVENT_NAMES)}), or register a plain function with "
                "events.on('step_end', handler, every=100)."
            )
        last, first = getattr(handler, "last", False), getattr(handler, "first", False)
        if not isinstance(last, bool) or not isinstance(first, bool) or (last and first):
            raise ValueError(
                f"Events received the handler {handler!r}, whose last is {last!r} and first "
                f"{first!r}: whether its on_ methods run after or before the others'. Make "
                "each True or False, not both True."
            )
        on_attach = getattr(handler, "on_attach", None)
        if callable(on_attach):
            on_attach(self)
        for name, method in methods:
            self.on(name, method, last=last, first=first)

    def remove(self, handler: Any) -> Events:
        """Unregister ``handler`` from every event: a function given to :meth:`on`, or a
        handler object given to :meth:`add` or attached with ``handler.attach(events)`` (all
        that was registered for it goes: its ``on_`` methods, what its ``on_attach`` added).

        Removing during an emission takes effect from the next event.

        Args:
            handler: the function or handler object to remove.

        Returns:
            ``self``, so calls chain.

        Raises:
            ValueError: ``handler`` is not registered (the message lists those that are).

        Example:
            >>> seen = []
            >>> record = seen.append
            >>> events = Events().on("step_end", record)
            >>> _ = events.emit(Event("step_end", state=None, step=1))
            >>> _ = events.remove(record).emit(Event("step_end", state=None, step=2))
            >>> [event.step for event in seen]
            [1]
        """
        found = False
        for name, registrations in self._handlers.items():
            kept = [r for r in registrations if not r.belongs_to(handler)]
            found = found or len(kept) < len(registrations)
            # A new list, not an in-place change: an emission under way iterates the old one.
            self._handlers[name] = kept
        if not found:
            pairs = [(name, r) for name, rs in self._handlers.items() for r in rs]
            registered = sorted({f"{name}: {r.handler!r}" for name, r in pairs})
            raise ValueError(
                f"Events.remove received {handler!r}, which is not registered on these Events "
                f"(registered: {'; '.join(registered) or 'nothing'}). Pass the same function "
                "given to events.on(...), or the handler object given to Events(...)/add(...)."
            )
        return self

    def on(
        self,
        name: str,
        handler: Callable[[Event], Any],
        *,
        every: int | Batches | None = None,
        once: int | None = None,
        last: bool = False,
        first: bool = False,
    ) -> Events:
        """Register ``handler`` for event ``name``, after those registered before it.

        Args:
            name: one of ``EVENT_NAMES``.
            handler: a callable taking one :class:`Event`.
            every: call it only when the event's counter is a multiple of this (``step`` for
                ``step_end``, ``micro_step`` for ``micro_step_end``, ``epoch`` for epoch events),
                or every n batches with :class:`Batches` (step events); see :func:`due`.
            once: call it only when the event's counter equals this.
            last: call it after every handler registered without ``last`` (a save: it holds
                what the others did at this event); also where its object says ``last = True``.
            first: call it before the handlers registered without ``first`` (a resume); also
                where its object says ``first = True`` (``resume_from``'s).

        Returns:
            ``self``, so registrations chain.

        Raises:
            ValueError: an unknown event name, a non-callable handler or one registered so
                already, ``every``/``once`` not a positive int, both, or with no counter; ``last``
                and ``first`` both.
        """
        if name not in self._handlers:
            raise ValueError(
                f"Events.on received the event name {name!r}, which does not exist. The events "
                f"are: {', '.join(EVENT_NAMES)}."
            )
        if not callable(handler):
            raise ValueError(
                f"Events.on({name!r}, handler) received a handler of type "
                f"{type(handler).__name__}, which is not callable. Pass a function of one "
                "Event: events.on(name, lambda event: ...)."
            )
        check_every_or_once(name, every, once, handler, self._handlers[name])
        place = cadence.placement(name, handler, last, first)
        new = Registration(handler, every, once, self._adding, *place)
        self._handlers[name] = cadence.inserted(self._handlers[name], new)
        return self

    def attached(self) -> list[Any]:
        """The handler objects registered, each once (by event, then in registration order):
        those given to :meth:`add`, and those whose methods or selves were given to :meth:`on`.

        Example:
            >>> Events().on("step_end", print).on("fit_end", print).attached() == [print]
            True
        """
        found: dict[int, Any] = {}
        for r in [r for registrations in self._handlers.values() for r in registrations]:
            method = r.handler if isinstance(r.handler, types.MethodType) else None
            obj = r.owner if r.owner is not None else method.__self__ if method else r.handler
            found.setdefault(id(obj), obj)
        return list(found.values())

    def has(self, name: str) -> bool:
        """Whether any handler is registered for ``name`` (lets the loop skip building payloads)."""
        return bool(self._handlers.get(name))

    def emit(self, event: Event) -> Emitted:
        """Call the handlers of ``event.name`` that want this event, in their order.

        The handlers see ``event.events`` set to these ``Events`` (where they emit an event of
        their own). A :class:`NewState` from one handler is seen by the handlers after it (the
        event's counters are taken from the new state). An :class:`Emitted` (a handler that
        emitted an event of its own) counts as its state and its stop. A handler added or
        removed during an emission counts from the next event.

        Args:
            event: the event; ``event.name`` says which handlers run.

        Returns:
            The state after the handlers, and the first :class:`Stop` requested (if any).
        """
        if event.events is not self:  # the loop's events have it already: no copy per step
            event = dataclasses.replace(event, events=self)
        state, stop = event.state, None
        for registration in self._handlers[event.name]:
            if not registration.runs_at(event):
                continue
            result = registration.handler(event)
            if isinstance(result, Emitted):
                stop = stop or result.stop
                result = NewState(result.state) if result.state is not state else None
            if isinstance(result, NewState):
                state = result.state
                # The counters follow the new state, so that later handlers' every/once and
                # event.step agree with event.state (a resumed state has other counters).
                event = dataclasses.replace(event, state=state, **_counters(state, event))
            elif isinstance(result, Stop):
                stop = stop or result
        return Emitted(state, stop)

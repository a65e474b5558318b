"""``run`` and ``iterate``: pull batches, call the step, emit events. Nothing else.

Imports ``state`` and ``events`` only; the step is used through its call signature
``step(state, batch, *, close_window=...)`` and ``step.flush(state)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Sequence
from typing import Any, Protocol

from steplib.events import Event, Events, Stop
from steplib.output import StepOutput
from steplib.state import TrainState


class StepLike(Protocol):
    """What the loop needs of a step (every ``Step`` is one)."""

    def __call__(
        self, state: TrainState, batch: Any, *, close_window: bool = False
    ) -> tuple[TrainState, StepOutput]: ...

    def flush(self, state: TrainState) -> tuple[TrainState, StepOutput | None]: ...


def iterate(
    step: StepLike,
    state: TrainState,
    data: Iterable[Any],
    *,
    events: Events | Sequence[Any] | None = None,
    max_steps: int | None = None,
    max_epochs: int | None = None,
) -> Generator[tuple[TrainState, StepOutput], None, TrainState]:
    """The loop as a generator: yields ``(state, output)`` after every step call.

    Each epoch is one pass over ``data``. On the last batch of a sized ``data`` the window is
    closed early (normalised by what it held); for unsized data an open window is flushed when
    the pass ends. Stops after ``max_steps`` optimizer updates (``state.step``), after
    ``max_epochs`` completed epochs (``state.epoch``), or when a handler returns ``Stop``.
    With neither limit given, it runs one epoch (as if ``max_epochs=state.epoch + 1``).

    Args:
        step: a ``Step``.
        state: the starting state (a resumed state continues from its counters).
        data: a re-iterable of batches (a DataLoader, a list); not a one-shot generator when
            more than one epoch is run.
        events: an :class:`Events`, or a list of handler objects (each attaches itself:
            ``events=[evaluator, ProgressBar()]``); ``None`` for none.
        max_steps: stop once ``state.step`` reaches this.
        max_epochs: stop once ``state.epoch`` reaches this.

    Yields:
        ``(state, output)`` after each call of the step (including a final flush).

    Returns:
        The final state (the generator's return value, which ``run`` returns): the last yielded
        state with the epoch counter advanced and any state swapped in by end handlers.

    Raises:
        ValueError: bad arguments (raised by the call itself, before the first ``next``), or
            ``data`` yields no batches in an epoch.

    Example:
        Three micro-batches, two per update: the last, shorter window is closed on the last
        batch of the epoch.

        >>> import torch
        >>> from steplib import TrainState, accumulate, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = accumulate(make_train_step(lambda m, b: m(b).pow(2).mean()), 2)
        >>> for state, out in iterate(step, state, [torch.ones(4, 2)] * 3):
        ...     print(state.micro_step, state.step, bool(out.did_update))
        1 0 False
        2 1 True
        3 2 True

        Breaking out of the loop is how a notebook stops early (``fit_end`` handlers still
        run); here it continues from the state above, at update 2:

        >>> for state, out in iterate(step, state, [torch.ones(4, 2)] * 10):
        ...     if state.step == 4:
        ...         break
        >>> state.micro_step, state.step
        (7, 4)
    """
    # Checked here, outside the generator body, so that a bad argument fails where iterate()
    # is called rather than at the first next(), possibly far away in a notebook.
    _check_args(step, data, max_steps, max_epochs)
    if not isinstance(events, Events):  # None, or a list of handler objects
        events = Events(*(events or ()))
    return _iterate(step, state, data, events, max_steps, max_epochs)


def _iterate(
    step: StepLike,
    state: TrainState,
    data: Iterable[Any],
    events: Events,
    max_steps: int | None,
    max_epochs: int | None,
) -> Generator[tuple[TrainState, StepOutput], None, TrainState]:
    start = Event("fit_start", state, data=data, events=events)
    state, stop = _emit(events, start, state)
    if max_steps is None and max_epochs is None:
        # One more epoch than the state (after a resume handler swapped it in) has completed:
        # an absolute max_epochs=1 would make a second run(step, state, data) do nothing.
        max_epochs = state.epoch + 1
    try:
        while stop is None and not _done(state, max_steps, max_epochs):
            state, stop = _emit(events, Event.at("epoch_start", state), state)
            if stop is not None:
                break
            total = _length(data)
            index = -1
            for index, batch in enumerate(data):
                close = total is not None and index == total - 1
                before = state.step
                state, out = step(state, batch, close_window=close)
                state, stop = _after_call(events, state, out, before, index)
                yield state, out
                # On the last batch fall through to the end of the epoch, so that a stop there
                # still counts the epoch as complete (a resume then starts the next one).
                if (stop is not None or _done(state, max_steps, None)) and not close:
                    break
            else:
                if index < 0:
                    raise ValueError(
                        f"iterate: data yielded no batches in epoch {state.epoch}. Pass a "
                        "re-iterable with at least one batch (a DataLoader or a list), not an "
                        "exhausted iterator or generator."
                    )
                before = state.step
                state, flushed = step.flush(state)
                if flushed is not None:
                    # No micro-batch ran, so only step_end: a second micro_step_end with the
                    # same micro_step would fire every/once handlers twice.
                    state, stop = _after_call(
                        events, state, flushed, before, index, micro_batch=False
                    )
                    yield state, flushed
                state = dataclasses.replace(state, epoch=state.epoch + 1)
                state, epoch_stop = _emit(events, Event.at("epoch_end", state), state)
                stop = stop or epoch_stop
        state, _ = _emit(events, Event.at("fit_end", state), state)
    except GeneratorExit:
        # The caller stopped iterating (a `break` in a notebook): the run ended by choice, so
        # handlers get to finish (close a progress bar, flush a log) as after a normal end.
        _emit(events, Event.at("fit_end", state), state)
        raise
    except BaseException as error:
        _emit(events, Event.at("exception", state, error=error), state)
        raise
    return state


def run(
    step: StepLike,
    state: TrainState,
    data: Iterable[Any],
    *,
    events: Events | Sequence[Any] | None = None,
    max_steps: int | None = None,
    max_epochs: int | None = None,
) -> TrainState:
    """Drive ``step`` over ``data`` and return the final state; see :func:`iterate`.

    Emits ``fit_start`` (with ``data`` and ``events`` in the event, where a checkpoint finds
    the loader and the handlers whose state it saves), then per epoch ``epoch_start``,
    ``micro_step_end`` after every step call, ``step_end`` after every update, ``epoch_end``,
    and finally ``fit_end`` (or ``exception``, then re-raises).

    Args:
        step: a ``Step`` (``make_train_step`` and its wrappers).
        state: the starting state (a resumed state continues from its counters).
        data: a re-iterable of batches (a DataLoader, a list); not a one-shot generator when
            more than one epoch is run.
        events: an :class:`Events`, or a list of handler objects (each attaches itself:
            ``events=[evaluator, ProgressBar()]``); ``None`` for none.
        max_steps: stop once ``state.step`` (optimizer updates) reaches this.
        max_epochs: stop once ``state.epoch`` (completed epochs) reaches this. With neither
            limit, one more epoch is run.

    Returns:
        The final state: counters advanced, and any state a handler swapped in (a resume).
        The model and optimizer objects are the ones in ``state``, updated in place.

    Raises:
        ValueError: bad arguments, or ``data`` yields no batches in an epoch.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> state = run(step, state, [torch.ones(4, 2)] * 3, max_epochs=2)
        >>> state.step, state.epoch
        (6, 2)
    """
    loop = iterate(step, state, data, events=events, max_steps=max_steps, max_epochs=max_epochs)
    while True:
        try:
            next(loop)
        except StopIteration as finished:
            final: TrainState = finished.value
            return final


def _after_call(
    events: Events,
    state: TrainState,
    out: StepOutput,
    step_before: int,
    index: int,
    *,
    micro_batch: bool = True,
) -> tuple[TrainState, Stop | None]:
    # An event is built only when a handler listens for it: a loop without step handlers pays
    # nothing per micro-batch.
    stop = None
    if micro_batch and events.has("micro_step_end"):
        event = Event.at("micro_step_end", state, output=out, batch_index=index)
        state, stop = _emit(events, event, state)
    if state.step != step_before and events.has("step_end"):  # a window closed: host ints
        event = Event.at("step_end", state, output=out, batch_index=index)
        state, step_stop = _emit(events, event, state)
        stop = stop or step_stop
    return state, stop


def _length(data: Iterable[Any]) -> int | None:
    # A DataLoader always has __len__, but over an IterableDataset without one, len() raises
    # TypeError: such data is unsized (its open window is flushed when the pass ends).
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def _emit(events: Events, event: Event, state: TrainState) -> tuple[TrainState, Stop | None]:
    if not events.has(event.name):
        return state, None
    emitted = events.emit(event)
    return emitted.state, emitted.stop


def _done(state: TrainState, max_steps: int | None, max_epochs: int | None) -> bool:
    return (max_steps is not None and state.step >= max_steps) or (
        max_epochs is not None and state.epoch >= max_epochs
    )


def _check_args(step: Any, data: Any, max_steps: Any, max_epochs: Any) -> None:
    if not callable(step) or not callable(getattr(step, "flush", None)):
        raise ValueError(
            f"run/iterate received step of type {type(step).__name__}, which is not a Step. "
            "Build one: step = make_train_step(loss_fn), then wrap it as you like."
        )
    if not hasattr(data, "__iter__"):
        raise ValueError(
            f"run/iterate received data of type {type(data).__name__}, which is not iterable. "
            "Pass a DataLoader, a list of batches, or any re-iterable."
        )
    for label, value in (("max_steps", max_steps), ("max_epochs", max_epochs)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"run/iterate received {label}={value!r}; it must be a positive int or None."
            )

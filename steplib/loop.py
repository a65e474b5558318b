"""``run`` and ``iterate``: pull batches, call the step (or several steps, in order, on
each batch), emit events. Nothing else.

Imports ``state``, ``output``, ``events`` and ``loop_checks`` only; a step is used through
its call signature ``step(state, batch, *, close_window=...)`` and ``step.flush(state)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from steplib.events import Event, Events, Stop
from steplib.loop_checks import check_args, check_run_start, limits_reached, warn_nothing_to_train
from steplib.loop_data import PULLING, TRAINED, Partial, after_error, begin_pass, keep_position
from steplib.output import StepOutput
from steplib.schedule_ends import check_run_length
from steplib.state import TrainState


class StepLike(Protocol):
    """What the loop needs of a step (every ``Step`` is one)."""

    def __call__(
        self, state: TrainState, batch: Any, *, close_window: bool = False
    ) -> tuple[TrainState, StepOutput]: ...

    def flush(self, state: TrainState) -> tuple[TrainState, StepOutput | None]: ...


Steps = Mapping[str, StepLike]
# feed={"G": fn}: fn(batch, earlier) is what G's step receives, where earlier maps the steps
# that ran before it on this batch to the aux their losses returned, graph and all.
Feed = Callable[[Any, Mapping[str, Mapping[str, torch.Tensor]]], Any]
# What iterate yields with the state: a StepOutput, or with several steps {name: StepOutput}
# (Any, so that a one-step loop reads out.loss without a cast).
Outputs = Any
# One call of the step(s) on a batch: (state, batch, close) -> (state, output, outputs or None).
_Call = Callable[[TrainState, Any, bool], tuple[TrainState, StepOutput, Any]]
_Flush = Callable[[TrainState], tuple[TrainState, StepOutput | None, Any]]


def iterate(
    step: StepLike | Steps,
    state: TrainState,
    data: Iterable[Any],
    *,
    events: Events | Sequence[Any] | None = None,
    max_steps: int | None = None,
    max_epochs: int | None = None,
    feed: Mapping[str, Feed] | None = None,
) -> Generator[tuple[TrainState, Outputs], None, TrainState]:
    """The loop as a generator: yields ``(state, output)`` after every call of the step(s).

    Each epoch is one pass over ``data``. On the last batch of a sized ``data`` the window is
    closed early (normalised by what it held); for unsized data an open window is flushed when
    the pass ends. Stops after ``max_steps`` optimizer updates (``state.step``), after
    ``max_epochs`` completed epochs (``state.epoch``), or when a handler returns ``Stop``.
    With neither limit given, it runs one epoch (as if ``max_epochs=state.epoch + 1``). The
    limits count from the run's start: given a state past them, it trains nothing and warns.

    Several steps (``{"D": d_step, "G": g_step}``) run in that order on each batch, over one
    state. The counters are the state's own (its first optimizer's: ``state.step``), so
    ``max_steps``, ``every=`` and ``step_end`` follow that optimizer's updates; the events
    carry the last step's output as ``event.output`` and every step's as ``event.outputs``.

    Args:
        step: a ``Step``; or several, by name, run in the mapping's order on each batch.
        state: the starting state (a resumed state continues from its counters).
        data: a re-iterable of batches (a DataLoader, a list); not a one-shot generator when
            more than one epoch is run.
        events: an :class:`Events`, or a list of handler objects (each attaches itself:
            ``events=[evaluator, ProgressBar()]``); ``None`` for none.
        max_steps: stop once ``state.step`` reaches this.
        max_epochs: stop once ``state.epoch`` reaches this.
        feed: with several steps, what a step receives instead of the batch, by its name:
            ``feed={"G": lambda batch, earlier: earlier["D"]["fake"]}`` gives G's step the
            ``fake`` that D's loss returned as aux (``return loss, {"fake": fake}``), graph and
            all, so G's loss back-propagates through the generator's forward that D's step ran.
            ``earlier`` maps the steps that ran before it on this batch to their aux.

    Yields:
        ``(state, output)`` after each call of the step (including a final flush); with
        several steps, ``(state, {name: output})``. A pass's last call is yielded after its
        ``epoch_end`` (``state.epoch`` counts it), so that a ``break`` there, like a stop at
        that update, leaves the epoch counted.

    Returns:
        The final state (the generator's return value, which ``run`` returns): the last yielded
        state with the epoch counter advanced and any state swapped in by end handlers.

    Raises:
        ValueError: bad arguments (raised by the call itself, before the first ``next``), or
            ``data`` yields no batches in an epoch; ``ConfigError`` (after ``fit_start``): the
            state's ``OneCycleLR`` ends before ``max_steps``.

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
        run); here it continues from the state above, at update 2. (A run stopped inside an
        epoch, or that raised there, leaves a stateful loader, ``resumable_loader``, at its
        position: a next run over it continues that epoch, as the uninterrupted run would,
        first with the batch a raising step was given. A list starts over.)

        >>> for state, out in iterate(step, state, [torch.ones(4, 2)] * 10):
        ...     if state.step == 4:
        ...         break
        >>> state.micro_step, state.step
        (7, 4)
    """
    # Checked here, outside the generator body, so that a bad argument fails where iterate()
    # is called rather than at the first next(), possibly far away in a notebook.
    check_args(step, state, data, max_steps, max_epochs, feed)
    if not isinstance(events, Events):  # None, or a list of handler objects
        events = Events(*(events or ()))
    return _iterate(step, feed or {}, state, data, events, max_steps, max_epochs)


def _one(step: StepLike) -> tuple[_Call, _Flush]:
    def call(state: TrainState, batch: Any, close: bool) -> tuple[TrainState, StepOutput, Any]:
        state, out = step(state, batch, close_window=close)
        return state, out, None

    def flush(state: TrainState) -> tuple[TrainState, StepOutput | None, Any]:
        state, out = step.flush(state)
        return state, out, None

    return call, flush


def _several(steps: Steps, feed: Mapping[str, Feed], partial: Partial) -> tuple[_Call, _Flush]:
    steps = dict(steps)  # the caller's dict may change later; this run's steps do not

    def call(state: TrainState, batch: Any, close: bool) -> tuple[TrainState, StepOutput, Any]:
        outs: dict[str, StepOutput] = {}
        for name, step in steps.items():
            given = batch
            if name in feed:
                earlier = {n: out.aux_with_graph for n, out in outs.items()}
                given = feed[name](batch, earlier)
            state, outs[name] = step(state, given, close_window=close)
            partial.state, partial.done = state, list(outs)  # if a later step raises
        partial.state = None
        return state, outs[name], outs

    def flush(state: TrainState) -> tuple[TrainState, StepOutput | None, Any]:
        outs: dict[str, StepOutput] = {}
        for name, step in steps.items():
            state, out = step.flush(state)
            if out is not None:
                outs[name] = out
        return state, (list(outs.values())[-1] if outs else None), outs

    return call, flush


def _iterate(
    step: StepLike | Steps,
    feed: Mapping[str, Feed],
    state: TrainState,
    data: Iterable[Any],
    events: Events,
    max_steps: int | None,
    max_epochs: int | None,
) -> Generator[tuple[TrainState, Outputs], None, TrainState]:
    partial = Partial()
    call, flush = _several(step, feed, partial) if isinstance(step, Mapping) else _one(step)
    given = state
    started = events.emit(Event("fit_start", state, data=data, train_step=step, events=events))
    state, stop = started.state, started.stop
    if max_steps is None and max_epochs is None:
        # One more epoch than the state (after a resume handler swapped it in) has completed:
        # an absolute max_epochs=1 would make a second run(step, state, data) do nothing.
        max_epochs = state.epoch + 1
    elif stop is None and started.state is given and limits_reached(state, max_steps, max_epochs):
        warn_nothing_to_train(state, max_steps, max_epochs)  # not a resume's: a cell run again
    # After fit_start: a resume handler may have loaded a scheduler and the modules' modes.
    check_run_length(state, step, data, max_steps=max_steps, max_epochs=max_epochs)
    call = check_run_start(state, step, call)  # eval mode; a data-parallel run's first batch
    # Where the open window started, in micro-batches: what an update's step_end covers
    # (every=Batches(n) counts them). A resumed state may hold an open window.
    opened = [state.micro_step - state.window.size]
    close = True  # whether the pass has no batch left
    # Inside a pass, where the batch the loader yielded last is: PULLING (being yielded),
    # the batch itself (the step runs on it: untrained if the step raises), TRAINED; outside
    # a pass, None. Where a run that raises leaves the data (loop_data.after_error).
    pulled: Any = None
    passing: Any = None  # the iterator of the pass: what iter(data) returned
    first, index, end = 0, -1, None  # in the epoch: the pass's first batch, the last, the end
    # A stateful loader over unsized data may continue a pass after its last batch: its end.
    continued = state.micro_step > 0 and hasattr(data, "load_state_dict") and _length(data) is None
    try:
        while stop is None and not limits_reached(state, max_steps, max_epochs):
            # A pass that continues an epoch from a loaded position (a resume, or a run going
            # on with a stopped one) gets no epoch_start: it ran where that epoch began, and a
            # handler that starts something per epoch (a hidden state set to zeros) would
            # otherwise start it again in the middle, which the uninterrupted run does not.
            first = begin_pass(data, state.epoch)
            if first == 0:
                state, stop = _emit(events, state, "epoch_start")
                if stop is not None:
                    break
            total = _length(data)
            index, end = first - 1, None if total is None else first + total
            # The outputs of the pass's last call(s), yielded once its epoch_end has run: a
            # `break` there then leaves the epoch counted, as a stop at that update does (else
            # a next run on the yielded state trained that epoch again).
            last: list[Outputs] = []
            pulled = PULLING
            passing = iter(data)
            for index, batch in enumerate(passing, start=first):  # the index within the epoch
                for output in last:  # a sized `data` that yields more than its len()
                    yield state, output
                last = []
                close = index + 1 == end
                before, pulled = state.step, batch
                state, out, outs = call(state, batch, close)
                pulled = TRAINED
                state, stop = _after_call(
                    events, state, out, outs, before, index, opened, closes=close
                )
                if close:
                    # Fall through to the end of the epoch, so that a stop here still counts
                    # the epoch as complete (a resume then starts the next one).
                    last.append(out if outs is None else outs)
                else:
                    yield state, out if outs is None else outs
                    if stop is not None or limits_reached(state, max_steps, None):
                        keep_position(data, passing, at=index + 1, end=end)
                        pulled = None  # the position is kept
                        break
                pulled = PULLING
            else:
                pulled = None
                # A pass that continues its epoch (first > 0) may hold no batch: a run that
                # raised at the epoch's last update left it, and this one ends that epoch.
                if index < 0 and not continued:
                    raise ValueError(
                        f"iterate: data yielded no batches in epoch {state.epoch}. Pass a "
                        "re-iterable with at least one batch (a DataLoader or a list), not an "
                        "exhausted iterator or generator."
                    )
                before, close, continued = state.step, True, False  # the pass has ended
                state, flushed, outs = flush(state)
                if flushed is not None:
                    # step_end if the counted optimizer updated; with several steps first a
                    # micro_step_end marked flushed (see _after_call).
                    state, flush_stop = _after_call(
                        events, state, flushed, outs, before, index, opened, flushed=True
                    )
                    stop = stop or flush_stop
                    last.append(flushed if outs is None else outs)
                state = dataclasses.replace(state, epoch=state.epoch + 1)
                state, epoch_stop = _emit(events, state, "epoch_end")
                stop = stop or epoch_stop
                for output in last:
                    yield state, output
        state, _ = _emit(events, state, "fit_end")
    except GeneratorExit:
        # The caller stopped iterating (a `break` in a notebook): the run ended by choice, so
        # handlers get to finish (close a progress bar, flush a log) as after a normal end.
        if not close:  # inside a pass
            keep_position(data, passing, at=index + 1, end=end)
        _emit(events, state, "fit_end")
        raise
    except BaseException as error:
        if (newest := partial.taken(error, step)) is not None:
            state, pulled = newest, TRAINED
        after_error(data, passing, error=error, pulled=pulled, at=index + 1, end=end)
        _emit(events, state, "exception", error=error)
        raise
    return state


def run(
    step: StepLike | Steps,
    state: TrainState,
    data: Iterable[Any],
    *,
    events: Events | Sequence[Any] | None = None,
    max_steps: int | None = None,
    max_epochs: int | None = None,
    feed: Mapping[str, Feed] | None = None,
) -> TrainState:
    """Drive ``step`` over ``data`` and return the final state; see :func:`iterate`.

    Emits ``fit_start`` (with ``data``, ``train_step`` and ``events``: where a checkpoint finds
    the loader, the step(s) and the handlers whose state it saves), then per epoch ``epoch_start``
    (not for the rest of an epoch that a ``resumable_loader`` continues from a loaded position:
    the uninterrupted run had it once, before the epoch's first batch), ``micro_step_end`` after
    every call of the step(s) (with several steps, also after a flush: ``event.flushed``),
    ``step_end`` after every update, ``epoch_end``, and finally ``fit_end`` (or
    ``exception``, then re-raises).

    Args:
        step: a ``Step`` (``make_train_step`` and its wrappers); or several steps over one
            state, by name, run in that order on each batch (``{"D": d_step, "G": g_step}``).
        state, data, events, max_steps, max_epochs, feed: as for :func:`iterate`.

    Returns:
        The final state: counters advanced, and any state a handler swapped in (a resume).
        The model and optimizer objects are the ones in ``state``, updated in place.

    Raises:
        ValueError: bad arguments, or ``data`` yields no batches in an epoch; ``ConfigError``:
            the state's ``OneCycleLR`` ends before ``max_steps``.

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
    loop = iterate(
        step, state, data, events=events, max_steps=max_steps, max_epochs=max_epochs, feed=feed
    )
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
    outs: Mapping[str, StepOutput] | None,
    step_before: int,
    index: int,
    opened: list[int],
    *,
    flushed: bool = False,
    closes: bool = False,
) -> tuple[TrainState, Stop | None]:
    closes = closes or flushed  # a flush is at a pass's end: its epoch_end comes next
    # An event is built only when a handler listens for it (_emit): a loop without step
    # handlers pays nothing per micro-batch.
    stop = None
    # A flush ran no micro-batch. One step's flush is the counted optimizer's update, which
    # its step_end carries. Several steps' flush may close a window of a step whose optimizer
    # is not counted (D's, with G counted), which no step_end carries: a micro_step_end marked
    # flushed (covering no batch, skipped by every=/once=) brings it to the readers (the
    # metrics, the bar, the alarm, an EMA of that step's model).
    if events.has("micro_step_end") and (not flushed or outs is not None):
        state, stop = _emit(
            events, state, "micro_step_end", output=out, outputs=outs, batch_index=index,
            batches=0 if flushed else 1, flushed=flushed, closes_epoch=closes,
        )  # fmt: skip
    if state.step != step_before:  # a window closed: host ints
        covered = state.micro_step - opened[0]
        opened[0] = state.micro_step
        state, step_stop = _emit(
            events, state, "step_end", output=out, outputs=outs, batch_index=index,
            batches=covered, closes_epoch=closes,
        )  # fmt: skip
        stop = stop or step_stop
    return state, stop


def _length(data: Iterable[Any]) -> int | None:
    # A DataLoader always has __len__, but over an IterableDataset without one, len() raises
    # TypeError: such data is unsized (its open window is flushed when the pass ends).
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


def _emit(
    events: Events, state: TrainState, name: str, **payload: Any
) -> tuple[TrainState, Stop | None]:
    if not events.has(name):
        return state, None
    # The event carries `events`, so that Events.emit need not copy it to set it.
    emitted = events.emit(Event.at(name, state, events=events, **payload))
    return emitted.state, emitted.stop

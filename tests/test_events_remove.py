"""``Events.remove``, changes to the handlers during an emission, and a handler that emits an
event of its own (returning the ``Emitted``)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from steplib import Event, Events, NewState, Stop
from steplib.events import Emitted


def _step(events: Events, step: int) -> Emitted:
    return events.emit(Event("step_end", state=None, step=step))


class _Recorder:
    """A handler object registering two bound methods and a closure."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def attach(self, events: Events) -> Events:
        events.on("step_end", self.on_step)
        events.on("epoch_end", self.on_epoch)
        return events.on("fit_end", lambda e: self.seen.append(("fit", e.step)))

    def on_step(self, event: Event) -> None:
        self.seen.append(("step", event.step))

    def on_epoch(self, event: Event) -> None:
        self.seen.append(("epoch", event.epoch))


def test_remove_unregisters_a_function_and_keeps_the_others_in_order() -> None:
    seen: list[str] = []

    def first(event: Event) -> None:
        seen.append("first")

    events = Events().on("step_end", first).on("step_end", lambda e: seen.append("second"))
    assert events.remove(first) is events
    _step(events, 1)
    assert seen == ["second"]
    assert not Events().on("fit_end", first).remove(first).has("fit_end")


@pytest.mark.parametrize("how", ["add", "attach"])
def test_remove_unregisters_everything_a_handler_objects_attach_registered(how: str) -> None:
    recorder, other = _Recorder(), _Recorder()
    events = Events(recorder, other) if how == "add" else other.attach(recorder.attach(Events()))
    events.remove(recorder)
    for name in ("step_end", "epoch_end", "fit_end"):
        events.emit(Event(name, state=None, step=3, epoch=1))
    # The closure is removed only when add() saw which object registered it.
    assert recorder.seen == ([] if how == "add" else [("fit", 3)])
    assert other.seen == [("step", 3), ("epoch", 1), ("fit", 3)]


def test_removing_what_is_not_registered_names_it_and_what_is() -> None:
    def registered(event: Event) -> None:
        return None

    def stranger(event: Event) -> None:
        return None

    events = Events().on("step_end", registered)
    with pytest.raises(ValueError, match=r"received <function .*stranger.*not registered.*"):
        events.remove(stranger)
    with pytest.raises(ValueError, match=r"step_end: <function .*registered"):
        events.remove(stranger)
    events.remove(registered)
    with pytest.raises(ValueError, match=r"registered: nothing"):
        events.remove(registered)  # a second removal


def test_a_removal_during_an_emission_takes_effect_from_the_next_event() -> None:
    seen: list[tuple[str, int]] = []
    events = Events()

    def later(event: Event) -> None:
        seen.append(("later", event.step))

    def remover(event: Event) -> None:
        seen.append(("remover", event.step))
        events.remove(remover).remove(later)
        events.on("step_end", lambda e: seen.append(("added", e.step)))

    events.on("step_end", remover).on("step_end", later)
    _step(events, 1)
    _step(events, 2)
    # At step 1 the emission calls the handlers it started with (the removed `later` too, not
    # the added one); from step 2 on only the added one runs.
    assert seen == [("remover", 1), ("later", 1), ("added", 2)]


def test_a_handler_returning_its_own_emission_passes_on_its_state_and_stop() -> None:
    start, new = types.SimpleNamespace(step=1), types.SimpleNamespace(step=5)
    inner = Events()
    inner.on("validation_end", lambda e: NewState(new))
    inner.on("validation_end", lambda e: Stop("from the inner handler"))
    seen: list[Any] = []
    outer = Events()
    outer.on("step_end", lambda e: inner.emit(Event.at("validation_end", e.state)))
    outer.on("step_end", lambda e: seen.append((e.state, e.step)))
    outer.on("step_end", lambda e: Stop("later"))
    emitted = outer.emit(Event.at("step_end", start))
    assert emitted == Emitted(new, Stop("from the inner handler"))
    assert seen == [(new, 5)]
    # An emission that changed nothing leaves the state and asks for no stop.
    quiet = Events().on("step_end", lambda e: Events().emit(Event.at("checkpoint_end", e.state)))
    assert quiet.emit(Event.at("step_end", start)) == Emitted(start, None)

"""One handler convention: ``Events.add`` registers a handler's ``on_<event>`` methods (in
``EVENT_NAMES`` order), all ``last`` when its class says so, after its ``on_attach`` hook; a
cadence is the handler's own (``due``); the emitter sets ``event.events`` on what it emits."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from torchmetrics import MeanMetric

from steplib import ConfigError, Evaluator, Events, make_eval_step, make_train_step, run
from steplib.cadence import due
from steplib.checkpoint import checkpoint_every, preemption
from steplib.events import EVENT_NAMES, Event, Handler
from steplib.handlers import EarlyStopping, Log
from tests.checkpoint_helpers import make_state
from tests.reference import make_batches, mean_loss


class Everything:
    """A duck-typed handler (no base class) with a method for every event, written in the
    reverse order of EVENT_NAMES."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("on_") and attribute[3:] in EVENT_NAMES:
            return lambda event: self.seen.append(event.name)
        raise AttributeError(attribute)


class RecordingEvents(Events):
    """Events that record the order of the registrations add() makes."""

    def __init__(self) -> None:
        self.names: list[str] = []
        super().__init__()

    def on(self, name: str, handler: Any, **options: Any) -> Events:
        self.names.append(name)
        return super().on(name, handler, **options)


def _emit_all(events: Events) -> None:
    for name in EVENT_NAMES:
        events.emit(Event(name, state=None, step=1, micro_step=1, epoch=1))


def test_add_registers_every_on_method_in_event_names_order() -> None:
    handler = Everything()
    events = RecordingEvents()
    assert events.add(handler) is events
    assert events.names == list(EVENT_NAMES)
    _emit_all(events)
    assert handler.seen == list(EVENT_NAMES)
    assert events.attached() == [handler]


def test_a_duck_typed_handler_works_without_the_mixin_and_checks_its_own_cadence() -> None:
    class EveryOther:  # no Handler base, no attach
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, event: Event) -> None:
            if not due(2, event):
                return
            self.steps.append(event.step)

    handler = EveryOther()
    events = Events(handler)
    for step in range(1, 6):
        events.emit(Event("step_end", state=None, step=step))
    assert handler.steps == [2, 4]
    assert not hasattr(handler, "attach") and events.attached() == [handler]


def test_the_mixin_attach_is_events_add() -> None:
    class Ends(Handler):
        def __init__(self) -> None:
            self.ends = 0

        def on_fit_end(self, event: Event) -> None:
            self.ends += 1

    by_attach, by_add = Ends(), Ends()
    events = by_attach.attach(Events())
    assert events.add(by_add) is events
    events.emit(Event("fit_end", state=None))
    assert (by_attach.ends, by_add.ends) == (1, 1)
    assert events.attached() == [by_attach, by_add]


def test_a_last_handler_runs_after_those_registered_later_without_last() -> None:
    order: list[str] = []

    class Save(Handler):
        last = True

        def on_step_end(self, event: Event) -> None:
            order.append("save")

        def on_fit_start(self, event: Event) -> None:
            order.append("save: fit_start")

    class Schedule:
        def on_step_end(self, event: Event) -> None:
            order.append("schedule")

        def on_fit_start(self, event: Event) -> None:
            order.append("schedule: fit_start")

    events = Events(Save(), Schedule()).on("step_end", lambda e: order.append("plain"))
    events.emit(Event("fit_start", state=None))
    events.emit(Event("step_end", state=None, step=1))
    assert order == ["schedule: fit_start", "save: fit_start", "schedule", "plain", "save"]


def test_a_last_that_is_not_a_bool_is_refused() -> None:
    class Remembers:
        last = 3.5  # a value the user keeps, not the registration flag

        def on_step_end(self, event: Event) -> None: ...

    with pytest.raises(ValueError, match=r"last is 3\.5.*True or False"):
        Events(Remembers())


def test_on_attach_runs_before_the_methods_are_registered_and_may_refuse() -> None:
    calls: list[bool] = []

    class Checked(Handler):
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def on_attach(self, events: Events) -> None:
            calls.append(events.has("step_end"))
            if not self.ok:
                raise ConfigError("Checked(ok=False) cannot run; pass ok=True.")

        def on_step_end(self, event: Event) -> None: ...

    events = Checked(ok=True).attach(Events())
    assert calls == [False] and events.has("step_end")
    refused = Events()
    with pytest.raises(ConfigError, match="ok=True"):
        refused.add(Checked(ok=False))
    assert not refused.has("step_end") and refused.attached() == []


def test_the_refusals_at_attach_stay_at_attach() -> None:
    with pytest.raises(ConfigError, match="does not say when to check"):
        EarlyStopping("val_loss").attach(Events())
    with pytest.raises(ConfigError, match="built without every="):
        Events(Log([]))


def test_an_object_with_no_on_method_is_refused_with_the_fix() -> None:
    class Nothing:
        def step_end(self, event: Event) -> None: ...

    with pytest.raises(ValueError) as info:
        Events(Nothing())
    message = str(info.value)
    assert "Nothing object" in message and "no on_<event> method" in message
    assert "on_step_end(self, event)" in message and "events.on('step_end'" in message
    with pytest.raises(ValueError, match="no on_<event> method"):
        Events().add(print)


def test_a_handler_with_its_own_attach_is_registered_by_it() -> None:
    # Handlers written before the convention: their attach says where (and how often).
    class Own:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def attach(self, events: Events) -> Events:
            return events.on("step_end", self.on_step_end, every=3)

        def on_step_end(self, event: Event) -> None:
            self.steps.append(event.step)

    class Extends(Handler):  # its attach adds to the convention's, through super()
        def __init__(self) -> None:
            self.seen: list[str] = []

        def attach(self, events: Events) -> Events:
            return super().attach(events).on("fit_end", lambda e: self.seen.append("extra"))

        def on_fit_end(self, event: Event) -> None:
            self.seen.append("method")

    own, extends = Own(), Extends()
    events = Events(own, extends)
    for step in range(1, 7):
        events.emit(Event("step_end", state=None, step=step))
    events.emit(Event("fit_end", state=None))
    assert own.steps == [3, 6]
    assert extends.seen == ["method", "extra"]
    events.remove(extends)
    assert not events.has("fit_end")


def test_remove_takes_away_every_method_a_discovered_handler_registered() -> None:
    handler, other = Everything(), Everything()
    events = Events(handler, other)
    events.remove(handler)
    _emit_all(events)
    assert handler.seen == []
    assert other.seen == list(EVENT_NAMES)
    with pytest.raises(ValueError, match="not registered"):
        events.remove(handler)


def test_every_emitted_event_carries_its_emitter(tmp_path: Path) -> None:
    seen: dict[str, list[bool]] = {}

    class Carried(Handler):
        def __getattr__(self, attribute: str) -> Any:
            if attribute.startswith("on_") and attribute[3:] in EVENT_NAMES:
                return lambda e: seen.setdefault(e.name, []).append(e.events is events)
            raise AttributeError(attribute)

    loss = make_eval_step(lambda m, b: mean_loss(m, b).detach())
    evaluator = Evaluator(loss, make_batches(1), metrics=MeanMetric(), every=2)
    ckpt = checkpoint_every(str(tmp_path), every=2)
    events = Events(evaluator, ckpt, Carried())
    run(make_train_step(mean_loss), make_state(), make_batches(4), events=events)
    # The loop's events, and those the evaluator and the checkpointer emit on event.events.
    assert set(seen) == set(EVENT_NAMES) - {"exception"}
    assert all(all(flags) for flags in seen.values()), seen
    # A hand-built event gets the emitter too (copied once, only when it lacks it).
    hand_built = Event("exception", state=None, error=RuntimeError("x"))
    events.emit(hand_built)
    assert seen["exception"] == [True] and hand_built.events is None


def test_a_preemption_save_at_fit_end_is_still_reported(tmp_path: Path) -> None:
    # Preemption's methods run last, after the checkpointer's fit_end: a save it makes there
    # is reported as checkpoint_end all the same (as when it ran before the checkpointer).
    ckpt = checkpoint_every(str(tmp_path), every=100, at_end=False)
    handler = preemption(ckpt, signals=(signal.SIGUSR1,))
    reported: list[str] = []
    events = ckpt.attach(Events())
    events.on("fit_end", lambda e: signal.raise_signal(signal.SIGUSR1))  # after the last update
    events.on("checkpoint_end", lambda e: reported.append(e.checkpoint.name))
    handler.attach(events)
    run(make_train_step(mean_loss), make_state(), make_batches(3), events=events)
    assert handler.saved == f"{tmp_path}/step-00000003"
    assert reported == ["step-00000003"]

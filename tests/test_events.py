"""The ``Events`` emitter: order, ``every``/``once`` per counter, ``Stop``, ``NewState``, errors."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import Event, Events, NewState, Stop, TrainState, accumulate, make_train_step, run
from steplib.events import EVENT_NAMES


def _state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)) for _ in range(n)]


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _fired(events: Events, name: str, counters: list[dict[str, int]]) -> None:
    for c in counters:
        events.emit(
            Event(
                name,
                state=None,
                step=c.get("step", 0),
                micro_step=c.get("micro_step", 0),
                epoch=c.get("epoch", 0),
            )
        )


# --- order ------------------------------------------------------------------------------------


def test_handlers_fire_in_registration_order():
    seen: list[str] = []
    events = Events()
    events.on("step_end", lambda e: seen.append("a"))
    events.on("epoch_end", lambda e: seen.append("other event"))
    events.on("step_end", lambda e: seen.append("b"))
    events.on("step_end", lambda e: seen.append("c"))
    events.emit(Event("step_end", state=None, step=1))
    assert seen == ["a", "b", "c"]


def test_on_returns_the_emitter_so_registrations_chain():
    seen: list[int] = []
    events = Events()
    chained = events.on("step_end", lambda e: seen.append(1)).on(
        "step_end", lambda e: seen.append(2)
    )
    assert chained is events
    events.emit(Event("step_end", state=None, step=1))
    assert seen == [1, 2]


def test_events_without_handlers_are_not_reported_and_emit_returns_the_state_unchanged():
    events = Events().on("step_end", lambda e: None)
    assert events.has("step_end")
    assert not events.has("epoch_end")
    sentinel = object()
    emitted = events.emit(Event("epoch_end", state=sentinel, epoch=1))
    assert emitted.state is sentinel
    assert emitted.stop is None


# --- every / once per counter -----------------------------------------------------------------


def test_every_on_step_end_counts_step_not_micro_step():
    seen: list[int] = []
    events = Events().on("step_end", lambda e: seen.append(e.step), every=3)
    # micro_step = step + 1, so counting micro_step would fire at steps 2 and 5 instead.
    _fired(events, "step_end", [{"step": s, "micro_step": s + 1} for s in range(1, 8)])
    assert seen == [3, 6]


def test_every_on_micro_step_end_counts_micro_step_not_step():
    seen: list[int] = []
    events = Events().on("micro_step_end", lambda e: seen.append(e.micro_step), every=2)
    # step stays 1 (odd), so counting step would never fire.
    _fired(events, "micro_step_end", [{"step": 1, "micro_step": m} for m in range(1, 7)])
    assert seen == [2, 4, 6]


@pytest.mark.parametrize("name", ["epoch_start", "epoch_end"])
def test_every_on_epoch_events_counts_epoch(name):
    seen: list[int] = []
    events = Events().on(name, lambda e: seen.append(e.epoch), every=2)
    # step and micro_step are odd, so counting either would never fire.
    _fired(events, name, [{"epoch": e, "step": 2 * e + 1, "micro_step": 1} for e in range(1, 6)])
    assert seen == [2, 4]


@pytest.mark.parametrize(
    ("name", "counter"),
    [("step_end", "step"), ("micro_step_end", "micro_step"), ("epoch_end", "epoch")],
)
def test_once_fires_only_when_the_events_counter_equals_it(name, counter):
    seen: list[int] = []
    events = Events().on(name, lambda e: seen.append(getattr(e, counter)), once=3)
    # The other counters are fixed at 3, so only the event's own counter can select.
    others = {"step": 3, "micro_step": 3, "epoch": 3}
    _fired(events, name, [{**others, counter: v} for v in range(1, 7)])
    assert seen == [3]


def test_handlers_without_every_or_once_fire_on_every_emission():
    seen: list[int] = []
    events = Events().on("step_end", lambda e: seen.append(e.step))
    _fired(events, "step_end", [{"step": s} for s in range(1, 5)])
    assert seen == [1, 2, 3, 4]


def test_every_and_once_follow_the_counters_inside_run():
    seen_every: list[int] = []
    seen_once: list[int] = []
    events = Events()
    events.on("step_end", lambda e: seen_every.append(e.step), every=2)
    events.on("micro_step_end", lambda e: seen_once.append(e.micro_step), once=5)
    step = accumulate(make_train_step(_mse), 2)
    # 8 batches, k=2: 4 updates per epoch, 2 epochs -> steps 1..8, micro_steps 1..16.
    state = run(step, _state(), _batches(8), events=events, max_epochs=2)
    assert state.step == 8
    assert seen_every == [2, 4, 6, 8]
    assert seen_once == [5]


# --- Stop -------------------------------------------------------------------------------------


def test_stop_from_step_end_stops_run_after_that_step():
    calls: list[int] = []
    events = Events()
    events.on("step_end", lambda e: Stop("enough") if e.step == 3 else None)
    events.on("micro_step_end", lambda e: calls.append(e.micro_step))
    state = run(make_train_step(_mse), _state(), _batches(10), events=events, max_epochs=5)
    assert (state.step, state.micro_step, state.epoch) == (3, 3, 0)
    assert calls == [1, 2, 3]


def test_stop_from_micro_step_end_mid_window_leaves_the_window_open():
    events = Events().on("micro_step_end", lambda e: Stop("now") if e.micro_step == 3 else None)
    step = accumulate(make_train_step(_mse), 2)
    state = run(step, _state(), _batches(10), events=events)
    # The stop takes effect after the current call: micro-batch 3 opened window 2.
    assert (state.step, state.micro_step, state.window.size) == (1, 3, 1)


def test_stop_on_the_last_batch_still_completes_the_epoch():
    ended: list[int] = []
    events = Events()
    events.on("step_end", lambda e: Stop("last") if e.step == 4 else None)
    events.on("epoch_end", lambda e: ended.append(e.epoch))
    state = run(make_train_step(_mse), _state(), _batches(4), events=events, max_epochs=3)
    assert (state.step, state.epoch) == (4, 1)
    assert ended == [1]


def test_stop_from_epoch_end_stops_before_the_next_epoch():
    events = Events().on("epoch_end", lambda e: Stop("one epoch is enough"))
    state = run(make_train_step(_mse), _state(), _batches(3), events=events, max_epochs=5)
    assert (state.step, state.epoch) == (3, 1)


def test_stop_from_fit_start_runs_no_step_and_still_emits_fit_end():
    ended: list[int] = []
    events = Events()
    events.on("fit_start", lambda e: Stop("not today"))
    events.on("fit_end", lambda e: ended.append(e.step))
    state = run(make_train_step(_mse), _state(), _batches(3), events=events)
    assert (state.step, state.micro_step) == (0, 0)
    assert ended == [0]


def test_emit_returns_the_first_stop_and_still_calls_later_handlers():
    seen: list[str] = []
    events = Events()

    def later(event: Event) -> Stop:
        seen.append("later")
        return Stop("second")

    events.on("step_end", lambda e: Stop("first"))
    events.on("step_end", later)
    emitted = events.emit(Event("step_end", state=None, step=1))
    assert emitted.stop == Stop("first")
    assert seen == ["later"]


# --- NewState ---------------------------------------------------------------------------------


def test_new_state_is_seen_by_later_handlers_and_returned():
    old, new = object(), object()
    seen: list[Any] = []
    events = Events()
    events.on("fit_start", lambda e: seen.append(("before", e.state)))
    events.on("fit_start", lambda e: NewState(new))
    events.on("fit_start", lambda e: seen.append(("after", e.state)))
    emitted = events.emit(Event("fit_start", state=old))
    assert seen == [("before", old), ("after", new)]
    assert emitted.state is new


def test_new_state_brings_its_counters_to_later_handlers():
    resumed = types.SimpleNamespace(step=7, micro_step=14, epoch=2)
    seen: list[tuple[int, int, int]] = []
    events = Events()
    events.on("fit_start", lambda e: NewState(resumed))
    events.on("fit_start", lambda e: seen.append((e.step, e.micro_step, e.epoch)))
    events.emit(Event("fit_start", state=types.SimpleNamespace(step=0, micro_step=0, epoch=0)))
    assert seen == [(7, 14, 2)]


def test_new_state_from_a_handler_replaces_the_loops_state():
    seen_extras: list[dict[str, Any]] = []
    events = Events()
    events.on(
        "step_end",
        lambda e: NewState(e.state.replace(extras={"swapped_at": e.step})),
        once=2,
    )
    events.on("step_end", lambda e: seen_extras.append(dict(e.state.extras)))
    state = run(make_train_step(_mse), _state(), _batches(4), events=events)
    assert seen_extras == [{}, {"swapped_at": 2}, {"swapped_at": 2}, {"swapped_at": 2}]
    assert dict(state.extras) == {"swapped_at": 2}
    assert state.step == 4


# --- bad input --------------------------------------------------------------------------------


def test_unknown_event_name_is_refused_with_the_list_of_names():
    with pytest.raises(ValueError, match="'step_ends'") as info:
        Events().on("step_ends", lambda e: None)
    message = str(info.value)
    assert "does not exist" in message
    for name in EVENT_NAMES:
        assert name in message


@pytest.mark.parametrize("label", ["every", "once"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_every_and_once_must_be_positive_ints(label, value):
    with pytest.raises(ValueError) as info:
        Events().on("step_end", lambda e: None, **{label: value})
    message = str(info.value)
    assert f"{label}=...) received {value!r}" in message
    assert "positive int" in message
    assert f"{label}=100" in message


def test_every_and_once_together_are_refused():
    with pytest.raises(ValueError) as info:
        Events().on("step_end", lambda e: None, every=2, once=3)
    message = str(info.value)
    assert "every=2" in message and "once=3" in message
    assert "choose one" in message
    assert "register the handler twice" in message


@pytest.mark.parametrize(
    "name", ["fit_start", "fit_end", "exception", "validation_end", "checkpoint_end"]
)
@pytest.mark.parametrize("label", ["every", "once"])
def test_every_or_once_on_an_event_without_a_counter_is_refused(name, label):
    with pytest.raises(ValueError) as info:
        Events().on(name, lambda e: None, **{label: 2})  # type: ignore[arg-type]
    message = str(info.value)
    assert f"{name!r} has no counter" in message
    for counted in ("micro_step_end", "step_end", "epoch_start", "epoch_end"):
        assert counted in message


def test_a_non_callable_handler_is_refused():
    with pytest.raises(ValueError) as info:
        Events().on("step_end", "print")  # type: ignore[arg-type]
    message = str(info.value)
    assert "handler of type str" in message
    assert "not callable" in message
    assert "lambda event:" in message


def test_a_refused_registration_leaves_no_handler_behind():
    events = Events()
    with pytest.raises(ValueError):
        events.on("step_end", lambda e: None, every=0)
    assert not events.has("step_end")


def test_handlers_registered_last_run_after_the_others_whatever_the_order() -> None:
    seen: list[str] = []
    events = Events().on("step_end", lambda e: seen.append("save"), last=True)
    events.on("step_end", lambda e: seen.append("evaluate"))
    events.on("step_end", lambda e: seen.append("export"), last=True)
    events.on("step_end", lambda e: seen.append("schedule"))
    events.emit(Event("step_end", state=None, step=1))
    assert seen == ["evaluate", "schedule", "save", "export"]


def test_a_handler_object_added_twice_is_refused() -> None:
    # Added twice, it ran twice at each event: an evaluator evaluated each update twice (its
    # history held each entry twice) and early stopping counted each evaluation twice.
    class Counter:
        def on_step_end(self, event: Event) -> None:
            pass

    counter = Counter()
    events = Events(counter)
    with pytest.raises(ValueError, match=r"Counter object .* twice: attach each handler once"):
        events.add(counter)
    events.remove(counter).add(counter)  # removed, it may be added again
    # Registered with on() as a function of another event first (the demo's evaluator at
    # fit_start), then added: fine.
    other = Counter()
    Events().on("fit_start", other.on_step_end).add(other)


def test_a_function_registered_twice_for_one_event_and_cadence_is_refused() -> None:
    # A notebook cell run again registered its function once more: it ran twice at each event
    # (a log wrote each record twice), as a handler object added twice did before.
    seen: list[int] = []

    def record(event: Event) -> None:
        seen.append(event.step)

    events = Events().on("step_end", record, every=2)
    with pytest.raises(ValueError, match=r"registered for 'step_end' already with every=2"):
        events.on("step_end", record, every=2)
    events.on("step_end", record, once=3).on("epoch_end", record)  # other cadences, events
    for s in range(1, 5):
        events.emit(Event("step_end", state=None, step=s))
    assert seen == [2, 3, 4]

    class Counter:
        calls = 0

        def on_step_end(self, event: Event) -> None:
            self.calls += 1

        def on_fit_start(self, event: Event) -> None:
            pass

    counter = Counter()  # its method by hand, then the object; or the other way round
    by_hand = Events().on("step_end", counter.on_step_end)
    with pytest.raises(ValueError, match="twice: attach each handler once"):
        by_hand.add(counter)
    assert not by_hand.has("fit_start")  # refused before registering any of its methods
    with pytest.raises(ValueError, match="registered for 'step_end' already"):
        Events(counter).on("step_end", counter.on_step_end)

"""``resume_from`` runs before every other handler at ``fit_start``, wherever it is attached.

Before, it ran in attach order: a handler attached before it started from the state before the
resume, and from its own state before the resume. Measured: an early stopper attached first,
resumed after it had stopped its run, let the resumed run train 3 more updates (to its next
check) instead of stopping at once; the sanity evaluation attached first evaluated the fresh
model, not the resumed one. Given to ``events.on("fit_start", ...)`` (the docs' form), its
class's ``first`` was ignored, with the same effect (session 23).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn

from steplib import (
    Evaluator,
    Event,
    Events,
    TrainState,
    checkpoint_every,
    make_eval_step,
    make_train_step,
    resumable_loader,
    resume_from,
    run,
)
from steplib.handlers import EarlyStopping
from tests.checkpoint_helpers import memory_dir

__all__ = ["memory_dir"]  # the fixture, used by name

EVERY = 3


def _state() -> TrainState:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return -next(model.parameters()).sum()  # the weight counts the updates


def _evaluator() -> Evaluator:
    # A validation loss that never improves: the stopper stops at its second check.
    step = make_eval_step(lambda model, batch: torch.ones(1))
    return Evaluator(
        step,
        [torch.zeros(1)],
        metrics={"loss": torchmetrics.MeanMetric()},
        every=EVERY,
        monitor="val_loss",
    )


def _run(
    directory: str, *, resumed_first: bool, seen: list[int] | None = None, by_on: bool = False
) -> tuple[TrainState, EarlyStopping]:
    evaluator = _evaluator()
    stopper = EarlyStopping(evaluator, patience=1)
    ckpt = checkpoint_every(directory, every=EVERY)
    resume = resume_from(ckpt)
    handlers = [resume, evaluator, stopper] if resumed_first else [stopper, evaluator, resume]
    events = Events()
    if seen is not None:  # a function of the user's, registered before everything
        events.on("fit_start", lambda event: seen.append(event.step))
    if by_on:  # the docs' events.on("fit_start", resume_from(...)), after the others
        events.add(stopper, evaluator, ckpt).on("fit_start", resume)
        return run(make_train_step(_loss), _state(), _data(), events=events), stopper
    events.add(*handlers, ckpt)
    return run(make_train_step(_loss), _state(), _data(), events=events), stopper


def _data() -> Any:
    return resumable_loader(torch.zeros(100, 1), batch_size=1)


@pytest.mark.parametrize("resumed_first", [True, False], ids=["attached-first", "attached-last"])
def test_a_resumed_run_that_had_stopped_early_stops_at_once_wherever_resume_is_attached(
    memory_dir: str, resumed_first: bool
) -> None:
    stopped, _ = _run(memory_dir, resumed_first=resumed_first)
    assert stopped.step == 2 * EVERY  # its second check: no improvement on the first
    again, stopper = _run(memory_dir, resumed_first=resumed_first)
    assert again.step == stopped.step  # not one more update
    assert stopper.wait == 1


def test_every_fit_start_handler_sees_the_resumed_state(memory_dir: str) -> None:
    stopped, _ = _run(memory_dir, resumed_first=True)
    seen: list[int] = []
    _run(memory_dir, resumed_first=False, seen=seen)
    assert seen == [stopped.step]


def test_first_handlers_keep_their_order_before_the_others() -> None:
    order: list[str] = []
    events = Events().on("fit_start", lambda e: order.append("a"))
    events.on("fit_start", lambda e: order.append("last"), last=True)
    events.on("fit_start", lambda e: order.append("first-1"), first=True)
    events.on("fit_start", lambda e: order.append("b"))
    events.on("fit_start", lambda e: order.append("first-2"), first=True)
    events.emit(Event("fit_start", state=None))
    assert order == ["first-1", "first-2", "a", "b", "last"]


def test_resume_given_to_events_on_runs_first_too(memory_dir: str) -> None:
    # events.on(name, obj) ignored the object's `first`: registered after the others (as the
    # docs write it), the stopper and a function of the user's saw the fresh state.
    stopped, _ = _run(memory_dir, resumed_first=True)
    seen: list[int] = []
    again, stopper = _run(memory_dir, resumed_first=False, seen=seen, by_on=True)
    assert seen == [stopped.step]
    assert again.step == stopped.step and stopper.wait == 1


def test_events_on_keeps_a_handler_objects_last_and_refuses_both() -> None:
    class Save:
        last = True

        def __call__(self, event: Event) -> None:
            order.append("save")

    order: list[str] = []
    events = Events().on("fit_start", Save()).on("fit_start", lambda e: order.append("a"))
    events.emit(Event("fit_start", state=None))
    assert order == ["a", "save"]
    with pytest.raises(ValueError, match="not both"):
        Events().on("fit_start", Save(), first=True)

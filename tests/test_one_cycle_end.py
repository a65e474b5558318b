"""A ``OneCycleLR`` ends at its ``total_steps``: torch refuses the step past it (``ValueError
'Tried to step 6 times'``) only after the optimizer has applied that update. A run longer than
the cycle, or a resume past its end, is refused before any update changes the model (at the
run's start where ``max_steps`` says how long it is), and a ``OneCycleLR`` past its end still
counts as setting the rate beside a plateau."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import (
    ChainedScheduler,
    ConstantLR,
    ExponentialLR,
    LinearLR,
    OneCycleLR,
    SequentialLR,
)

from steplib import ConfigError, Events, TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.handlers import Scheduler
from steplib.schedule_ends import cycle_end
from tests.reference import make_batches, tiny_model

BATCHES = [(x, y) for x, y, _ in make_batches(4, seed=3)]
STEP = make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1]))
ENDED = r"stepped 0 more time\(s\) before the end of a OneCycleLR.s cycle \(total_steps=5\)"


def _state(*, chained: bool = False) -> tuple[TrainState, Any]:
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cycle = OneCycleLR(opt, max_lr=1.0, total_steps=5)
    sched = ChainedScheduler([ExponentialLR(opt, gamma=1.0), cycle]) if chained else cycle
    return TrainState.create(model=model, optimizer=opt, scheduler=sched), cycle


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("chained", [False, True])
def test_a_run_longer_than_the_cycle_is_refused_at_its_start(chained: bool) -> None:
    # Before: 5 updates trained, then the 6th raised torch's ValueError after its optimizer
    # step: the model held 6 updates, the state none (run raised), the scheduler position 6.
    state, cycle = _state(chained=chained)
    before = _params(state.model)
    with pytest.raises(ConfigError, match=r"total_steps=.*at least 10\).*max_steps=5"):
        run(STEP, state, BATCHES, max_steps=10)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(state.model), strict=True))
    assert cycle.last_epoch == 0

    # The run as long as the cycle trains, at the rates of torch's own loop.
    lrs: list[float] = []
    events = Events()
    events.on("step_end", lambda e: lrs.append(float(e.output.lr)))
    state = run(STEP, state, BATCHES * 2, events=events, max_steps=5)
    ref = OneCycleLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 1.0, total_steps=5)
    expected = []
    for _ in range(5):
        expected.append(ref.get_last_lr()[0])
        ref.optimizer.step()
        ref.step()
    assert state.step == 5 and lrs == pytest.approx(expected)


def test_an_update_past_the_cycle_is_refused_before_it_changes_the_model() -> None:
    # A run by epochs (its length unknown at the start) and a hand loop: the 6th update raised
    # torch's ValueError after the optimizer changed the parameters (the model one update
    # ahead of state.step, in a notebook that goes on with it).
    state, cycle = _state()
    with pytest.raises(ConfigError, match=ENDED):
        run(STEP, state, BATCHES, max_epochs=2)  # 8 updates
    assert cycle.last_epoch == 5
    state, cycle = _state()
    for batch in BATCHES + BATCHES[:1]:
        state, _ = STEP(state, batch)
    before = _params(state.model)
    with pytest.raises(ConfigError, match=ENDED + r".*stop the run at max_steps=5"):
        STEP(state, BATCHES[1])
    assert state.step == 5 and cycle.last_epoch == 5
    assert all(torch.equal(a, b) for a, b in zip(before, _params(state.model), strict=True))


def _sequential(opt: torch.optim.Optimizer, stages: str, milestones: list[int]) -> Any:
    # "L" a 2-step warm-up, "C" a OneCycleLR of 3 steps, "K" a constant factor; "(LC)" chained.
    def build(kind: str) -> Any:
        if kind.startswith("("):
            return ChainedScheduler([build(k) for k in kind[1:-1]])
        if kind == "L":
            return LinearLR(opt, start_factor=0.5, total_iters=2)
        return OneCycleLR(opt, max_lr=1.0, total_steps=3) if kind == "C" else ConstantLR(opt)

    parts = [p for p in stages.replace("(", " (").replace(")", ") ").split(" ") if p]
    kinds = [k for part in parts for k in ([part] if part.startswith("(") else list(part))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a ChainedScheduler's first step before the optimizer's
        return SequentialLR(opt, [build(k) for k in kinds], milestones=milestones)


@pytest.mark.parametrize(
    ("stages", "milestones"),
    [("LC", [2]), ("CK", [3]), ("CK", [6]), ("LCK", [2, 5]), ("LCK", [2, 8]), ("CC", [4]),
     ("(LC)K", [5]), ("(LC)K", [3]), ("LC", [0])],
)  # fmt: skip
def test_the_steps_left_are_those_torch_takes(stages: str, milestones: list[int]) -> None:
    # Counted by stepping torch's own schedulers until they raise, from every position.
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = _sequential(opt, stages, milestones)
    ends: list[int | None] = []
    for _ in range(20):
        end = cycle_end(scheduler)
        ends.append(None if end is None else end[0])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's step(0) of a restarted stage
                scheduler.step()
        except ValueError:  # torch's "Tried to step ... times"
            break
    taken = len(ends) - 1 if len(ends) < 20 or ends[-1] == 0 else None
    assert ends == ([None] * 20 if taken is None else list(range(taken, -1, -1)))
    expected = {"LC[2]": 5, "CK[6]": 3, "LCK[2, 8]": 5, "CC[4]": 7, "(LC)K[5]": 3, "LC[0]": 3}
    assert taken == expected.get(f"{stages}{milestones}")


def test_a_one_cycle_inside_a_sequential_lr_is_refused_before_it_ends() -> None:
    # Before: SequentialLR([warm-up, OneCycleLR]) was not looked into: 5 updates trained, then
    # the 6th raised torch's ValueError after its optimizer step (scheduler at 6, state at 0).
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _sequential(opt, "LC", [2])
    state = TrainState.create(model=model, optimizer=opt, scheduler=scheduler)
    before = _params(model)
    with pytest.raises(ConfigError, match=r"stepped 5 more.*at least 8\).*max_steps=5"):
        run(STEP, state, BATCHES * 3, max_steps=10)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's step(0) of the restarted OneCycleLR
        state = run(STEP, state, BATCHES * 3, max_steps=5)
    with pytest.raises(ConfigError, match=r"update 6: .*stepped 0 more"):
        run(STEP, state, BATCHES, max_epochs=1)
    assert state.step == 5 and scheduler.last_epoch == 5


def test_a_resume_past_the_cycle_is_refused_at_its_start(tmp_path: Path) -> None:
    # The checkpoint restores the total_steps it was saved with, whatever the new OneCycleLR
    # was built with: the resumed run asking for 3 more updates trained none and raised
    # torch's ValueError after the first one's optimizer step (a model one update ahead of
    # the checkpoint it would save next).
    data = BATCHES + BATCHES[:1]  # an epoch of 5 updates, checkpointed at its end
    state, _ = _state()
    run(STEP, state, data, events=Events(checkpoint_every(str(tmp_path), epochs=1)), max_epochs=1)
    state, cycle = _state()
    ckpt = checkpoint_every(str(tmp_path), epochs=1)
    with pytest.raises(ConfigError, match=ENDED + r".*would step it 3 time"):
        run(STEP, state, data, events=Events(resume_from(ckpt), ckpt), max_steps=8)
    assert cycle.last_epoch == 5


def test_a_one_cycle_past_its_end_still_sets_the_rate_beside_a_plateau() -> None:
    # Its get_lr raises past total_steps, so the probe counted it as not setting the rate and
    # the check was let through (a OneCycleLR that a hand loop stepped past its end, in a
    # notebook that goes on with a plateau handler).
    state, cycle = _state()
    state.optimizer.step()  # no gradients: nothing changes (torch warns of a step before it)
    with pytest.raises(ValueError, match="Tried to step 6 times"):
        for _ in range(6):
            cycle.step()
    plateau = Scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer), metric="v")
    with pytest.raises(ConfigError, match=r"the OneCycleLR sets it from max_lr"):
        run(STEP, state.replace(scheduler=cycle), BATCHES, events=Events(plateau), max_steps=1)


def test_a_per_epoch_cycle_past_its_end_is_refused_before_the_epoch_trains() -> None:
    # Before: the third epoch's 4 updates trained, then the Scheduler's step at its end raised
    # torch's ValueError ('Tried to step 3 times'): 12 updates in the model, the run dead.
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cycle = OneCycleLR(opt, max_lr=1.0, total_steps=2)
    state = TrainState.create(model=model, optimizer=opt)
    updates: list[int] = []
    events = Events(Scheduler(cycle))
    events.on("step_end", lambda e: updates.append(e.state.step))
    with pytest.raises(ConfigError, match=r"epoch 3: .*0 more.*total_steps=2\).*max_epochs=2"):
        run(STEP, state, BATCHES, events=events, max_epochs=3)
    assert len(updates) == 8  # two epochs of 4 batches, none of the third
    assert cycle.last_epoch == 2

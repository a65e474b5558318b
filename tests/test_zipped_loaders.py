"""``steplib.data.Zipped``: two loaders' batches side by side (12 and 16 samples in batches of
2: 6 steps a pass, the longer loader's last 2 batches left), killed and resumed at every
kind of point, trains the batches, updates and epochs of the uninterrupted run.

A composite of one's own that zips the loaders and saves their positions (what
``resume_from``'s warning about positionless data suggests) resumed differently from a
checkpoint taken at an epoch's end: ``zip`` had left the longer loader part-way, its next
pass would have started its next epoch, but its saved position went on with the rest: 2
updates in that epoch instead of 6, 14 in the run instead of 18."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from steplib import ConfigError, Events, TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, latest, load, resume_from, save
from steplib.data import Zipped, resumable_loader

EPOCHS = 3


class OwnZip:
    """The composite a user writes: zip, and every loader's position."""

    def __init__(self, *loaders: Any) -> None:
        self.loaders = loaders

    def __iter__(self) -> Any:
        return zip(*self.loaders, strict=False)

    def __len__(self) -> int:
        return min(len(loader) for loader in self.loaders)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): loader.state_dict() for i, loader in enumerate(self.loaders)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, loader in enumerate(self.loaders):
            loader.load_state_dict(state[str(i)])


class KilledError(Exception):
    pass


def _data(kind: type = Zipped) -> Any:
    labelled = resumable_loader(torch.arange(12.0).unsqueeze(1), batch_size=2, seed=1)
    unlabelled = resumable_loader(100 + torch.arange(16.0).unsqueeze(1), batch_size=2, seed=2)
    return kind(labelled, unlabelled)


def _run(url: str | None, kill_at: int | None = None, kind: type = Zipped) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    seen: list[Any] = []
    log: list[Any] = []

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        seen.append([part.flatten().tolist() for part in batch])
        return sum(model(part / 100).pow(2).mean() for part in batch)

    events = Events()
    if url is not None:
        ckpt = checkpoint_every(url, every=2)
        events.add(resume_from(ckpt))
        events.add(ckpt)
    events.on("epoch_start", lambda e: log.append(("start", e.state.epoch)))
    events.on("epoch_end", lambda e: log.append(("end", e.state.epoch)))

    def record(event: Any) -> None:
        log.append((event.step, event.state.epoch))
        if event.step == kill_at:  # before the checkpoint handler (it runs last)
            raise KilledError

    events.on("step_end", record)
    with contextlib.suppress(KilledError):
        run(make_train_step(loss_fn), state, _data(kind), events=events, max_epochs=EPOCHS)
    return {"seen": seen, "log": log, "params": [p.detach().clone() for p in model.parameters()]}


def _same_tail(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["seen"] == want["seen"][-len(got["seen"]) :]
    assert got["log"] == want["log"][-len(got["log"]) :]
    assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"], strict=True))


@pytest.mark.parametrize("kill_at", [3, 6, 8, 12, 17])
# before the save at 4 (inside the first pass), at the first epoch's last update (the save
# at 4), after the epoch's end save at 6 (the longer loader's part-way pass ended), after 12
# (at an epoch's end), inside the last epoch
def test_zipped_loaders_killed_and_resumed_equal_the_uninterrupted_run(
    tmp_path: Path, kill_at: int
) -> None:
    want = _run(None)
    ends = [entry for entry in want["log"] if entry[0] == "end"]
    assert ends == [("end", 1), ("end", 2), ("end", 3)]
    assert len(want["seen"]) == EPOCHS * 6
    url = str(tmp_path / "ckpt")
    _run(url, kill_at=kill_at)
    _same_tail(_run(url), want)


def test_a_composite_of_ones_own_resumed_at_an_epochs_end_trains_other_batches(
    tmp_path: Path,
) -> None:
    want = _run(None, kind=OwnZip)
    url = str(tmp_path / "ckpt")
    _run(url, kill_at=8, kind=OwnZip)  # resumed from the save at the first epoch's end
    got = _run(url, kind=OwnZip)
    steps = [entry[0] for entry in got["log"] if entry[0] not in ("start", "end")]
    assert steps[-1] == 14 and len(want["seen"]) == 18  # 2 updates in its second epoch
    assert not all(torch.equal(a, b) for a, b in zip(got["params"], want["params"], strict=True))


def test_a_position_saved_by_hand_at_a_passs_last_batch_resumes_in_the_next_epoch(
    tmp_path: Path,
) -> None:
    # Saved at the step_end of the pass's last batch, before the loop ended the pass: the
    # longer loader's rest is ended at the load, and the loop counts the epoch as done.
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    data, url = _data(), str(tmp_path / "by-hand")
    step = make_train_step(lambda m, batch: sum(m(part).pow(2).mean() for part in batch))
    events = Events()
    events.on("step_end", lambda e: save(e.state, url, data=data) if e.step == 6 else None)
    reference = _data()
    epochs = [[[p.tolist() for p in pair] for pair in reference] for _ in range(2)]
    run(step, state, data, events=events, max_epochs=1)
    data = _data()
    resumed = load(str(latest(url)), state, data=data)
    assert resumed.epoch == 1
    assert [[p.tolist() for p in pair] for pair in data] == epochs[1]  # the next epoch's


@pytest.mark.parametrize("loaders", [1, "stateless"])
def test_fewer_than_two_loaders_or_one_without_a_position_is_refused(loaders: Any) -> None:
    one = resumable_loader(torch.arange(4), batch_size=2)
    given = (one,) if loaders == 1 else (one, [torch.zeros(2)])
    with pytest.raises(ConfigError, match=r"Zipped received .*two or more loaders"):
        Zipped(*given)


@pytest.mark.parametrize("stops", [[4], [6], [9, 13]])
def test_runs_stopped_and_run_again_on_the_same_zipped_loaders_train_the_uninterrupted_batches(
    stops: list[int],
) -> None:
    # A notebook's cells: run(max_steps=4), then run(max_epochs=3) on the state and data.
    def go(limits: list[dict[str, Any]]) -> tuple[list[Any], int, int]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        seen: list[Any] = []

        def loss_fn(m: Any, batch: Any) -> torch.Tensor:
            seen.append([part.flatten().tolist() for part in batch])
            return sum(m(part / 100).pow(2).mean() for part in batch)

        data = _data()
        for limit in limits:
            state = run(make_train_step(loss_fn), state, data, **limit)
        return seen, state.step, state.epoch

    want = go([{"max_epochs": EPOCHS}])
    assert go([*({"max_steps": n} for n in stops), {"max_epochs": EPOCHS}]) == want

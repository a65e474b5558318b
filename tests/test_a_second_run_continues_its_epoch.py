"""A run stopped inside an epoch, continued by a second ``run`` on the state it returned (a
notebook's next cell), sees the batches of the uninterrupted run: the rest of that epoch, then
the next ones. Before, the second run began a new pass over the loader: the rest of the epoch
was never seen, the next epoch's first batches were counted in the old one, and every later
epoch end came a pass late."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import steplib as sl


class _Indices(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _state() -> sl.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def _step(seen: list[list[int]]) -> sl.Step:
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.flatten().long().tolist())
        return model(batch).pow(2).mean()

    return sl.accumulate(sl.make_train_step(loss_fn), 2)


def _stop_at(step: int) -> sl.Events:
    events = sl.Events()
    events.on("step_end", lambda e: sl.Stop("enough") if e.step == step else None)
    return events


def _first_run(how: str, step: sl.Step, state: sl.TrainState, loader: Any) -> sl.TrainState:
    if how == "max_steps":
        return sl.run(step, state, loader, max_steps=2)
    if how == "a handler's Stop":
        return sl.run(step, state, loader, events=_stop_at(2), max_epochs=3)
    for now, _ in sl.iterate(step, state, loader, max_epochs=3):  # a break in a notebook
        if now.step == 2:
            break
    return now


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["max_steps", "a handler's Stop", "a break out of iterate"])
def test_a_second_run_on_the_returned_state_continues_the_epoch(how: str, workers: int) -> None:
    # 5 batches an epoch, 2 per update: the stop at update 2 leaves batch 5 of epoch 0.
    seen: list[list[int]] = []
    loader = sl.resumable_loader(_Indices(), batch_size=2, seed=0, num_workers=workers)
    uninterrupted = sl.run(_step(seen), _state(), loader, max_epochs=3)
    expected, seen[:] = list(seen), []

    step, loader = (
        _step(seen),
        sl.resumable_loader(_Indices(), batch_size=2, seed=0, num_workers=workers),
    )
    state = _first_run(how, step, _state(), loader)
    assert (state.step, state.epoch, len(seen)) == (2, 0, 4)
    state = sl.run(step, state, loader, max_epochs=3)

    assert seen == expected
    assert (state.step, state.epoch) == (uninterrupted.step, uninterrupted.epoch)
    pairs = zip(state.model.parameters(), uninterrupted.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(10.0).reshape(10, 1))


# torchdata's own constructor calls the deprecated torch.set_vital.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("data", ["resumable_loader", "a list", "unsized (the update flushed)"])
def test_a_break_at_an_epochs_last_update_leaves_that_epoch_counted(data: str) -> None:
    # 5 batches an epoch, 2 per update: update 3 is epoch 0's last. A break there is a stop
    # at that update: its epoch_end has run, and a next run trains epochs 1 and 2 only (it
    # trained a fourth pass, with the epoch counter and every epoch end a pass late).
    def make_data() -> Any:
        if data == "a list":
            return [torch.tensor([[float(2 * i)], [float(2 * i + 1)]]) for i in range(5)]
        if data.startswith("unsized"):
            return StatefulDataLoader(_Stream(), batch_size=2)
        return sl.resumable_loader(_Indices(), batch_size=2, seed=0)

    def counting(ended: list[int]) -> sl.Events:
        return sl.Events().on("epoch_end", lambda e: ended.append(e.epoch))

    seen: list[list[int]] = []
    ended: list[int] = []
    uninterrupted = sl.run(_step(seen), _state(), make_data(), events=counting(ended), max_epochs=3)
    expected, expected_ends, seen[:], ended[:] = list(seen), list(ended), [], []

    step, loader = _step(seen), make_data()
    for now, _ in sl.iterate(step, _state(), loader, events=counting(ended), max_epochs=3):
        if now.step == 3:
            break
    assert (now.step, now.epoch, ended) == (3, 1, [1])
    state = sl.run(step, now, loader, events=counting(ended), max_epochs=3)

    assert (seen, ended) == (expected, expected_ends)
    assert (state.step, state.epoch) == (uninterrupted.step, uninterrupted.epoch)
    pairs = zip(state.model.parameters(), uninterrupted.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)

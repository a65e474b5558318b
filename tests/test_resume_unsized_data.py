"""A stateful loader over data without a length (an ``IterableDataset``: a stream) resumes
where it was, as a sized one does. Before, every resume of a torchdata ``StatefulDataLoader``
or a ``ResumableLoader`` over one failed with a bare ``TypeError`` (``len()`` of the dataset),
after the run had saved its checkpoints; and a position saved after the last batch of a pass,
before the pass was seen to end (a save at that batch's update, or a run stopped there and
continued by a second ``run``), resumed into an empty pass, which the loop refused: that pass
now ends the epoch, as the uninterrupted run's pass ended there."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import steplib as sl
from steplib.data import ResumableLoader

# torchdata's own constructor calls the deprecated torch.set_vital (ResumableLoader hides it).
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(7.0).reshape(7, 1))  # batches of 2: 4 an epoch


LOADERS: dict[str, Callable[[], Any]] = {
    "ResumableLoader": lambda: ResumableLoader(
        _Stream(), batch_size=2, generator=torch.Generator().manual_seed(0)
    ),
    "StatefulDataLoader": lambda: StatefulDataLoader(_Stream(), batch_size=2),
}


class _KilledError(Exception):
    pass


def _run(loader: Any, root: Path, *, kill_at: int | None = None) -> tuple[list[Any], Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    seen: list[list[float]] = []

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.flatten().tolist())
        return model(batch).pow(2).mean()

    ckpt = sl.checkpoint_every(str(root), every=1, at_end=False)
    events = sl.Events(sl.resume_from(ckpt), ckpt)

    def kill(event: Any) -> None:
        if event.step == kill_at:
            raise _KilledError

    events.on("checkpoint_end", kill)
    with warnings.catch_warnings():  # torchdata: "naively fast-forwarding your dataset"
        warnings.simplefilter("ignore", UserWarning)
        with contextlib.suppress(_KilledError):
            state = sl.run(sl.make_train_step(loss_fn), state, loader, events=events, max_epochs=2)
    return seen, state


@pytest.mark.parametrize("kill_at", [2, 4, 5])  # 4: after the first pass's last batch
@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_stateful_loader_over_unsized_data_resumes_the_uninterrupted_run(
    kind: str, kill_at: int, tmp_path: Path
) -> None:
    want, whole = _run(LOADERS[kind](), tmp_path / "whole")
    before, _ = _run(LOADERS[kind](), tmp_path / "cut", kill_at=kill_at)
    after, resumed = _run(LOADERS[kind](), tmp_path / "cut")
    assert before + after == want
    assert (resumed.step, resumed.epoch) == (whole.step, whole.epoch) == (8, 2)


@pytest.mark.parametrize("stop_at", [2, 4])  # 4: after the first pass's last batch
@pytest.mark.parametrize("kind", list(LOADERS))
def test_a_second_run_over_unsized_data_continues_the_first(kind: str, stop_at: int) -> None:
    seen: list[list[float]] = []

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.flatten().tolist())
        return model(batch).pow(2).mean()

    step, model = sl.make_train_step(loss_fn), torch.nn.Linear(1, 1)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    loader = LOADERS[kind]()
    with warnings.catch_warnings():  # torchdata: "naively fast-forwarding your dataset"
        warnings.simplefilter("ignore", UserWarning)
        state = sl.run(step, state, loader, max_steps=stop_at)
        state = sl.run(step, state, loader, max_epochs=2)
    assert seen == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0]] * 2
    assert (state.step, state.epoch) == (8, 2)

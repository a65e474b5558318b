"""A ``ResumableLoader`` with a sampler of the user's: its position holds the loader's generator
alone, so a sampler drawing its order from another generator (its own, or torch's global one)
resumed into another order, in silence: with a ``WeightedRandomSampler`` resumed after 1 of 4
batches the rest of the epoch was another draw, and one given its own seeded generator
repeated the first epoch's order after a resume at an epoch's end. It is refused when the
loader is built, naming the fix; with the loader's generator it resumes exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from steplib import ConfigError, TrainState
from steplib.checkpoint import load, save
from steplib.data import ResumableLoader

DATA = torch.arange(8)
WEIGHTS = [1.0 + i / 7 for i in range(8)]


def _own() -> torch.Generator:
    return torch.Generator().manual_seed(3)


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "weighted, global generator": lambda: {"sampler": WeightedRandomSampler(WEIGHTS, 8)},
    "weighted, its own generator": lambda: {
        "sampler": WeightedRandomSampler(WEIGHTS, 8, generator=_own())
    },
    "random, global generator": lambda: {"sampler": RandomSampler(DATA)},
    "subset, its own generator": lambda: {
        "sampler": SubsetRandomSampler(range(8), generator=_own())
    },
    "batch sampler over one": lambda: {
        "batch_sampler": BatchSampler(RandomSampler(DATA, generator=_own()), 2, False)
    },
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_sampler_drawing_from_another_generator_is_refused_with_the_fix(name: str) -> None:
    given = SAMPLERS[name]()
    given.setdefault("batch_size", 2 if "sampler" in given else 1)
    kind = type(given.get("sampler") or given["batch_sampler"].sampler).__name__
    with pytest.raises(ConfigError, match=rf"{kind} that draws its order from .*generator=g\)"):
        ResumableLoader(DATA, generator=torch.Generator().manual_seed(0), **given)


def _loader() -> ResumableLoader:
    g = torch.Generator().manual_seed(0)
    return ResumableLoader(
        DATA, batch_size=2, sampler=WeightedRandomSampler(WEIGHTS, 8, generator=g), generator=g
    )


@pytest.mark.parametrize("cut", [1, 4, 5])  # 4 batches an epoch: 4 is an epoch's end
def test_a_sampler_given_the_loaders_generator_resumes_the_uninterrupted_order(cut: int) -> None:
    whole = _loader()
    want = [b.tolist() for _ in range(3) for b in whole]

    loader = _loader()
    seen: list[list[int]] = []
    while len(seen) < cut:
        for batch in loader:
            seen.append(batch.tolist())
            if len(seen) == cut:
                break
    position = loader.state_dict()
    resumed = _loader()
    resumed.load_state_dict(position)
    while len(seen) < len(want):
        seen += [b.tolist() for b in resumed]
    assert seen == want


def _state() -> TrainState:
    model = torch.nn.Linear(1, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))


PLAIN: dict[str, Callable[[], dict[str, Any]]] = {
    "shuffle=True, generator=g": lambda: {"shuffle": True, "generator": torch.Generator()},
    "weighted, no generator": lambda: {"sampler": WeightedRandomSampler(WEIGHTS, 8)},
    "weighted, the loader's generator": lambda: (
        lambda g: {"sampler": WeightedRandomSampler(WEIGHTS, 8, generator=g), "generator": g}
    )(torch.Generator()),
}


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's constructor
@pytest.mark.parametrize("name", list(PLAIN))
def test_a_torchdata_loader_whose_order_it_does_not_resume_is_refused_by_a_checkpoint(
    name: str, tmp_path: Any
) -> None:
    # torchdata 0.11 replays the epoch's sampler from the generator as it is at the save:
    # with shuffle=True, generator=g every resume (inside an epoch or at its end) went on in
    # another order than the uninterrupted run's.
    loader = StatefulDataLoader(DATA, batch_size=2, **PLAIN[name]())
    with pytest.raises(ConfigError, match=r"save\(data=...\) received a StatefulDataLoader"):
        save(_state(), str(tmp_path), data=loader)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("shuffle", [True, False])  # True: torchdata's sampler, its own seed
def test_a_torchdata_loader_it_resumes_exactly_is_saved(shuffle: bool, tmp_path: Any) -> None:
    torch.manual_seed(0)
    loader = StatefulDataLoader(DATA, batch_size=2, shuffle=shuffle)
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(3)]  # of 4
    url = save(_state(), str(tmp_path), data=loader)
    want = seen + [b.tolist() for b in iterator] + [b.tolist() for b in loader]
    torch.manual_seed(0)
    resumed = StatefulDataLoader(DATA, batch_size=2, shuffle=shuffle)
    load(url, _state(), data=resumed)
    assert seen + [b.tolist() for b in resumed] + [b.tolist() for b in resumed] == want

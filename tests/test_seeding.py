"""Seeding: two runs with the same seed are identical (workers and random augmentation
included), other seeds differ, the rank offset, deterministic mode, and bad input."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from steplib import ConfigError
from steplib.seeding import (
    loader_generator,
    seed_everything,
    seeded_worker_init_fn,
)

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*_LAUNCH_VARS, "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)


class _Augmented(Dataset):
    """Each item: its index, then one draw from torch, random and numpy (an augmentation)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(
            [float(index), torch.rand(()).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


def _one_run(seed: int, *, workers: int = 2) -> torch.Tensor:
    """A model init, dropout in 'training', and two epochs of a shuffled, augmented loader."""
    seed_everything(seed)
    weights = torch.nn.Linear(3, 2).weight.detach().reshape(-1).double()
    loader = DataLoader(
        _Augmented(),
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=loader_generator(seed),
        worker_init_fn=seeded_worker_init_fn,
    )
    epochs = [torch.cat(list(loader)) for _ in range(2)]
    dropout = torch.nn.functional.dropout(torch.ones(8), 0.5).double()
    return torch.cat([weights, *(e.reshape(-1) for e in epochs), dropout])


def test_two_runs_with_the_same_seed_are_identical_with_workers_and_augmentation() -> None:
    first, second = _one_run(3), _one_run(3)
    assert torch.equal(first, second)
    other = _one_run(4)
    assert not torch.equal(first, other)
    # The augmentation really is random: items and epochs draw different values.
    draws = first[6:102].reshape(-1, 4)[:, 1:]
    assert draws.unique().numel() == draws.numel()


def test_without_workers_the_global_seed_makes_runs_identical() -> None:
    assert torch.equal(_one_run(5, workers=0), _one_run(5, workers=0))


def test_workers_on_other_ranks_augment_differently_but_see_the_same_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rank0 = _one_run(3)
    monkeypatch.setenv("RANK", "1")  # the forked workers read the launcher's environment
    monkeypatch.setenv("WORLD_SIZE", "2")
    rank1 = _one_run(3)
    items0, items1 = rank0[6:102].reshape(-1, 4), rank1[6:102].reshape(-1, 4)
    assert torch.equal(items0[:, 0], items1[:, 0])  # same shuffle order (same generator)
    assert not torch.equal(items0[:, 1:], items1[:, 1:])  # other augmentation streams


def test_rank_offset_adds_the_launchers_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert seed_everything(10, rank_offset=True) == 10  # no launcher: rank 0
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert seed_everything(10, rank_offset=True) == 13
    assert torch.initial_seed() == 13
    a = (random.random(), float(np.random.rand()), torch.rand(()).item())
    seed_everything(13)
    assert a == (random.random(), float(np.random.rand()), torch.rand(()).item())
    assert seed_everything(10) == 10  # without the offset every rank uses the seed itself


def _unset_restored_after(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # setenv first: monkeypatch restores only a variable it recorded, and the code under test
    # sets this one itself.
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_deterministic_turns_on_torchs_deterministic_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    _unset_restored_after(monkeypatch, "CUBLAS_WORKSPACE_CONFIG")
    try:
        seed_everything(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own wins
        seed_everything(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        seed_everything(0)  # False leaves the process-wide flags alone
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_cublas_set_after_cuda_started_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    flag = torch.are_deterministic_algorithms_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    _unset_restored_after(monkeypatch, "CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)  # no real CUDA to seed
    try:
        with pytest.warns(RuntimeWarning, match="before using CUDA"):
            seed_everything(0, deterministic=True)
    finally:
        torch.use_deterministic_algorithms(flag)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "0", True, None])
def test_a_bad_seed_is_a_config_error(seed) -> None:
    with pytest.raises(ConfigError, match=r"seed_everything\(seed\) received"):
        seed_everything(seed)


def test_rank_offset_past_the_limit_and_other_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="beyond 2\\*\\*32 - 1"):
        seed_everything(2**32 - 1, rank_offset=True)
    with pytest.raises(ConfigError, match="loader_generator"):
        loader_generator(-3)
    with pytest.raises(ConfigError, match="outside a DataLoader worker"):
        seeded_worker_init_fn(0)


def _dropout_run(directory: str, *, kill_at: int | None, reseed: bool, scramble: bool) -> list:
    """6 updates of a model with dropout, saved every 3 and resumed from ``directory``; each
    update's loss. ``scramble``: after the resume, the process's generators are not the saved
    run's (as on another number of ranks, where no rank gets its saved RNG). ``reseed``: the
    recipe of docs/seeding.md, each update seeded from its number and the rank."""
    from steplib import Events, TrainState, make_train_step, run
    from steplib.checkpoint import checkpoint_every, resume_from
    from steplib.data import resumable_loader
    from steplib.distributed import rank, world_size

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = resumable_loader(
        torch.randn(12, 4, generator=torch.Generator().manual_seed(1)), batch_size=2
    )
    ckpt = checkpoint_every(directory, every=3)
    losses: list[float] = []

    def reseed_each_update(event: object) -> None:  # the recipe, as the docs give it
        step = event.state.step  # type: ignore[attr-defined]
        seed_everything((0 + step * world_size() + rank()) % 2**32)

    events = Events(resume_from(ckpt), ckpt)
    if scramble:
        events.on("fit_start", lambda e: torch.manual_seed(999))
    if reseed:
        events.on("fit_start", reseed_each_update).on("step_end", reseed_each_update)

    def record(event: object) -> None:
        losses.append(event.output.loss.item())  # type: ignore[attr-defined]
        if event.step == kill_at:  # type: ignore[attr-defined]
            raise KeyboardInterrupt

    events.on("step_end", record)
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    with contextlib.suppress(KeyboardInterrupt):  # killed after update ``kill_at``
        run(step, state, data, events=events, max_steps=6)
    return losses


@pytest.mark.parametrize("reseed", [False, True])
def test_seeding_each_update_makes_a_resume_without_its_rng_draw_as_the_whole_run(
    tmp_path: object, reseed: bool
) -> None:
    # docs/seeding.md's recipe for a resume on another number of ranks, whose RNG states are
    # not restored: without it, the resumed run's dropout masks differ from the whole run's.
    whole = _dropout_run(f"{tmp_path}/whole", kill_at=None, reseed=reseed, scramble=False)
    killed = _dropout_run(f"{tmp_path}/r", kill_at=4, reseed=reseed, scramble=False)
    resumed = _dropout_run(f"{tmp_path}/r", kill_at=None, reseed=reseed, scramble=True)
    assert killed == whole[:4] and len(resumed) == 3  # resumed from the save at update 3
    assert (resumed == whole[3:]) is reseed

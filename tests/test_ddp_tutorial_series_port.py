"""pytorch/examples' ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` on 2 gloo ranks:
its own ``Trainer`` loop against the same run through steplib, and a job killed inside an
epoch and restarted in new processes, as torchrun restarts it.

The example's ``Trainer`` is ported line for line (CPU, no ``device_ids``) with one change:
its loss, ``F.cross_entropy`` of a ``Linear(20, 1)``'s single column against float targets,
is 0 with a zero gradient on every batch (a softmax over one class), so the example trains
nothing and any two runs would agree; this port uses ``F.mse_loss``, the regression its data
(``torch.rand(1)`` targets) asks for. Its snapshot holds ``MODEL_STATE`` and ``EPOCHS_RUN``;
steplib's checkpoint holds both without their being named (the model and ``state.epoch``), and
the sampler's epoch follows ``state.epoch`` through the ``epoch_start`` handler that replaces
the example's ``self.train_data.sampler.set_epoch(epoch)``; a ``ResumableLoader`` over the
``DistributedSampler`` holds its epoch in its position, for a resume inside an epoch.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import steplib as sl
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import ResumableLoader, resumable_loader
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks

SIZE, BATCH = 64, 4  # 8 batches per rank per epoch on 2 ranks
EPOCHS = 3
KILL_AT = 12  # the update at which the first job dies: inside epoch 1, after one snapshot


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The example's ``datautils.MyTrainDataset``, drawn from its own seed: every rank and
    every restarted process holds the same samples (the example relies on the global seed)."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.data = [
            (torch.rand(20, generator=gen), torch.rand(1, generator=gen)) for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class KilledError(Exception):
    """The job dying (a node lost, a preemption) after an update."""


def _loader() -> DataLoader[Any]:
    dataset = MyTrainDataset(SIZE)
    return DataLoader(dataset, batch_size=BATCH, shuffle=False, sampler=DistributedSampler(dataset))


class Trainer:
    """The example's ``Trainer``, on CPU; ``kill_at``: raise after that many batches."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader[Any], path: Path) -> None:
        self.model: Any = model
        self.train_data, self.snapshot_path = train_data, path
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.epochs_run, self.batches = 0, 0
        if path.exists():
            self._load_snapshot(path)
        self.model = DistributedDataParallel(self.model)

    def _load_snapshot(self, path: Path) -> None:
        snapshot = torch.load(path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int, kill_at: int | None) -> None:
        self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in self.train_data:
            self._run_batch(source, targets)
            self.batches += 1
            if self.batches == kill_at:
                raise KilledError

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs: int, kill_at: int | None = None) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch, kill_at)
            if torch.distributed.get_rank() == 0 and epoch % 1 == 0:  # save_every=1
                self._save_snapshot(epoch)


def _example(rank: int, world: int, *, root: str, kill_at: int | None = None) -> dict[str, Any]:
    Path(root).mkdir(exist_ok=True)
    torch.manual_seed(rank)  # the example seeds nothing: DDP broadcasts rank 0's weights
    trainer = Trainer(torch.nn.Linear(20, 1), _loader(), Path(root, "snapshot.pt"))
    resumed_at = trainer.epochs_run
    with contextlib.suppress(KilledError):
        trainer.train(EPOCHS, kill_at)
    torch.distributed.barrier()  # rank 0's snapshot is written before any rank restarts
    params = [p.detach().clone() for p in trainer.model.module.parameters()]
    batches = trainer.batches
    del trainer
    return {"params": params, "resumed_at": resumed_at, "batches": batches}


def _steplib(
    rank: int, world: int, *, root: str, kill_at: int | None = None, resumable: str = ""
) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = apply_ddp(torch.nn.Linear(20, 1))
    state = sl.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    step = sl.ddp_wrap(sl.make_train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))
    events = sl.Events()
    if resumable == "shard=True":  # DistributedSampler's order; epoch and position saved
        loader: Any = resumable_loader(MyTrainDataset(SIZE), batch_size=BATCH, seed=0, shard=True)
        ckpt = checkpoint_every(root, every=5, at_end=False)  # inside the epochs too
    elif resumable:  # the example's DistributedSampler in a loader whose position is saved
        dataset, gen = MyTrainDataset(SIZE), torch.Generator().manual_seed(0)
        sampler: Any = DistributedSampler(dataset)
        loader = ResumableLoader(dataset, batch_size=BATCH, sampler=sampler, generator=gen)
        ckpt = checkpoint_every(root, every=5, at_end=False)
        events.on("epoch_start", lambda e: sampler.set_epoch(e.epoch))
    else:
        loader = _loader()
        ckpt = checkpoint_every(root, epochs=1, at_end=False)  # the example's save_every=1
        events.on("epoch_start", lambda e: loader.sampler.set_epoch(e.epoch))
    events.add(resume_from(ckpt), ckpt)
    epochs: list[int] = []  # the sampler's epochs, in the order the updates drew from them

    def sampler_epoch(event: sl.Event) -> None:
        if not epochs or epochs[-1] != loader.sampler.epoch:
            epochs.append(loader.sampler.epoch)

    events.on("step_end", sampler_epoch)
    resumed: list[int] = []
    events.on("fit_start", lambda e: resumed.append(e.state.epoch))  # after resume_from's

    def kill(event: sl.Event) -> None:
        if event.step == kill_at:
            raise KilledError

    events.on("step_end", kill)
    with contextlib.suppress(KilledError):
        state = sl.run(step, state, loader, events=events, max_epochs=EPOCHS)
    params = [p.detach().clone() for p in model.module.parameters()]
    result = {"params": params, "epochs": epochs, "resumed_at": resumed[0], "step": state.step}
    del model, state, step, events, ckpt
    return result


def _restarted(fn: Any, root: Path, *, kill_at: int = KILL_AT) -> dict[str, Any]:
    """Rank 0's result of a job killed at ``kill_at`` and run again in new processes."""
    run_ranks(functools.partial(fn, root=str(root), kill_at=kill_at))
    return run_ranks(functools.partial(fn, root=str(root)))[0]


def test_the_tutorials_loop_through_steplib_equals_its_own_bit_for_bit(tmp_path: Path) -> None:
    own = run_ranks(functools.partial(_example, root=str(tmp_path / "own")))
    ported = run_ranks(functools.partial(_steplib, root=str(tmp_path / "steplib")))
    for a, b in zip(own, ported, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert ported[0]["epochs"] == [0, 1, 2]  # set_epoch as the example calls it


def test_a_killed_job_restarted_in_new_processes_equals_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    whole = run_ranks(functools.partial(_steplib, root=str(tmp_path / "whole")))[0]
    again = _restarted(_steplib, tmp_path / "killed")
    # The newest checkpoint is epoch 0's end: the restart trains epochs 1 and 2 with the
    # sampler's epochs 1 and 2, which it took from the restored state.epoch.
    assert (again["resumed_at"], again["epochs"], again["step"]) == (1, [1, 2], whole["step"])
    assert all(torch.equal(x, y) for x, y in zip(again["params"], whole["params"], strict=True))


def test_the_examples_own_restart_trains_the_snapshots_epoch_again(tmp_path: Path) -> None:
    # What the port does not copy: the example saves EPOCHS_RUN=epoch after training epoch
    # `epoch`, so its restart trains that epoch a second time (24 + 8 batches for 24).
    whole = run_ranks(functools.partial(_example, root=str(tmp_path / "whole")))[0]
    again = _restarted(_example, tmp_path / "killed")
    assert (again["resumed_at"], again["batches"]) == (0, EPOCHS * SIZE // 2 // BATCH)
    assert not all(torch.equal(x, y) for x, y in zip(again["params"], whole["params"], strict=True))


@pytest.mark.parametrize("resumable", ["shard=True", "DistributedSampler"])
def test_a_resumable_loader_gives_the_examples_order_and_resumes_inside_an_epoch(
    tmp_path: Path, resumable: str
) -> None:
    # resumable_loader(shard=True) shares the epoch out as DistributedSampler(seed=0) with
    # set_epoch does (64 samples: none dropped); a ResumableLoader over the example's
    # DistributedSampler holds the sampler's epoch. Either way the epoch and the position are
    # in the checkpoint, so the job killed at update 14 resumes from update 10, inside epoch 1,
    # exactly (before, the DistributedSampler one continued epoch 0's order there).
    own = run_ranks(functools.partial(_example, root=str(tmp_path / "own")))[0]
    resumable_run = functools.partial(_steplib, resumable=resumable)
    again = _restarted(resumable_run, tmp_path / "killed", kill_at=14)
    assert (again["resumed_at"], again["epochs"]) == (1, [1, 2])  # epoch 1 continued, then 2
    assert all(torch.equal(x, y) for x, y in zip(again["params"], own["params"], strict=True))

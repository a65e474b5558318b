"""Ranks that each save their own plain checkpoints (pipeline stages, each into a directory of
its own) resume together: the newest checkpoint every rank holds, and a preemption stops them
at the same update. Before, each rank resumed its own newest: after a kill between two stages'
commits, stage 0 fed batch 4's activations to a stage 1 resumed at update 2 (its loader at
batch 3), then the stages ran different numbers of updates and hung."""

from __future__ import annotations

import functools
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from steplib import ConfigError, Events, run
from steplib.checkpoint import (
    CheckpointError,
    checkpoint_every,
    list_checkpoints,
    preemption,
    resume_from,
)
from steplib.data import resumable_loader
from steplib.step.pipeline import pipeline_stage
from steplib.testing import run_ranks
from tests.test_pipeline import _batches, _build


def _loader() -> Any:
    x, y = (torch.cat(parts) for parts in zip(*_batches(6), strict=True))
    # every pipeline stage reads the same batch
    return resumable_loader(TensorDataset(x, y), batch_size=8, seed=3, shard=False)


def _train(root: str, steps: int, *, seed: int = 0) -> tuple[Any, Any, Any]:
    step, state = _build("gpipe", seed=seed)
    directory = f"{root}/stage-{pipeline_stage(step).stage_index}"
    ckpt = checkpoint_every(directory, every=1)
    resume = resume_from(ckpt)
    state = run(step, state, _loader(), events=Events(resume, ckpt), max_steps=steps)
    return state, resume, directory


def _stage_1_lost_its_newest(rank: int, world: int, *, root: str) -> dict[str, Any]:
    whole, _, _ = _train(f"{root}/whole", 5)
    _, _, directory = _train(f"{root}/cut", 3)  # saved at updates 1, 2, 3 by each stage
    dist.barrier()
    if rank == 1:  # killed before its last commit: stage 1 holds updates 1 and 2 only
        shutil.rmtree(f"{directory}/step-00000003")
    dist.barrier()
    resumed, resume, _ = _train(f"{root}/cut", 5, seed=7)
    pairs = zip(resumed.model.state_dict().values(), whole.model.state_dict().values(), strict=True)
    same = [torch.equal(a, b) for a, b in pairs]
    if rank == 1:  # every checkpoint of stage 1 lost
        shutil.rmtree(directory)
    try:
        _train(f"{root}/cut", 6)
    except CheckpointError as err:
        refused = str(err)
    return {"loaded": resume.loaded, "step": resumed.step, "same": same, "refused": refused}


def test_stages_resume_the_newest_checkpoint_every_stage_holds(tmp_path: Path) -> None:
    results = run_ranks(functools.partial(_stage_1_lost_its_newest, root=str(tmp_path)), timeout=90)
    for rank, result in enumerate(results):
        assert result["loaded"] == f"{tmp_path}/cut/stage-{rank}/step-00000002"
        assert result["step"] == 5 and all(result["same"])  # as the uninterrupted run, bit for bit
        assert (
            "no checkpoint in common (the newest of rank 0: step-00000005, rank 1: none)"
            in (result["refused"])
        )
    steps = [c.step for c in list_checkpoints(str(tmp_path / "cut" / "stage-0"))]
    assert steps == [1, 2, 3, 4, 5]  # update 3 saved again over the one left behind


def _rank_1_preempted(rank: int, world: int, *, root: str) -> dict[str, Any]:
    step, state = _build("gpipe")
    ckpt = checkpoint_every(f"{root}/stage-{rank}", every=100)
    handler = preemption(ckpt)

    def signal_rank_1(event: Any) -> None:
        if rank == 1 and event.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would, to one stage only

    events = Events(ckpt, handler).on("step_end", signal_rank_1)
    state = run(step, state, _loader(), events=events, max_steps=5)
    return {"step": state.step, "saved": handler.saved, "exit_code": handler.exit_code}


def test_a_signal_to_one_stage_stops_every_stage_at_the_same_update(tmp_path: Path) -> None:
    # Signalled before the preemption check of update 2. Before: stage 1 saved update 2 and
    # stopped; stage 0 trained on, waiting for it in update 3 (a hang).
    results = run_ranks(functools.partial(_rank_1_preempted, root=str(tmp_path)), timeout=60)
    for rank, result in enumerate(results):
        assert result["step"] == 2 and result["exit_code"] == 128 + signal.SIGUSR1
        assert result["saved"] == f"{tmp_path}/stage-{rank}/step-00000002"


def _one_directory(rank: int, world: int, *, root: str) -> str:
    step, state = _build("gpipe")
    ckpt = checkpoint_every(root, every=1)  # no stage in the name
    try:
        run(step, state, _loader(), events=Events(ckpt), max_steps=2)
    except ConfigError as err:
        return str(err)
    return "trained"


def test_ranks_saving_their_own_states_into_one_directory_are_refused(tmp_path: Path) -> None:
    # Before: both stages committed step-00000001 there; the last rename won, and a resume
    # loaded one stage's model, RNG and data position into the other.
    for refused in run_ranks(functools.partial(_one_directory, root=str(tmp_path)), timeout=60):
        assert f"ranks 0 and 1 save their own states into {str(tmp_path)!r}" in refused
        assert "stage-{stage.stage_index}" in refused
    assert list_checkpoints(str(tmp_path)) == []

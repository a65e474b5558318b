"""nanoGPT's train.py (karpathy/nanoGPT), the whole loop, written with steplib equals the
original bit for bit: on one process, killed and resumed, and on 2 DDP ranks (gloo).

Both are in ``tests/nanogpt_train.py`` (the model is ``tests/nanogpt_model.py``): a tiny GPT
with dropout, AdamW with ``configure_optimizers``' groups (``weight_decay_groups``),
``get_lr(it)`` (``AbsoluteLR``), 2 micro-batches per update (``accumulate``), ``clip`` at 1.0,
a disabled ``GradScaler`` (float32), ``estimate_loss`` every 3 iterations and at iteration 0
(an ``Evaluator``, and ``evaluator.unless_evaluated`` at ``fit_start``), ``ckpt.pt`` after
each evaluation (``checkpoint_every``) and ``init_from='resume'`` (``resume_from``).

nanoGPT draws its batches and its evaluation's batches from torch's global generator, so
its evaluation changes which training batches follow; steplib's ``Evaluator`` draws under a
fork of it (law 10). ``as_nanogpt=True`` makes the draws the original's (the training stream
skips what ``estimate_loss`` drew; the evaluation sets first draw what preceded them there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from steplib.checkpoint import best_checkpoint, list_checkpoints, load_weights
from steplib.testing import run_ranks
from tests.checkpoint_helpers import assert_same
from tests.nanogpt_model import GPT, GPTConfig
from tests.nanogpt_train import Config, KilledError, get_lr, nanogpt, with_steplib

C = Config()


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def check(got: dict[str, Any], want: dict[str, Any], *, values: bool = True) -> None:
    assert got["lrs"] == want["lrs"] == [get_lr(C, it) for it in range(C.max_iters + 1)]
    assert got["losses"] == want["losses"]  # the micro-batch loss it prints, exactly
    assert [s for s, _, _ in got["evals"]] == [s for s, _, _ in want["evals"]] == [0, 3, 6, 9]
    assert got["saved"] == want["saved"]
    assert_same(got["model"], want["model"])
    if values:  # MeanMetric's mean and losses.mean(): the same numbers, summed otherwise
        for (_, *value), (_, *expected) in zip(got["evals"], want["evals"], strict=True):
            assert all(map(math.isclose, value, expected))
        assert math.isclose(got["best_val_loss"], want["best_val_loss"])
        # `losses['val'] < best_val_loss` at each evaluation: the best so far, restored too.
        assert got["improved"] == want["improved"] == [True, False, False, True]


def test_nanogpt_train_py_with_steplib_equals_the_original_bit_for_bit(tmp_path: Path) -> None:
    want = nanogpt(C, str(tmp_path))
    assert want["saved"] == [3, 6, 9]  # always_save_checkpoint: after each evaluation but 0's
    check(with_steplib(C, str(tmp_path / "steplib")), want)


def test_evaluation_changes_nanogpts_training_and_never_steplibs(tmp_path: Path) -> None:
    """Without ``as_nanogpt`` the evaluation draws nothing from training's generator: the
    parameters are the original's with an ``estimate_loss`` under ``fork_rng``, and differ
    from the original's (whose every evaluation moves the training batches that follow)."""
    want = nanogpt(C, str(tmp_path))
    forked = nanogpt(C, str(tmp_path), fork_eval=True)
    got = with_steplib(C, str(tmp_path / "steplib"), as_nanogpt=False)
    assert_same(got["model"], forked["model"])
    assert got["losses"] == forked["losses"]
    # The batches differ from the first evaluation on: 8e-2 apart after 10 updates.
    assert 1e-2 < max_difference(got["model"], want["model"]) < 1
    assert got["losses"][0] != want["losses"][0]


def test_killed_and_resumed_equals_the_original_uninterrupted(tmp_path: Path) -> None:
    """Killed at update 5 and resumed from ckpt.pt at 3 in new objects: the parameters,
    printed losses and evaluations are the uninterrupted original's, and the evaluator's best
    (nanoGPT's ``best_val_loss``) is restored without being named. nanoGPT's own resume is
    not exact: it restores no generator state (it seeds 1337 again)."""
    want = nanogpt(C, str(tmp_path))
    url = str(tmp_path / "steplib")
    killed: dict[str, Any] = {}
    with pytest.raises(KilledError):
        with_steplib(C, url, kill_at=5, record=killed)
    assert killed["saved"] == [3] and [s for s, _, _ in killed["evals"]] == [0, 3]
    got = with_steplib(C, url)  # new objects, resumed from update 3
    assert [s for s, _, _ in got["evals"]] == [0, 3, 6, 9]  # the history was restored too
    got["losses"] = killed["losses"][:3] + got["losses"]  # updates 4 and 5 trained again
    got["lrs"] = killed["lrs"][:3] + got["lrs"]
    got["saved"] = killed["saved"] + got["saved"]
    got["improved"] = killed["improved"] + got["improved"]  # 6's compares with 0's value
    check(got, want)

    original = str(tmp_path / "original")
    os.makedirs(original)
    with pytest.raises(KilledError):
        nanogpt(C, original, kill_at=5)
    resumed = nanogpt(C, original, init_from="resume")
    assert resumed["evals"][0][0] == 3  # it evaluates update 3 again, on other batches
    assert 1e-2 < max_difference(resumed["model"], want["model"]) < 1  # 3e-2 apart


def test_only_when_improved_keeps_nanogpts_ckpt_pt_as_the_best(tmp_path: Path) -> None:
    """``always_save_checkpoint=False``: ckpt.pt is written when the validation loss beats
    ``best_val_loss`` (iteration 0's included, which is never saved), and a resume starts from
    it. ``keep_best=1`` alone keeps that one checkpoint (3 and 6 were saved, then pruned)."""
    c = dataclasses.replace(C, always_save_checkpoint=False)
    want = nanogpt(c, str(tmp_path))
    url = str(tmp_path / "steplib")
    got = with_steplib(c, url)
    assert want["saved"] == [9] and got["best_step"] == 9  # 3 and 6 were worse than 0
    assert math.isclose(got["best_val_loss"], want["best_val_loss"])
    assert_same(got["model"], want["model"])
    best = GPT(GPTConfig(**c.model_args()))
    load_weights(best, best_checkpoint(url, got["evaluator"]))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert_same(best.state_dict(), saved["model"])
    assert [info.step for info in list_checkpoints(url)] == [9]


def _both_on(rank: int, world: int, *, root: str) -> dict[str, Any]:
    c = dataclasses.replace(C, gradient_accumulation_steps=4)  # 2 micro-batches per rank
    want = nanogpt(c, root, rank=rank, world=world)
    got = with_steplib(c, os.path.join(root, "steplib"), rank=rank, world=world)
    del got["evaluator"]  # a result travels as tensors, numbers and containers
    return {"want": want, "got": got}


def test_ddp_on_two_ranks_equals_the_original_bit_for_bit(tmp_path: Path) -> None:
    """nanoGPT seeds rank r with 1337 + r (each rank draws its own batches; DDP broadcasts
    rank 0's initial weights), sets ``require_backward_grad_sync`` on the last micro step
    alone, and evaluates and saves on rank 0 alone. steplib: ``apply_ddp`` and ``ddp_wrap``;
    its evaluator runs on every rank and averages their batches (each draws its own, under a
    fork), so its values are not the original's, which rank 0's batches alone give."""
    rank0, rank1 = run_ranks(functools.partial(_both_on, root=str(tmp_path)), timeout=120)
    for rank in (rank0, rank1):
        assert_same(rank["got"]["model"], rank["want"]["model"])
    assert_same(rank0["want"]["model"], rank1["want"]["model"])
    check(rank0["got"], rank0["want"], values=False)
    assert rank1["want"]["losses"] == []  # it prints on rank 0 alone
    assert rank1["got"]["evals"] == rank0["got"]["evals"]
    assert rank0["got"]["evals"][0][1:] != rank0["want"]["evals"][0][1:]


@pytest.mark.parametrize("k", [3, 5])
def test_accumulation_steps_not_a_power_of_two_differ_in_the_last_bits(
    tmp_path: Path, k: int
) -> None:
    """nanoGPT divides each micro-batch's loss by k; steplib divides the window's summed
    gradient once (DESIGN.md section 6). Dividing by a power of two is exact either way, so
    k = 1, 2, 4, 8 ... are bit for bit; 3 and 5 round otherwise: 3e-7 and 8e-8 apart after
    10 updates (law 2's tolerance, 1e-6)."""
    c = dataclasses.replace(C, gradient_accumulation_steps=k)
    want = nanogpt(c, str(tmp_path))
    got = with_steplib(c, str(tmp_path / "steplib"))
    assert 0 < max_difference(got["model"], want["model"]) < 1e-6

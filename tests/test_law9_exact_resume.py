"""Law 9: train N steps; checkpoint at k; a separate process resumes; the final parameters,
optimizer state and the whole sequence of losses equal the uninterrupted run bit for bit (CPU).

The runs use dropout, a shuffling ``resumable_loader``, AdamW with a schedule and clipping
(``tests/resume_worker.py``). The first leg and the uninterrupted run happen here; one child
process (``python -m tests.resume_worker resume``) resumes every scenario from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from steplib import Events, run
from steplib.checkpoint import list_checkpoints, load
from steplib.data import resumable_loader
from tests.resume_worker import Record, Setup, build, first_leg, recorder, reference, resume

ROOT = Path(__file__).resolve().parents[1]

# name -> (setup, where the first leg saves)
SCENARIOS: dict[str, tuple[Setup, dict[str, int]]] = {
    # The last batch of epoch 1: resumes at the start of epoch 2, in the same shuffled order.
    "end_of_epoch": (Setup(steps=25), {"at_step": 10}),
    # Mid-epoch; the resumed run crosses into epoch 3.
    "mid_epoch": (Setup(steps=25), {"at_step": 13}),
    # accumulate(3) over 10 batches per epoch (windows 3, 3, 3, 1), saved between windows.
    "accumulate": (Setup(steps=10, accumulate=3), {"at_step": 5}),
    # ... and inside an open window (2 of 3 micro-batches done): its gradients are restored.
    "accumulate_mid_window": (Setup(steps=10, accumulate=3), {"at_micro": 15}),
    # float16 with a GradScaler that skips and backs off, then grows: saved after a good
    # update, with the growth tracker at 1.
    "fp16_scaler": (Setup(steps=16, fp16=True), {"at_step": 8}),
}


@dataclasses.dataclass
class Outcome:
    reference: dict[str, Any]
    first: dict[str, Any]
    resumed: dict[str, Any]
    directory: str


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the worker: the same kernels, the same rounding
    try:
        base = tmp_path_factory.mktemp("law9")
        runs, jobs = {}, []
        for name, (setup, where) in SCENARIOS.items():
            directory = str(base / name)
            runs[name] = (reference(setup), first_leg(setup, directory, **where), directory)
            jobs.append({"name": name, "setup": dataclasses.asdict(setup), "directory": directory})
        (base / "jobs.json").write_text(json.dumps(jobs))
        out = base / "resumed.pt"
        child = subprocess.run(
            [sys.executable, "-m", "tests.resume_worker", "resume", str(base / "jobs.json"), out],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        resumed = torch.load(out, weights_only=True)
        yield {
            name: Outcome(ref, first, resumed[name], directory)
            for name, (ref, first, directory) in runs.items()
        }
    finally:
        torch.set_num_threads(threads)


def _assert_same_records(got: list[Record], want: list[Record]) -> None:
    assert [(kind, n) for kind, n, _ in got] == [(kind, n) for kind, n, _ in want]
    for (kind, n, loss), (_, _, expected) in zip(got, want, strict=True):
        assert torch.equal(loss, expected), f"{kind} {n}: {loss.item()!r} != {expected.item()!r}"


def _assert_equal_trees(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_equal_trees(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_equal_trees(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_law9_resume_in_a_new_process_is_bit_exact(name: str, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[name]
    # The checkpoint really is at the intended point (not at the start or the end).
    (info,) = list_checkpoints(outcome.directory)
    assert 0 < info.step < SCENARIOS[name][0].steps
    _assert_same_records(
        outcome.first["records"] + outcome.resumed["records"], outcome.reference["records"]
    )
    _assert_equal_trees(outcome.resumed["model"], outcome.reference["model"], "model")
    _assert_equal_trees(outcome.resumed["optimizer"], outcome.reference["optimizer"], "optimizer")
    _assert_equal_trees(outcome.resumed["scaler"], outcome.reference["scaler"], "scaler")
    assert outcome.resumed["counters"] == outcome.reference["counters"]


def test_law9_mid_window_checkpoint_holds_the_window_and_its_gradients(
    outcomes: dict[str, Outcome],
) -> None:
    outcome = outcomes["accumulate_mid_window"]
    (info,) = list_checkpoints(outcome.directory)
    # Epoch 1 is 4 updates (windows 3, 3, 3, 1); micro-batch 15 is the 2nd of update 6's window.
    assert info.name == "step-00000005-micro-00000015"
    step, state, loader = build(SCENARIOS["accumulate_mid_window"][0])
    resumed = load(info.url, state, data=loader, step=step)
    assert (resumed.step, resumed.micro_step, resumed.window.size) == (5, 15, 2)
    grads = [p.grad for p in resumed.model.parameters()]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_law9_fp16_run_really_skipped_and_grew_the_scale(outcomes: dict[str, Outcome]) -> None:
    # The scenario exercises the scaler's state: steps were skipped and the scale moved.
    reference_run = outcomes["fp16_scaler"].reference
    assert reference_run["scaler"]["scale"] != 2.0**20
    assert reference_run["counters"][0] == 16


def test_law9_resume_without_the_data_position_is_detected_as_different(tmp_path: Path) -> None:
    # The control: the comparison above is sharp enough to see a resume that restarts the data.
    setup, where = SCENARIOS["mid_epoch"]
    want = reference(setup)
    first = first_leg(setup, str(tmp_path), **where)
    step, state, loader = build(setup)
    records: list[Record] = []
    url = list_checkpoints(str(tmp_path))[-1].url
    state = load(url, state, step=step)  # no data=: the loader starts epoch 1 again
    run(step, state, loader, events=recorder(records, Events()), max_steps=setup.steps)
    with pytest.raises(AssertionError):
        _assert_same_records(first["records"] + records, want["records"])


def test_law9_resume_in_process_equals_resume_in_a_new_process(
    outcomes: dict[str, Outcome],
) -> None:
    # The same checkpoint resumed here gives what the child computed: nothing depends on the
    # process (its RNG history, its loader) but the checkpoint.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup, _ = SCENARIOS["mid_epoch"]
        here = resume(setup, outcomes["mid_epoch"].directory)
    finally:
        torch.set_num_threads(threads)
    _assert_same_records(here["records"], outcomes["mid_epoch"].resumed["records"])


def test_law9_resumable_loader_order_equals_the_uninterrupted_order_over_epochs() -> None:
    data = torch.arange(10)
    uninterrupted = resumable_loader(data, batch_size=3, seed=5)
    want = [[b.tolist() for b in uninterrupted] for _ in range(3)]
    for cut in range(5):  # 4 batches per epoch: every position in epoch 2, and its end
        loader = resumable_loader(data, batch_size=3, seed=5)
        seen = [[b.tolist() for b in loader]]
        iterator = iter(loader)
        seen.append([next(iterator).tolist() for _ in range(cut)])
        position = loader.state_dict()
        resumed = resumable_loader(data, batch_size=3, seed=5)
        resumed.load_state_dict(position)
        if resumed.epoch_completed_on_load:
            seen.append([b.tolist() for b in resumed])
        else:
            seen[-1] += [b.tolist() for b in resumed]
            seen.append([b.tolist() for b in resumed])
        assert seen == want, f"cut after {cut} batches"

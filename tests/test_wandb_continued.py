"""``WandbLogger(id=..., resume="allow")`` continuing a killed run's W&B run, resumed from a
checkpoint older than the last step that run logged: W&B (online) continues the run at the step
after the last it holds and drops a record at a lower step, so the resumed run's records up to
there are dropped. The logger warns at the run's first record, with the steps and the fix, as
``MLflowLogger(run_id=...)`` does.

W&B's server is not reachable here (offline, a resumed run starts its steps afresh: nothing
to continue), so a stand-in ``wandb`` module plays it: what it keeps per run id, the
``starting_step`` and ``resumed`` of a continued run, and its rule for a step lower than the
current one (dropped) or equal to it (merged)."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from steplib.handlers import WandbLogger
from tests.test_trackers import _KilledError, _resumable_run


class _Run:
    """A W&B run as its server keeps it: one row per step, ``rows`` shared by run id."""

    def __init__(self, rows: dict[int, dict[str, float]], *, resumed: bool, id: str) -> None:
        self.rows, self.resumed, self.id = rows, resumed, id
        # W&B's starting_step of a continued run: the step after the last it holds.
        self.starting_step = max(rows) + 1 if resumed and rows else 0
        self.current = self.starting_step
        self.dropped: list[int] = []

    def log(self, values: dict[str, float], step: int) -> None:
        if step < self.current:  # "Steps must be monotonically increasing": ignored
            self.dropped.append(step)
            return
        self.current = step
        self.rows.setdefault(step, {}).update(values)  # the same step: merged

    def finish(self, exit_code: int = 0) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[int, dict[str, float]]]:
    runs: dict[str, dict[int, dict[str, float]]] = {}

    def init(*, id: str | None = None, resume: str | None = None, **_: Any) -> _Run:
        known = id is not None and id in runs and resume in ("allow", "must")
        name = id or f"run{len(runs)}"
        return _Run(runs.setdefault(name, {}), resumed=known, id=name)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return runs


def _run(logger: WandbLogger, directory: Path, *, kill_at: int | None = None) -> None:
    """test_trackers' run of 8 updates, saved every 4 and resumed from ``directory``, each
    update's loss and, at updates 3 and 6, a value of its own (``probe``) logged; killed after
    update ``kill_at``."""

    def probe(event: Any) -> None:
        if event.step in (3, 6) and event.step != kill_at:
            logger.write({"step": event.step, "probe": float(event.step)})

    _resumable_run(logger, directory, kill_at=kill_at, on_step_end=probe)


def test_a_wandb_run_continued_by_id_from_an_older_checkpoint_warns_what_it_drops(
    server: dict[str, dict[int, dict[str, float]]], tmp_path: Path
) -> None:
    # Before, nothing said so: the resumed run's records at 5 and 6 were dropped by W&B (its
    # next step was 7), its probe at 6 (which the killed run, killed after the loss at 6, did
    # not log) with them, in silence.
    killed = WandbLogger(project="p", mode="online")
    with pytest.raises(_KilledError):
        _run(killed, tmp_path / "ckpt", kill_at=6)
    match = (
        r"first record is at step 5, .* holds steps up to 6, .* W&B continues the run \(id=\) "
        r"at the step after the last it holds .* steps 5 to 6 are dropped.*resume_from="
    )
    with (
        WandbLogger(project="p", mode="online", id=killed.run.id, resume="allow") as logger,
        pytest.warns(UserWarning, match=match) as seen,
    ):
        assert logger.run.starting_step == 7
        _run(logger, tmp_path / "ckpt")
    assert len(seen) == 1  # once, at the run's first record
    rows = server[killed.run.id]
    assert sorted(rows) == list(range(1, 9))
    assert logger.run.dropped == [5, 6, 6]  # the losses at 5 and 6, the probe at 6
    assert "probe" not in rows[6] and rows[3]["probe"] == 3.0


def test_a_wandb_run_continued_by_id_from_its_last_step_warns_nothing(
    server: dict[str, dict[int, dict[str, float]]], tmp_path: Path
) -> None:
    # Killed after the save at 4: the resumed run's first record, at 5, is W&B's next step.
    killed = WandbLogger(project="p", mode="online")
    with pytest.raises(_KilledError):
        _run(killed, tmp_path / "ckpt", kill_at=4)
    with (
        WandbLogger(project="p", mode="online", id=killed.run.id, resume="allow") as logger,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        _run(logger, tmp_path / "ckpt")
    assert sorted(server[killed.run.id]) == list(range(1, 9)) and not logger.run.dropped
    assert server[killed.run.id][6]["probe"] == 6.0

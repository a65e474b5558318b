"""``checkpoint_every(epochs=N)``: checkpoints land at exactly every N-th epoch's end, resuming
from one is exact, and a cadence that is missing, invalid or contradictory is refused."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from steplib import ConfigError, Event, Events, make_train_step, run
from steplib.checkpoint import checkpoint_every, list_checkpoints, load
from tests.checkpoint_helpers import assert_same, make_state, snapshot
from tests.reference import make_batches, mean_loss


def test_checkpoints_land_every_two_epochs_and_resuming_from_one_is_exact(tmp_path: Path) -> None:
    step, data = make_train_step(mean_loss), make_batches(3)
    losses: list[float] = []
    events = Events(checkpoint_every(str(tmp_path), epochs=2, at_end=False))
    events.on("step_end", functools.partial(_record, losses))
    final = run(step, make_state(), data, events=events, max_epochs=5)
    saved = list_checkpoints(str(tmp_path))
    assert [(c.epoch, c.step) for c in saved] == [(2, 6), (4, 12)]

    for checkpoint in saved:
        resumed = load(checkpoint.url, make_state(seed=3), step=step)  # other initial weights
        resumed_losses: list[float] = []
        rest = Events().on("step_end", functools.partial(_record, resumed_losses))
        resumed = run(step, resumed, data, events=rest, max_epochs=5)
        assert_same(snapshot(resumed), snapshot(final), f"from epoch {checkpoint.epoch}")
        assert resumed_losses == losses[checkpoint.step :]


def test_an_update_cadence_and_an_epoch_cadence_both_save_each_update_once(
    tmp_path: Path,
) -> None:
    keep = checkpoint_every(str(tmp_path), every=4, epochs=2, at_end=False)
    assert repr(keep) == f"checkpoint_every({str(tmp_path)!r}, every=4, epochs=2)"
    run(make_train_step(mean_loss), make_state(), make_batches(3), events=[keep], max_epochs=4)
    # Updates 4, 8, 12 by `every`; the ends of epochs 2 and 4 are updates 6 and 12.
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [4, 6, 8, 12]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, r"no cadence .* every=500 .* epochs=1"),
        ({"epochs": 0}, r"epochs=\.\.\.\) received 0 .* positive int .* epochs=10"),
        ({"epochs": 1.5}, r"received 1\.5 \(type float\)"),
        ({"every": True}, r"every=\.\.\.\) received True .* optimizer updates"),
        ({"epochs": 2, "at_epoch_end": True}, r"contradict each other.*epochs=1 is"),
        ({"at_epoch_end": "yes"}, r"at_epoch_end=\.\.\.\) received 'yes'"),
    ],
)
def test_a_missing_invalid_or_contradictory_cadence_is_refused(
    tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        checkpoint_every(str(tmp_path), **settings)


def test_at_epoch_end_is_epochs_one(tmp_path: Path) -> None:
    keep = checkpoint_every(str(tmp_path), at_epoch_end=True, at_end=False)
    assert keep.epochs == 1
    run(make_train_step(mean_loss), make_state(), make_batches(2), events=[keep], max_epochs=2)
    assert [(c.epoch, c.step) for c in list_checkpoints(str(tmp_path))] == [(1, 2), (2, 4)]


def _record(losses: list[float], event: Event) -> None:
    losses.append(float(event.output.loss))

"""Several steps over data without a length: when the data ends, ``run`` flushes each step's
open window. A flushed window of a step whose optimizer the run does not count (D's, with G
counted) updated its model, but the flush fired ``step_end`` only for the counted optimizer's
update: no handler saw D's last update. ``TrainMetrics`` and the progress bar left it out of
``D/loss`` (12 targets of 14), ``NonFiniteAlarm`` let a NaN update of it pass in silence, and
``EMA(generator)``, with D counted, missed G's flushed update. The flush now emits a
``micro_step_end`` that covers no batch (``batches=0``; ``every=`` and ``once=`` skip it)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from steplib import EMA, Event, Events, ProgressBar, TrainState, accumulate, make_train_step, run
from steplib.errors import NonFiniteError
from steplib.handlers import NonFiniteAlarm, Throughput, TrainMetrics
from tests.reference import Unsized
from tests.test_run_several_steps import _d_loss, _g_loss  # the GAN losses of run's tests


def _state(first: str = "G") -> TrainState:
    torch.manual_seed(0)
    models = {
        "G": nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
        "D": nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)),
    }
    optimizers = {
        "G": torch.optim.Adam(models["G"].parameters(), lr=1e-2),
        "D": torch.optim.SGD(models["D"].parameters(), lr=1e-1, momentum=0.9),
    }
    order = [first, *(n for n in ("G", "D") if n != first)]  # the first optimizer is counted
    return TrainState.create(model=models, optimizer={n: optimizers[n] for n in order})


def _steps(d_every: int = 3, g_every: int = 1) -> dict[str, Any]:
    return {
        "D": accumulate(make_train_step(_d_loss, optimizer="D"), d_every),
        "G": accumulate(make_train_step(_g_loss, optimizer="G"), g_every),
    }


def _batches(n: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 1, generator=g) + 3, torch.randn(2, 4, generator=g)) for _ in range(n)]


def test_every_steps_flushed_window_reaches_the_readers() -> None:
    # G (counted) updates on each of the 7 batches; D accumulates 3: its windows hold batches
    # 0-2, 3-5, and 6, flushed after the pass, with no update of G after it.
    data, epochs = _batches(), 2
    state, steps = _state(), _steps()
    windows: dict[str, list[tuple[float, int]]] = {"D": [], "G": []}
    for _ in range(epochs):  # the reference: the steps in your own loop
        calls = [(name, batch) for batch in data for name in steps] + [(n, None) for n in steps]
        for name, batch in calls:
            if batch is None:
                state, out = steps[name].flush(state)
            else:
                state, out = steps[name](state, batch)
            if out is not None and bool(out.did_update):
                windows[name].append((out.loss.item(), int(out.num_targets)))
    assert [len(windows["D"]), len(windows["G"])] == [6, 14]
    train, speed = TrainMetrics(), Throughput(unit="batches")  # each closed window's targets
    per_batch = Throughput(tokens=lambda out: torch.ones(()), unit="batches")  # 1 a call
    bar = ProgressBar(every=1000, file=io.StringIO())
    every_batch: list[int] = []
    sizes: list[tuple[int, bool]] = []

    def size(event: Event) -> None:
        sizes.append((event.batches, getattr(event, "flushed", False)))

    events = Events(train, speed, per_batch, bar).on("micro_step_end", size)
    events.on("micro_step_end", lambda e: every_batch.append(e.micro_step), every=1)
    events.on("micro_step_end", lambda e: every_batch.append(-e.micro_step), once=7)
    done = run(_steps(), _state(), Unsized(data), events=events, max_epochs=epochs)
    for name, tensor in state.model.state_dict().items():
        assert torch.equal(done.model.state_dict()[name], tensor), name
    record = train.read(None)
    for name in ("D", "G"):
        targets = sum(t for _, t in windows[name])
        loss = sum(loss * t for loss, t in windows[name]) / targets
        assert record[f"{name}/num_targets"] == targets  # D: 14 targets, 12 before
        assert record[f"{name}/loss"] == pytest.approx(loss, rel=1e-6)
        assert bar.stats[f"{name}/loss"] == pytest.approx(loss, rel=1e-6)
    # The flush covers no batch: every=/once= handlers run once per batch, and Throughput
    # counts each batch once (G's 14 updates, one batch each; D's flushed window not again).
    assert sizes == ([(1, False)] * 7 + [(0, True)]) * epochs
    assert every_batch == [1, 2, 3, 4, 5, 6, 7, -7, *range(8, 15)]
    for rates in (speed.read(None), per_batch.read(None)):
        assert rates["D/batches_per_s"] == rates["G/batches_per_s"] > 0


def test_a_non_finite_flushed_window_of_an_uncounted_step_raises_the_alarm() -> None:
    # D's last window, flushed after the pass, holds the NaN batch 6: D's weights became NaN
    # and the alarm (at fit_end) had seen none of it.
    data = _batches()
    data[6] = (torch.full_like(data[6][0], float("nan")), data[6][1])
    with pytest.raises(NonFiniteError, match=r"loss of step 'D'"):
        run(_steps(), _state(), Unsized(data), events=[NonFiniteAlarm(every=1000)])


def test_the_ema_of_an_uncounted_steps_model_follows_its_flushed_update() -> None:
    # D counted (every batch), G accumulating 3: G's window of batch 6 is flushed, no
    # step_end follows it, and EMA(generator) averaged 2 of G's 3 updates.
    state = _state(first="D")
    ema = EMA(state.model.get_submodule("G"), decay=0.5)
    done = run(_steps(d_every=1, g_every=3), state, Unsized(_batches()), events=[ema])
    assert done["G"].step == 3
    assert ema.updates == 3

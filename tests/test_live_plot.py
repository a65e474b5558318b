"""LivePlot: one figure redrawn in place in a notebook (one display, then updates), a line of
text elsewhere, one curve per copy for a sweep, one host read per redraw."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from torch.utils.data import TensorDataset

import steplib as sl
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.handlers import LivePlot
from steplib.sweep import Copies, SweepAdamW, per_copy_metric, sweep_step
from tests.reference import make_batches, mean_loss, tiny_model

pytest.importorskip("matplotlib")


def sweep_run(plot: LivePlot, updates: int = 12) -> None:
    copies = Copies.stack([tiny_model(i) for i in range(3)])
    state = sl.TrainState.create(
        model=copies, optimizer=SweepAdamW(copies.parameters(), lr=[1e-3, 1e-2, 1e-1])
    )
    batches = make_batches(updates)
    step = sweep_step(sl.make_train_step(mean_loss), copies=copies, example_batch=batches[0])
    eval_step = sl.make_eval_step(lambda m, b: m(b[0]) - b[1])
    evaluator = sl.Evaluator(
        lambda s, b: (eval_step(s, b), torch.zeros(3, len(b[1]))),
        batches[:2],
        metrics={"loss": per_copy_metric(torchmetrics.MeanSquaredError(), 3)},
        every=4,
    )
    sl.run(step, state, batches, events=sl.Events(evaluator, plot))


def test_text_mode_prints_one_line_per_redraw_with_the_copies_range() -> None:
    out = io.StringIO()
    plot = LivePlot(every=4, validation=["val_loss"], mode="text", file=out)
    sweep_run(plot)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and plot.redraws == 3  # updates 4, 8, 12; nothing new at the end
    assert lines[-1].startswith("step 12: loss ") and "over 3 copies" in lines[-1]
    assert "val_loss" in lines[-1]
    assert len(plot.losses) == 12 and all(len(v) == 3 for v in plot.losses)


def test_the_figure_draws_one_curve_per_copy_and_a_validation_panel() -> None:
    plot = LivePlot(every=4, validation=["val_loss"], mode="text", file=io.StringIO())
    sweep_run(plot)
    fig = plot.figure()
    training, validation = fig.axes
    assert len(training.lines) == 3 and len(validation.lines) == 3
    assert list(training.lines[0].get_xdata()) == list(range(1, 13))


class FakeHandle:
    def __init__(self, shown: list[str]) -> None:
        self.shown = shown

    def update(self, image: Any) -> None:
        self.shown.append("update")


def test_notebook_mode_displays_once_and_then_updates_the_same_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("IPython")
    import IPython.display

    shown: list[str] = []

    def display(image: Any, *, display_id: bool) -> FakeHandle:
        assert display_id is True and image.format == "png"
        shown.append("display")
        return FakeHandle(shown)

    monkeypatch.setattr(IPython.display, "display", display)
    sweep_run(LivePlot(every=4, mode="notebook"))
    assert shown == ["display", "update", "update"]


def test_live_plot_refuses_bad_arguments() -> None:
    with pytest.raises(sl.ConfigError, match="every"):
        LivePlot(every=0)
    with pytest.raises(sl.ConfigError, match="'text'"):
        LivePlot(mode="inline")
    with pytest.raises(sl.ConfigError, match="val_loss"):
        LivePlot(validation="val_loss")


def test_outside_jupyter_auto_is_text() -> None:
    assert LivePlot().notebook is False


def test_a_run_of_several_steps_draws_each_steps_loss_over_its_own_windows() -> None:
    # G (counted) updates every batch, D (the last step) every 2. Before the fix the one
    # "loss" curve was D's, and at G's updates of odd batches D's open window's micro-batch.
    torch.manual_seed(0)
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    state = sl.TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": torch.optim.SGD(g.parameters(), lr=0.1),
                   "D": torch.optim.SGD(d.parameters(), lr=0.1)},
    )  # fmt: skip
    d_loss = lambda m, b: m["D"](m["G"](b).detach()).pow(2).mean()  # noqa: E731
    g_loss = lambda m, b: -m["D"](m["G"](b)).mean()  # noqa: E731
    steps = {
        "G": sl.make_train_step(g_loss, optimizer="G"),
        "D": sl.accumulate(sl.make_train_step(d_loss, optimizer="D"), 2),
    }
    closed: list[dict[str, float]] = []  # each batch: the loss of each window it closed

    def record(event: sl.Event) -> None:
        assert event.outputs is not None
        closed.append({n: float(o.loss) for n, o in event.outputs.items() if bool(o.did_update)})

    out = io.StringIO()
    plot = LivePlot(every=2, mode="text", file=out)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 2, generator=gen) for _ in range(4)]
    sl.run(steps, state, batches, events=sl.Events().on("micro_step_end", record).add(plot))
    assert plot.steps == [1, 2, 3, 4]
    for drawn, want in zip(plot.losses, closed, strict=True):
        assert drawn["G"] == pytest.approx(want["G"])
        assert drawn["D"] == pytest.approx(want["D"]) if "D" in want else drawn["D"] != drawn["D"]
    assert out.getvalue().splitlines()[-1].startswith("step 4: G loss ")
    assert plot.figure().axes[0].get_legend() is not None  # one curve per step


def test_an_update_skipped_as_non_finite_is_a_gap_in_one_steps_curve() -> None:
    # A skipped update trained nothing: TrainMetrics and the bar leave its loss out, and so did
    # LivePlot in a run of several steps; one step's curve drew it (inf here) as a point.
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        loss = model(batch).pow(2).mean()
        return loss * float("inf") if calls[0] == 2 else loss

    model = torch.nn.Linear(2, 1)
    state = sl.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    plot = LivePlot(every=10, mode="text", file=io.StringIO())
    losses: list[float] = []
    events = plot.attach(sl.Events()).on("step_end", lambda e: losses.append(float(e.output.loss)))
    sl.run(
        sl.skip_nonfinite(sl.make_train_step(loss_fn)), state, [torch.ones(2, 2)] * 4, events=events
    )
    assert plot.steps == [1, 2, 3, 4] and math.isinf(losses[1])
    assert math.isnan(plot.losses[1])
    assert [plot.losses[i] for i in (0, 2, 3)] == pytest.approx([losses[i] for i in (0, 2, 3)])


class KilledError(Exception):
    """The run dies here (after the update's save): nothing after it reaches the handlers."""


def _plotted_run(plot: LivePlot, directory: Path, *, kill_at: int | None = None) -> None:
    """10 updates from a fresh model, saved every 4, evaluated every 2, resumed from
    ``directory``; ``kill_at`` raises after that update."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = sl.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01)
    )
    loader = resumable_loader(TensorDataset(torch.arange(10.0).view(-1, 1)), batch_size=1, seed=0)
    loss_fn = lambda m, b: (m(b[0]) - 3).pow(2).mean()  # noqa: E731
    evaluator = sl.Evaluator(
        sl.make_eval_step(loss_fn),
        [(torch.ones(1, 1),)],
        metrics={"loss": torchmetrics.MeanMetric()},
        every=2,
    )
    ckpt = checkpoint_every(str(directory), every=4)
    events = sl.Events(resume_from(ckpt), evaluator, plot, ckpt)

    def kill(event: sl.Event) -> None:
        if event.step == kill_at:
            raise KilledError

    events.on("step_end", kill, last=True)
    sl.run(sl.make_train_step(loss_fn), state, loader, events=events, max_steps=10)


@pytest.mark.parametrize("kill_at", [5, 6])  # 5: the losses of 4 and 5 not yet drawn
def test_a_run_resumed_with_the_same_plot_draws_each_update_once(
    tmp_path: Path, kill_at: int
) -> None:
    # A notebook cell run again after a crash, resumed from the checkpoint at 4 with the same
    # plot: before, the curve went back from 6 to 5 (steps 1..6, 5..10, a zigzag) and the
    # crashed run's points at 5 and 6 (and its evaluation at 6) stood beside the new ones.
    want = LivePlot(every=3, validation=["val_loss"], mode="text", file=io.StringIO())
    _plotted_run(want, tmp_path / "uninterrupted")
    got = LivePlot(every=3, validation=["val_loss"], mode="text", file=io.StringIO())
    with pytest.raises(KilledError):
        _plotted_run(got, tmp_path / "resumed", kill_at=kill_at)
    assert got.steps == list(range(1, kill_at + 1))
    _plotted_run(got, tmp_path / "resumed")
    assert got.steps == want.steps == list(range(1, 11))
    assert got.losses == want.losses
    assert got.values == want.values and [s for s, _ in got.values["val_loss"]] == [2, 4, 6, 8, 10]
    fresh = LivePlot(every=3, mode="text", file=io.StringIO())  # and run from scratch again:
    _plotted_run(fresh, tmp_path / "fresh")
    _plotted_run(fresh, tmp_path / "fresh-again")  # the second run's curve replaces the first
    assert fresh.steps == want.steps and fresh.losses == want.losses


def test_a_run_that_raised_leaves_no_window_in_the_next_runs_first_point() -> None:
    # A run of several steps raised at an update's step_end before the plot saw it: its
    # windows, added at micro_step_end, were added again into the next run's first point.
    def gan() -> sl.TrainState:
        torch.manual_seed(0)
        g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        return sl.TrainState.create(
            model={"G": g, "D": d},
            optimizer={"G": torch.optim.SGD(g.parameters(), lr=0.1),
                       "D": torch.optim.SGD(d.parameters(), lr=0.1)},
        )  # fmt: skip

    steps = {
        "G": sl.make_train_step(lambda m, b: m["D"](m["G"](b)).mean() + 10, optimizer="G"),
        "D": sl.make_train_step(
            lambda m, b: m["D"](m["G"](b).detach()).pow(2).mean(), optimizer="D"
        ),
    }
    batches = [torch.ones(4, 2) * i for i in range(4)]

    def boom(event: sl.Event) -> None:
        if event.step == 3:
            raise KilledError

    plot = LivePlot(every=10, mode="text", file=io.StringIO())
    with pytest.raises(KilledError):
        sl.run(steps, gan(), batches, events=sl.Events().on("step_end", boom).add(plot))
    sl.run(steps, gan(), batches, events=sl.Events(plot))  # the cell run again
    want = LivePlot(every=10, mode="text", file=io.StringIO())
    sl.run(steps, gan(), batches, events=sl.Events(want))
    assert plot.steps == want.steps == [1, 2, 3, 4]
    assert plot.losses == want.losses

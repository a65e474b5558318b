"""LivePlot: one figure redrawn in place in a notebook (one display, then updates), a line of
text elsewhere, one curve per copy for a sweep, one host read per redraw."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
import torchmetrics

import steplib as sl
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

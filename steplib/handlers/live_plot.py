"""``LivePlot``: the training and validation curves, redrawn in place in a notebook cell.

In Jupyter the handler shows one figure in the cell's output and replaces it every ``every``
updates (an IPython display handle: one image, never one per redraw). Outside Jupyter it prints
one line of text per redraw. A sweep's loss (one per copy) is drawn as one curve per copy.

The losses are kept as device tensors and read on the host once per redraw (one sync per
``every`` updates, as ``ProgressBar`` does). In a run of several steps (``run({"D": d_step,
"G": g_step}, ...)``) each step's loss is drawn as its own curve (``D loss``, ``G loss``): at
each of the run's updates, the token-weighted mean over the windows that step closed since the
previous one (NaN, a gap, where it closed none), as ``ProgressBar`` shows them. Drawing needs
matplotlib (``pip install steplib[plot]``); the text fallback does not.

A run started again with the same plot (a notebook cell run again after a crash, resumed from
a checkpoint or from scratch) replaces the points from its first update on: each update is
drawn once. Plots built anew after a restart draw the resumed run's updates only: they hold
no state to save with a checkpoint (the curve before is in the logs).

Imports ``events``, ``errors``, ``output`` and ``handlers.progress`` (``spread``).
"""

from __future__ import annotations

import bisect
import io
import math
import sys
from collections.abc import Sequence
from typing import IO, Any

import torch

from steplib import errors
from steplib.errors import ConfigError, describe
from steplib.events import Event, Handler
from steplib.handlers.progress import spread
from steplib.output import window_sums


class LivePlot(Handler):
    """Draw the loss (and the evaluator's values) every ``every`` updates, in place.

    Args:
        every: redraw every this many updates (an int >= 1); also at ``fit_end``.
        validation: the names of evaluation values to draw too (``("val_loss",)``); each
            is read from the ``validation_end`` events (one number, or one per copy).
        mode: ``"auto"`` (a figure in Jupyter, text elsewhere), ``"notebook"`` or ``"text"``.
        file: where the text lines go (``sys.stdout`` by default).
        figsize: the figure's size in inches.

    Attributes:
        steps: the updates drawn so far.
        losses: the loss at each of them: a list of floats, or of lists for a sweep; in a run
            of several steps, of dicts by step name (``{"D": 0.69, "G": 0.71}``).
        values: ``{name: [(step, value), ...]}`` of the validation values.
        redraws: how many times the figure (or the text) was drawn.

    Raises:
        ConfigError: a bad ``every``, ``mode`` or ``validation``; ``mode="notebook"``
            without IPython and matplotlib installed.

    Example:
        >>> import io, torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> out = io.StringIO()
        >>> plot = LivePlot(every=2, mode="text", file=out)
        >>> _ = run(make_train_step(lambda m, b: m(b).pow(2).mean()), state,
        ...         [torch.ones(2, 2)] * 4, events=plot.attach(Events()))
        >>> plot.steps, plot.redraws
        ([1, 2, 3, 4], 2)
    """

    def __init__(
        self,
        *,
        every: int = 10,
        validation: Sequence[str] = (),
        mode: str = "auto",
        file: IO[str] | None = None,
        figsize: tuple[float, float] = (7.0, 3.5),
    ) -> None:
        self.every = errors.positive_int("LivePlot", "every", every)
        if isinstance(validation, str) or not all(isinstance(v, str) for v in validation):
            raise ConfigError(
                f"LivePlot(validation=...) received {describe(validation)}; pass a list of the "
                "evaluator's value names, e.g. validation=['val_loss']."
            )
        if mode not in ("auto", "notebook", "text"):
            raise ConfigError(
                f"LivePlot(mode=...) received {describe(mode)}; pass 'auto' (a figure in "
                "Jupyter, text elsewhere), 'notebook' or 'text'."
            )
        self.validation = tuple(validation)
        self.notebook = _in_notebook() if mode == "auto" else mode == "notebook"
        if self.notebook:
            _check_drawing()
        self.file = file
        self.figsize = figsize
        self.steps: list[int] = []
        self.losses: list[Any] = []
        self.values: dict[str, list[tuple[int, Any]]] = {name: [] for name in self.validation}
        self.redraws = 0
        self._pending: list[Any] = []
        self._handle: Any = None
        # In a run of several steps, per step since the run's last update: the sums over the
        # windows it closed (loss * targets, targets), and its last output added.
        self._sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seen: dict[str, Any] = {}
        self._run_started = False  # until the run's first update says where its points start

    def on_fit_start(self, event: Event) -> None:
        """A run starts: its first update drops the points it draws again."""
        # A run that raised between a batch's micro_step_end and its step_end left that
        # batch's windows here: they belong to no update of the next run.
        self._sums, self._seen = {}, {}
        self._run_started = True

    def on_micro_step_end(self, event: Event) -> None:
        """In a run of several steps, add each step's window that closed on this batch."""
        for name, out in (event.outputs or {}).items():
            self._add(name, out)

    def on_step_end(self, event: Event) -> None:
        """Keep the update's loss on the device; redraw every ``every`` updates."""
        if event.output is None:
            return
        if self._run_started:
            self._run_started = False
            self._drop_from(event.step)
        self.steps.append(event.step)
        # Each step's windows since the last update (a flush's too), as one step's update: an
        # update skipped as non-finite trained nothing, so it is a gap, as TrainMetrics and
        # the progress bar leave it out.
        for name, out in (event.outputs or {"": event.output}).items():
            self._add(name, out)
        means = {
            name: torch.where(kept > 0, total / kept, torch.nan)
            for name, (total, kept) in self._sums.items()
        }
        self._pending.append(means if event.outputs is not None else means[""])
        self._sums = {}
        if event.step % self.every == 0:
            self.draw()

    def _drop_from(self, step: int) -> None:
        # A run in the same process that starts at or before the last point (a notebook cell
        # run again after a crash, resumed from a checkpoint or from scratch) draws those
        # updates again: kept, the curve would go back and zigzag, and the first run's
        # points after its checkpoint would stand beside the new run's.
        kept = bisect.bisect_left(self.steps, step)  # the points increase within a run
        self._pending = self._pending[: max(kept - len(self.losses), 0)]
        self.steps, self.losses = self.steps[:kept], self.losses[:kept]
        self.values = {n: [(s, v) for s, v in seen if s < step] for n, seen in self.values.items()}

    def _add(self, name: str, out: Any) -> None:
        if out is self._seen.get(name):
            return
        self._seen[name] = out
        sums = window_sums(out)
        if name in self._sums:
            sums = (self._sums[name][0] + sums[0], self._sums[name][1] + sums[1])
        self._sums[name] = sums

    def on_validation_end(self, event: Event) -> None:
        """Keep the values named in ``validation`` (host numbers already)."""
        metrics = event.metrics or {}
        for name in self.validation:
            if name in metrics:
                self.values[name].append((event.step, metrics[name]))

    def on_fit_end(self, event: Event) -> None:
        """Draw the last updates."""
        if self._pending or self.redraws == 0:
            self.draw()

    def draw(self) -> None:
        """Read the pending losses (one host read) and redraw the figure or print a line."""
        if self._pending:
            if isinstance(self._pending[0], dict):  # several steps: one read of them all
                flat = [loss for losses in self._pending for loss in losses.values()]
                values = iter(torch.stack(flat).tolist())
                self.losses += [{n: next(values) for n in losses} for losses in self._pending]
            else:
                self.losses += torch.stack(self._pending).tolist()
            self._pending = []
        self.redraws += 1
        if self.notebook:
            self._show(self.figure())
        else:
            print(self.text(), file=self.file or sys.stdout, flush=True)

    def text(self) -> str:
        """The latest numbers as one line: ``step 40: loss 0.41`` (a sweep: the range)."""
        if not self.losses:
            return "no update yet"
        latest = self.losses[-1]
        named = latest.items() if isinstance(latest, dict) else [("", latest)]
        losses = ", ".join(f"{name} loss {_numbers(v)}".lstrip() for name, v in named)
        parts = [f"step {self.steps[len(self.losses) - 1]}: {losses}"]
        for name, seen in self.values.items():
            if seen:
                parts.append(f"{name} {_numbers(seen[-1][1])}")
        return ", ".join(parts)

    def figure(self) -> Any:
        """The curves as a matplotlib ``Figure`` (not shown: made without pyplot)."""
        from matplotlib.figure import Figure

        panels = 1 + bool(any(self.values.values()))
        fig = Figure(figsize=self.figsize, layout="constrained")
        axes = fig.subplots(1, panels, squeeze=False)[0]
        steps = self.steps[: len(self.losses)]
        if self.losses and isinstance(self.losses[0], dict):  # several steps: one curve each
            for name in self.losses[-1]:
                values = [losses.get(name, math.nan) for losses in self.losses]
                _curves(axes[0], steps, values, f"{name} loss")
            axes[0].legend(fontsize="small")
            axes[0].set_ylabel("loss")
        else:
            _curves(axes[0], steps, self.losses, "loss")
        axes[0].set_title("training")
        for name, seen in self.values.items():
            if seen and panels > 1:
                _curves(axes[1], [s for s, _ in seen], [v for _, v in seen], name, marker="o")
                axes[1].set_title("validation")
        for ax in axes:
            ax.set_xlabel("update")
        return fig

    def _show(self, fig: Any) -> None:
        from IPython.display import Image, display

        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=80)
        image = Image(data=buffer.getvalue(), format="png")
        if self._handle is None:  # the first draw makes the one output; later ones replace it
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)


def _curves(ax: Any, steps: list[int], values: list[Any], label: str, **style: Any) -> None:
    """One line, or one per copy when each value is a list (a sweep)."""
    if values and isinstance(values[0], list):
        for i in range(len(values[0])):
            ax.plot(steps, [v[i] for v in values], label=f"{label} #{i}", **style)
        if len(values[0]) <= 10:
            ax.legend(fontsize="small", ncols=2)
    else:
        ax.plot(steps, values, label=label, **style)
    ax.set_ylabel(label)


def _numbers(value: Any) -> str:
    if not isinstance(value, list):
        return f"{value:.4g}"
    best, high = spread(value)
    return f"{value[best]:.4g}-{high:.4g} over {len(value)} copies (lowest #{best})"


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (not a terminal IPython, not plain Python)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _check_drawing() -> None:
    try:
        import IPython.display  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"LivePlot draws in a notebook with IPython and matplotlib ({error}); install "
            "them (pip install 'steplib[plot]' ipython), or pass LivePlot(mode='text')."
        ) from error

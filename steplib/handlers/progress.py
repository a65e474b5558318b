"""A tqdm progress bar as an event handler: step, loss, learning rate and a rate (tokens/s,
samples/s or batches/s, named by what is counted).

The bar advances on every ``step_end`` from host counters alone. It reads tensors (a host sync)
only every ``every`` updates and at the end: in between, the target counts and the
token-weighted loss are summed as tensors where the step left them, so a GPU is never made to
wait per step. An update skipped as non-finite (``skip_nonfinite``) is left out of the loss
(as :class:`~steplib.handlers.TrainMetrics` leaves it out) and shown as ``skipped``.
The rate counts the ``num_targets`` a ``loss_fn`` reports: tokens for
``(loss_sum, num_targets)``; a plain mean loss counts one per micro-batch, so its rate is
named batches/s (samples/s with ``samples_per_step``).

The bar is ``tqdm.auto``'s: a widget in Jupyter and a text bar in a terminal or a log file;
in a Jupyter kernel without ipywidgets, ``tqdm.std``'s text bar, chosen before ``tqdm.auto``
would warn "IProgress not found" (:func:`steplib.handlers.terminal.tqdm_class`).

Imports ``events``, ``errors``, ``distributed``, ``output``, ``handlers.terminal`` and
``handlers.step_plan`` (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO, Any

import torch

from steplib import errors
from steplib.cadence import Batches, check_every, due
from steplib.distributed import is_main, world_size
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, Handler
from steplib.handlers.step_plan import full_window
from steplib.handlers.terminal import tqdm_class
from steplib.output import closed_window, window_sums


class ProgressBar(Handler):
    """Show training progress; register it with :meth:`attach`.

    Args:
        total: updates the run will make (``max_steps``), for a bar with an end and an ETA;
            ``None`` shows a counter.
        every: read the loss, LR and target counts every this many updates (and at the end),
            or every n batches with ``Batches(n)``. In a run of several steps, each step's
            loss and LR are shown (``D loss``, ``G loss``, ``D lr``, ``G lr``).
        desc: a label in front of the bar.
        file: where to draw the bar (tqdm's default, stderr, when ``None``).
        disable: draw nothing, and read no tensor. ``None`` (the default): draw on rank 0 only
            (``steplib.distributed.is_main()``, true without a process group).
        keys: the numbers to show, among ``"loss"``, ``"lr"`` and ``"rate"`` (``None``: all
            three; ``[]``: only the bar, and no tensor is read), as ``keys=`` of every sink.
        samples_per_step: samples per update (``batch_size * accumulation``, times the world
            size for a global rate): the rate is then ``samples/s``. A shorter window (an
            epoch's last, closed early) counts its share: per micro-batch, this over the
            step's ``accumulate`` k.
        unit: what one of ``num_targets`` counts, to name the rate (``"tokens"``, ``"pixels"``);
            ``None``: ``batches`` when each micro-batch counts one (a plain mean loss), else
            ``tokens``.

    Raises:
        ConfigError: ``total`` or ``every`` is not a positive int, ``keys`` names another
            number, ``samples_per_step`` not a positive int, ``unit`` not a non-empty string.

    Example:
        >>> import io, torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> bar = ProgressBar(total=4, every=2, file=io.StringIO())
        >>> events = bar.attach(Events())
        >>> state = run(step, state, [torch.ones(3, 2)] * 4, events=events)
        >>> bar.stats["step"], bar.stats["batches"], bar.closed  # a mean loss: 1 per batch
        (4, 4, True)
    """

    # Device-side sums since the last refresh, by step name ("" for a run of one step): the
    # targets (the rate's), and over the updates not skipped the targets and the loss times
    # the targets (the shown loss's), and the skipped updates; and the latest LR of each.
    _sums: dict[str, tuple[torch.Tensor, ...]]
    _lr: dict[str, torch.Tensor]
    _last_step: int | None  # the update the bar counted last; None until the run's first
    _added: list[Any]  # the outputs added at the last micro_step_end
    _window: int | None = None  # micro-batches of a full window (None: not known)

    def __init__(
        self,
        total: int | None = None,
        *,
        every: int | Batches = 10,
        desc: str | None = None,
        file: IO[str] | None = None,
        disable: bool | None = None,
        keys: Sequence[str] | None = None,
        samples_per_step: int | None = None,
        unit: str | None = None,
    ) -> None:
        errors.optional_positive_int("ProgressBar", "total", total)
        check_every("ProgressBar(every=...)", every)
        shown = _SHOWN if keys is None else keys
        if isinstance(shown, str) or not all(key in _SHOWN for key in shown):
            raise ConfigError(
                f"ProgressBar(keys=...) received {describe(keys)}; the bar shows some of "
                f"{list(_SHOWN)}, e.g. keys=['loss', 'rate'], or keys=[] for the bar alone."
            )
        errors.optional_positive_int("ProgressBar", "samples_per_step", samples_per_step)
        if unit is not None and (not isinstance(unit, str) or not unit):
            raise ConfigError(
                f"ProgressBar(unit=...) received {describe(unit)}; pass what one target counts, "
                "e.g. unit='tokens', or None to name it from the counts."
            )
        self.keys = tuple(shown)
        self.samples_per_step = samples_per_step
        self.unit = unit
        self.total = total
        self.every = every
        self.desc = desc
        self.file = file
        self.disable = not is_main() if disable is None else bool(disable)
        self.stats: dict[str, Any] = {}
        self._bar: Any = None
        self._reset()

    @property
    def closed(self) -> bool:
        """Whether no bar is open (before ``fit_start`` and after ``fit_end``)."""
        return self._bar is None

    def on_attach(self, events: Events) -> None:
        """Start the rate's clock again after every other ``fit_start`` handler."""
        # A sanity evaluation (and a resume_from registered by hand, not first) run at
        # fit_start and train nothing: in the first interval they made each run's first rate
        # read low (as Throughput's).
        events.on("fit_start", self._start_clock, last=True)

    def _start_clock(self, event: Event) -> None:
        self._since = time.perf_counter()

    def on_fit_start(self, event: Event) -> None:
        """Open the bar at the state's step (a resumed run starts where it stopped)."""
        self.close()
        self._reset()
        self._bar = tqdm_class()(
            total=self.total,
            initial=event.step,
            desc=self.desc,
            unit="step",
            file=self.file,
            disable=self.disable,
            dynamic_ncols=True,
        )
        # Where the counters start is taken from the first update (its step_end): a
        # resume_from attached after the bar swaps in the resumed state after this call.
        self._last_step = None
        self._window = full_window(event)  # what samples_per_step's update holds

    def on_step_end(self, event: Event) -> None:
        """Count the update; every ``every`` updates, read the sums and refresh the numbers.

        It sees every update, to count the tokens of each; it reads tensors only on its own
        interval."""
        if self._bar is None:  # used without fit_start (e.g. the user's own loop)
            self.on_fit_start(event)
        assert self._bar is not None
        if self._last_step is None:  # the first update: it covers event.batches micro-batches
            self._last_step = self._step_since = event.step - 1
            self._micro_step = self._micro_since = event.micro_step - event.batches
            self._bar.n = self._bar.initial = self._last_step  # as if opened here (a resume)
        self._bar.update(event.step - self._last_step)
        self._last_step = event.step
        if self.disable or not self.keys or event.output is None:
            return
        self._add(event)
        name = list(event.outputs or {"": None})[-1]
        self._counted_name = name  # the last step's targets are what the rate counts
        for name, out in (event.outputs or {"": event.output}).items():
            self._lr[name] = out.lr  # each step's own: "D lr", "G lr"
        self._micro_step = event.micro_step
        if due(self.every, event):
            self._refresh(event.step)

    def on_micro_step_end(self, event: Event) -> None:
        """Add the windows that closed on this batch (in a run of several steps, another
        step's may close between two updates of the counted one; a single step's windows close
        on the batches of its step_end, which adds them)."""
        if not self.disable and self.keys and event.outputs is not None:
            self._add(event)

    def _add(self, event: Event) -> None:
        # Device-side sums: no host read here. Each step's windows are added once, on the call
        # that closes them (its loss is the window's, over the window's targets): a call
        # inside another step's open window reports one micro-batch, which the window's loss
        # counts again when it closes. Weighting each window's loss by its targets gives the
        # token-weighted mean loss over the interval; several steps, one each. A skipped
        # update (skip_nonfinite) trained nothing: its loss (often NaN) is left out of the
        # shown loss, as TrainMetrics leaves it out, and counted as skipped.
        outputs = event.outputs or {"": event.output}
        added, self._added = self._added, list(outputs.values())
        for name, out in outputs.items():
            if any(out is seen for seen in added):  # this batch's, added at micro_step_end
                continue
            weighted, kept = window_sums(out)
            skipped = out.skipped.to(kept.device).expand_as(kept)
            count = out.num_targets.detach().float().to(kept.device)
            closed = closed_window(out).to(kept.device).any()
            counted = torch.where(closed, count, 0.0).reshape(-1)[:1]  # the rate's count
            sums = (counted, kept, weighted, skipped.float())
            if name in self._sums:
                sums = tuple(a + b for a, b in zip(self._sums[name], sums, strict=True))
            self._sums[name] = sums

    def on_fit_end(self, event: Event) -> None:
        """Show the last numbers and close the bar."""
        if self._bar is not None and self._sums and self._lr:  # an update ran
            self._refresh(event.step)
        self.close()

    def on_exception(self, event: Event) -> None:
        """Close the bar without reading a tensor: after a device error a read raises again."""
        self.close()

    def write(self, message: str) -> None:
        """Print a line above the bar without breaking it (``tqdm.write``)."""
        tqdm_class().write(message, file=self.file)

    def close(self) -> None:
        """Close the bar; calling it again does nothing."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def _reset(self) -> None:
        self._sums, self._lr, self._counted_name = {}, {}, ""
        self._added = []
        self._counted = 0.0
        self._last_step = None
        # Host counters at the last refresh: the interval's micro-batches and updates.
        self._micro_step = self._micro_since = self._step_since = 0
        self._since = time.perf_counter()

    def _refresh(self, step: int) -> None:
        # The only host reads of the bar: once per interval, of values summed on the device.
        assert self._sums and self._lr
        # One read for everything: each step's (targets, loss sums) and LR; a sweep's loss
        # and LR hold one value per copy ([N]).
        names = list(self._sums)
        parts = [torch.cat([s.reshape(-1) for s in sums]) for sums in self._sums.values()]
        rates = [lr.flatten() for lr in self._lr.values()]
        values = iter(torch.cat([p.double() for p in (*parts, *rates)]).tolist())
        losses: dict[str, list[float]] = {}
        counts: dict[str, float] = {}
        skips: dict[str, list[float]] = {}
        for name, part in zip(names, parts, strict=True):
            copies = (part.numel() - 1) // 3  # a sweep's copies, else 1
            counts[name] = next(values)
            kept, sums, skipped = ([next(values) for _ in range(copies)] for _ in range(3))
            key = "loss" if not name else f"{name}/loss"
            means = zip(sums, kept, strict=True)
            if any(kept) or any(skipped):  # a step none of whose windows closed: nothing new
                losses[key] = [v / t if t > 0 else float("nan") for v, t in means]
            if any(skipped):
                skips["skipped" if not name else f"{name}/skipped"] = skipped
        lrs = {
            "lr" if not name else f"{name}/lr": [next(values) for _ in range(rate.numel())]
            for name, rate in zip(self._lr, rates, strict=True)
        }
        targets = counts[self._counted_name]
        # Measured after the read, so on a GPU the interval covers work that has finished.
        now = time.perf_counter()
        micro = self._micro_step
        if self.samples_per_step is not None:
            unit = "samples"
            ran = step - self._step_since if self._window is None else micro - self._micro_since
            counted = self.samples_per_step * ran / (self._window or 1)
        else:
            batches = (micro - self._micro_since) * world_size()
            unit = self.unit or ("batches" if targets == batches else "tokens")
            counted = targets
        rate = counted / max(now - self._since, 1e-9)
        self._counted += counted
        self._sums = {}
        self._since, self._micro_since, self._step_since = now, micro, step
        self.stats = {
            "step": step,
            **{k: v[0] if len(v) == 1 else v for k, v in losses.items()},
            **{k: _count(v) for k, v in skips.items()},
            **{k: v[0] if len(v) == 1 else v for k, v in lrs.items()},
            f"{unit}_per_s": rate,
            unit: int(self._counted) if self._counted.is_integer() else self._counted,
        }
        shown = {
            **{k.replace("/", " "): _range(v, ".4f", best=True) for k, v in losses.items()},
            **{k.replace("/", " "): str(_count(v)) for k, v in skips.items()},
            **{k.replace("/", " "): _range(v, ".3g") for k, v in lrs.items()},
            f"{unit}/s": _si(rate),
        }  # "D loss" for a step named D
        kinds = {
            k: "rate" if "/" in k else "lr" if k.endswith("lr") else "loss"  # "D lr": lr
            for k in shown
        }
        postfix = {k: v for k, v in shown.items() if kinds[k] in self.keys}
        assert self._bar is not None
        self._bar.set_postfix(postfix, refresh=True)


_SHOWN = ("loss", "lr", "rate")


def _count(values: list[float]) -> int | list[int]:
    """Skipped updates: one number, or a sweep's one per copy."""
    return int(values[0]) if len(values) == 1 else [int(v) for v in values]


def _range(values: list[float], spec: str, *, best: bool = False) -> str:
    """One number as it is; a sweep's numbers as ``low-high``, with the lowest's copy."""
    if len(values) == 1:
        return format(values[0], spec)
    low, high = spread(values)
    text = f"{format(values[low], spec)}-{format(high, spec)}"
    return f"{text} (best #{low})" if best else text


def spread(values: Sequence[float]) -> tuple[int, float]:
    """The copy of the lowest of a sweep's ``values`` and the highest value, NaN left out
    (a copy stopped, or whose updates were all skipped, in the interval): ``max`` would
    return a NaN that comes first and pass over one that does not.

    Example:
        >>> spread([float("nan"), 0.5, 0.25])
        (2, 0.5)
    """
    low = min(range(len(values)), key=lambda i: (values[i] != values[i], values[i]))
    return low, max((v for v in values if v == v), default=values[low])  # all NaN: NaN


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"

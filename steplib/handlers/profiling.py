"""A handler around ``torch.profiler``: profile a few updates and write a trace you can open.

The profiler's schedule counts optimizer updates (``step_end``): skip ``wait`` updates, warm
up for ``warmup`` (recording, then discarded: the first iterations pay for lazy set-up), then
record ``active`` updates and write their trace; ``repeat`` cycles. Each trace is a Chrome
trace JSON file: open it at https://ui.perfetto.dev or chrome://tracing, or point TensorBoard's
profiler plugin at the directory.

Imports ``events``, ``errors`` and ``distributed`` only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from steplib import errors
from steplib.distributed import is_main, rank
from steplib.errors import ConfigError, describe
from steplib.events import Event, Handler


class Profiler(Handler):
    """Profile updates on a wait/warmup/active schedule and write a Chrome trace per cycle.

    Args:
        trace_dir: a local directory for the traces (created); files are named
            ``trace_rank{r}_step{n}.json`` (``n``: the run's update the cycle ended at,
            ``state.step``, so a resumed run's traces do not overwrite the earlier run's).
        wait: updates skipped first.
        warmup: updates recorded and discarded.
        active: updates recorded and written.
        repeat: cycles (0: repeat until the run ends).
        activities: ``torch.profiler.ProfilerActivity`` values (default: CPU, and CUDA when
            available).
        all_ranks: profile every rank (default: rank 0 only).
        **options: passed to ``torch.profiler.profile`` (``record_shapes``, ``profile_memory``,
            ``with_stack``, ...).

    Raises:
        ConfigError: bad schedule counts or ``trace_dir``.

    Example:
        >>> import tempfile
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> profiler = Profiler(tempfile.mkdtemp(), wait=1, warmup=1, active=2)
        >>> state = run(step, state, [torch.ones(4, 2)] * 6, events=profiler.attach(Events()))
        >>> [os.path.basename(path) for path in profiler.traces]
        ['trace_rank0_step4.json']
    """

    def __init__(
        self,
        trace_dir: str,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        activities: Sequence[ProfilerActivity] | None = None,
        all_ranks: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(trace_dir, str) or not trace_dir:
            raise ConfigError(
                f"Profiler(trace_dir) received {describe(trace_dir)}; pass a local directory, "
                "e.g. Profiler('runs/exp/profile')."
            )
        for label, value in (("wait", wait), ("warmup", warmup), ("repeat", repeat)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"Profiler({label}=...) received {describe(value)}; it must be an int >= 0."
                )
        errors.positive_int("Profiler", "active", active)
        self.trace_dir = trace_dir
        self.schedule = dict(wait=wait, warmup=warmup, active=active, repeat=repeat)
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
        self.activities = list(activities)
        self.all_ranks = all_ranks
        self.options = options
        self.traces: list[str] = []
        self._profiler: profile | None = None
        # The run's update count (state.step), which names a trace: the profiler's own count
        # starts at 0 at each start, so a resumed run's names would repeat (and overwrite).
        self._step = 0

    def on_fit_start(self, event: Event) -> None:
        """:meth:`start`."""
        self.start(event)

    def on_fit_end(self, event: Event) -> None:
        """:meth:`stop`, writing a cycle that was recording."""
        self.stop(event)

    def on_exception(self, event: Event) -> None:
        """:meth:`stop`, writing a cycle that was recording."""
        self.stop(event)

    def start(self, event: Event | None = None) -> None:
        """Start profiling (on rank 0 unless ``all_ranks``)."""
        self.stop()
        self._step = event.step if event is not None else 0
        if not (self.all_ranks or is_main()):
            return
        os.makedirs(self.trace_dir, exist_ok=True)
        self._profiler = profile(
            activities=self.activities,
            schedule=schedule(**self.schedule),
            on_trace_ready=self._write,
            **self.options,
        )
        self._profiler.start()

    def on_step_end(self, event: Event) -> None:
        """Tell the profiler an update ended (its schedule counts these)."""
        if self._profiler is None:
            return
        self._step = event.step  # before step(), which may write the trace
        with warnings.catch_warnings():
            # torch warns, at the start of a second cycle, that a cycle's events are cleared
            # when it ends. That is intended here: each cycle's trace is written as it ends.
            # (Under warnings-as-errors the raise would leave the profiler half-switched.)
            warnings.filterwarnings(
                "ignore", message=".*Profiler clears events at the end", category=UserWarning
            )
            self._profiler.step()

    def stop(self, event: Event | None = None) -> None:
        """Stop profiling; calling it again does nothing."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()

    def _write(self, profiler: profile) -> None:
        path = os.path.join(self.trace_dir, f"trace_rank{rank()}_step{self._step}.json")
        profiler.export_chrome_trace(path)
        self.traces.append(path)

"""What a run's step is made of, read by the handlers that count it (``Throughput``,
``ProgressBar``) from ``fit_start``'s ``train_step``, without importing ``step``: the
micro-batches of a full window (``accumulate``'s k), and those one call computes the loss of
(a pipeline step's ``n_microbatches``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steplib.events import Event


def _plan(event: Event) -> Any:
    """The plan of the step whose updates a run counts (``state.step``: its first
    optimizer's), or ``None`` (a step of your own, or no ``fit_start``)."""
    step = event.train_step
    if isinstance(step, Mapping):  # several steps: the one that updates the first optimizer
        names = getattr(event.state, "names", None) or [None]
        updating = [s for n, s in step.items() if (getattr(s, "optimizer", None) or n) == names[0]]
        step = next(iter(updating or step.values()), None)
    # A sweep's step holds the step it runs as .step.
    return getattr(step, "plan", None) or getattr(getattr(step, "step", None), "plan", None)


def full_window(event: Event) -> int | None:
    """The micro-batches of a full window of the updates a run counts (``state.step``: its
    first optimizer's), from ``fit_start``'s ``train_step``: its ``accumulate`` k. ``None``
    when not known (a step of your own, or no ``fit_start``): a per-update constant then
    counts every update as whole.

    Example:
        >>> import torch
        >>> from steplib import TrainState, accumulate, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = accumulate(make_train_step(lambda m, b: m(b).sum()), 4)
        >>> full_window(Event("fit_start", state, train_step=step))
        4
    """
    window = getattr(_plan(event), "window", None)
    return window if isinstance(window, int) else None


def loss_batches(event: Event) -> int:
    """The micro-batches one call of the run's step computes the loss of (its runner's
    ``micro_batches``): 1, or a pipeline step's ``n_microbatches``, which a plain mean loss
    counts as its ``num_targets``.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> loss_batches(Event("fit_start", state, train_step=make_train_step(lambda m, b: 0)))
        1
    """
    count = getattr(getattr(_plan(event), "runner", None), "micro_batches", 1)
    return count if isinstance(count, int) and count > 0 else 1

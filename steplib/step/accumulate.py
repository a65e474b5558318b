"""``accumulate``: k micro-batches (one per call) per optimizer update, token-weighted."""

from __future__ import annotations

from steplib.errors import ConfigError, describe
from steplib.step.core import Step, add_part
from steplib.step.parts import Part


def accumulate(step: Step, k: int) -> Step:
    """Accumulate gradients over ``k`` calls; update on the k-th.

    Losses are summed, targets counted (``num_targets`` from ``loss_fn``) and the gradient
    divided once by the window's total, on the device: with ``(loss_sum, num_targets)`` the
    gradient applied equals the gradient of the concatenated window. A plain scalar (mean)
    loss counts 1 per micro-batch: the gradient of the mean of the micro-batch means, which is
    the concatenated window's only when they hold equal numbers of targets (padded sequences
    do not). A shorter last window (``step(state, batch, close_window=True)`` or
    ``step.flush(state)``) is divided by what it held, not by ``k``.

    Args:
        step: the step to wrap.
        k: micro-batches per update, an int >= 1.

    Returns:
        The wrapped step.

    Raises:
        ConfigError: ``k`` is not an int >= 1, or ``step`` is already accumulating.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = accumulate(make_train_step(lambda m, b: m(b).pow(2).mean()), 2)
        >>> state, out = step(state, torch.ones(3, 2))
        >>> bool(out.did_update), state.window.size
        (False, 1)
        >>> state, out = step(state, torch.ones(3, 2))
        >>> bool(out.did_update), state.step
        (True, 1)
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(
            f"accumulate(step, k) received k={describe(k)}; k is the number of micro-batches "
            "per optimizer update and must be an int >= 1, e.g. accumulate(step, 4)."
        )
    return add_part(step, Part(name="accumulate", settings={"k": k}, window=k))

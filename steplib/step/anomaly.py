"""``detect_anomaly``: run forward and backward under ``torch.autograd.detect_anomaly``.

A debugging wrapper, and a slow one: anomaly mode records a Python traceback for every
autograd operation of the forward pass and, with ``check_nan``, scans every gradient the
backward pass produces for NaN (a device sync per operation on a GPU). Expect several times
slower steps; turn it on to find an operation, then off.

Why a micro-batch context and not around ``loss_fn``: anomaly mode must be on during forward
*and* backward (forward records the tracebacks, backward checks the gradients). Contexts of
several parts nest, so the distributed ones (``no_sync``) keep doing their job around it.

When backward fails, torch reports the forward traceback as a warning and raises a bare
``RuntimeError``; the wrapper puts that traceback into the error it raises
(:class:`AnomalyError`), so it is in the log even where warnings are hidden. To catch that
warning it swaps the process-wide warning filters around each micro-batch
(``warnings.catch_warnings``), so warnings raised meanwhile by other threads pass through the
same filters.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from steplib.errors import AnomalyError, ConfigError, describe
from steplib.state import TrainState
from steplib.step.core import Step, add_part
from steplib.step.parts import Part

_TRACE_PREFIX = "Error detected in "  # torch's warning with the forward traceback
_TRIGGERED = " (Triggered internally at"  # the C++ location torch appends to it


@contextlib.contextmanager
def _anomaly_mode(check_nan: bool) -> Iterator[None]:
    traces: list[str] = []
    with warnings.catch_warnings():  # the filters and showwarning below are undone after
        show = warnings.showwarning

        def keep_traces(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if str(message).startswith(_TRACE_PREFIX):
                traces.append(str(message))
            else:  # every other warning is shown as it would have been
                show(message, category, *args, **kwargs)

        warnings.showwarning = keep_traces
        # torch warns "anomaly mode is slow" on every enable: once per micro-batch here.
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        # Shown (to keep_traces), never turned into an error that would hide the real one.
        warnings.filterwarnings("always", message=_TRACE_PREFIX)
        try:
            with torch.autograd.detect_anomaly(check_nan=check_nan):
                yield
        except RuntimeError as err:
            if not traces:  # failed before backward (e.g. in loss_fn): nothing to add
                raise
            raise AnomalyError(_explain(err, traces[-1])) from err


def _explain(error: RuntimeError, trace: str) -> str:
    trace = trace.split(_TRIGGERED, 1)[0].rstrip()
    head, _, stack = trace.partition("\n")
    node = head.removeprefix(_TRACE_PREFIX).split(".", 1)[0]
    return (
        f"detect_anomaly: the backward pass failed in {node}: {error}\n"
        f"The forward call that created {node} (its last line is the operation):\n{stack}\n"
        "Fix that operation's input: keep it away from where its gradient is NaN or infinite "
        "(sqrt, log or pow at 0, a division by 0: clamp or add an epsilon), or lower the "
        "learning rate if the values grew out of range before it."
    )


def detect_anomaly(step: Step, *, check_nan: bool = True) -> Step:
    """Run the step's forward and backward under ``torch.autograd.detect_anomaly``.

    For debugging only: it is slow (every forward operation records a traceback; with
    ``check_nan`` every gradient is scanned, a device sync per operation on a GPU). When the
    backward pass produces a NaN (or fails otherwise), the step raises :class:`AnomalyError`
    whose message holds the forward traceback of the operation that caused it. Numerics are
    unchanged: a step that does not fail gives the same parameters as without the wrapper.

    It composes with ``ddp_wrap`` / ``fsdp_wrap`` in any order. Debug the eager step, without
    ``compile_step``: compiled graphs run, but their tracebacks point into the graph rather
    than at your code.

    Args:
        step: the step to wrap.
        check_nan: raise when a backward operation returns NaN (torch's ``check_nan``).
            ``False`` still adds the forward traceback to other backward errors (e.g. a
            tensor needed for the gradient modified in place).

    Returns:
        The wrapped step.

    Raises:
        ConfigError: ``step`` is not a Step, is wrapped by ``detect_anomaly`` already or was
            compiled, or ``check_nan`` is not a bool.

    Example:
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = detect_anomaly(make_train_step(lambda m, b: m(b).sqrt().sum()))
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(-1.0), model.bias.fill_(0.0)
        >>> try:
        ...     step(TrainState.create(model=model, optimizer=opt), torch.ones(1, 2))
        ... except AnomalyError as err:
        ...     print(str(err).splitlines()[0])  # doctest: +ELLIPSIS
        detect_anomaly: the backward pass failed in SqrtBackward0: ... returned nan values ...
    """
    if not isinstance(check_nan, bool):
        raise ConfigError(
            f"detect_anomaly(check_nan=...) received {describe(check_nan)}; pass True (raise "
            "on a NaN gradient) or False (only add tracebacks to other backward errors)."
        )

    def anomaly_mode(state: TrainState, sync: bool) -> ContextManager[Any]:
        return _anomaly_mode(check_nan)

    settings = {"check_nan": check_nan}
    part = Part(name="detect_anomaly", settings=settings, micro_context=anomaly_mode)
    return add_part(step, part)

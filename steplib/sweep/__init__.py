"""Sweeps: N copies of one model (seeds, or hyper-parameters per copy) trained together by one
vectorised step (``torch.func``), with the user's unchanged ``loss_fn``, wrappers, loop and
handlers; every ``StepOutput`` field becomes a ``[N]`` tensor.

* :class:`Copies`: the N copies as one module of stacked tensors; ``copies.copy(i)`` takes copy
  ``i`` out as a plain module.
* :class:`SweepAdamW`, :class:`SweepSGD`: optimizers whose hyper-parameters differ per copy,
  and which leave a stopped or skipped copy untouched.
* :func:`sweep_step`: a built step run for every copy at once.
* :func:`stop_copies`, :class:`SweepEarlyStopping`, :class:`SuccessiveHalving`: stop updating
  some copies, without a host read in the step.
"""

from steplib.sweep.copies import Copies
from steplib.sweep.grads import CopyGradients
from steplib.sweep.optim import SweepAdamW, SweepSGD
from steplib.sweep.per_copy_optimizer import PerCopyOptimizer
from steplib.sweep.step import SweepStep, sweep_step
from steplib.sweep.stopping import (
    SuccessiveHalving,
    SweepEarlyStopping,
    active_copies,
    per_copy_metric,
    stop_copies,
)

__all__ = [
    "Copies",
    "CopyGradients",
    "PerCopyOptimizer",
    "SuccessiveHalving",
    "SweepAdamW",
    "SweepEarlyStopping",
    "SweepSGD",
    "SweepStep",
    "active_copies",
    "per_copy_metric",
    "stop_copies",
    "sweep_step",
]

"""An exponential moving average (EMA) of the weights, updated only when the optimizer updated.

:class:`EMA` is an object the user holds, not a field of the ``TrainState``: the averaged copy
is a model's worth of tensors that changes in place every update, which is what a
``TrainState``'s frozen fields are not for, and the checkpoint keeps ``state.extras`` to plain
values. It has ``state_dict`` / ``load_state_dict``, so once attached to the run it is saved
with each checkpoint and restored on resume, without being named::

    ema = EMA(model, decay=0.999)
    ema.attach(events)                                   # updates on every step_end
    checkpoint_every(...).attach(events)                 # saved and restored with the run
    evaluate(eval_step, ema.module, val_data, metrics=m) # evaluate the averaged weights
    Evaluator(..., model=ema.module)                     # or during training

The update runs on the device without reading whether the update was applied: the weight of
the new parameters is ``(1 - decay) * did_update``, so a skipped update (non-finite gradients)
leaves the average unchanged, and no host sync is needed.

In a run of several steps (``run({"D": d_step, "G": g_step}, ...)``) the run's ``step_end``
follows the first optimizer's updates, not necessarily the averaged model's. So the EMA finds,
at ``fit_start``, the optimizer of the state that holds its model's parameters, and averages
after each update of that optimizer: on the ``micro_step_end`` where that optimizer's window
closed, with the output of the step of the same name.

Imports ``events`` and ``errors`` only.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from steplib import errors
from steplib.errors import ConfigError, describe
from steplib.events import Event, Handler


class EMA(Handler):
    """``average = average.lerp(param, 1 - d)`` after each applied update (torch's
    ``AveragedModel`` EMA and timm's ``ModelEmaV3`` compute the same, bit for bit; both copy the
    weights at their first update: ``decay=lambda n: 0.0 if n == 1 else d``).

    Buffers (batch-norm statistics) are copied from the model, or with ``average_buffers=True``
    the floating-point ones averaged as the parameters are (torch's ``use_buffers=True``,
    timm's default) and the others copied.

    In a run of several steps, the updates followed are those of the optimizer that holds the
    model's parameters (``EMA(generator)``: G's), whatever optimizer the run counts and
    whatever the steps are named (each updates the optimizer it was built with).

    Args:
        model: the trained module (a DDP wrapper: pass the inner module; an FSDP2-sharded one
            is refused); in a state of several optimizers, a module that exactly one of them
            updates.
        decay: the weight of the old average, in [0, 1); or a function of the update's
            number ``n`` (``state.step`` after it: 1 for the first, skipped updates counted)
            that gives it, called on the host (timm's ``ModelEmaV3.get_decay``, whose first
            update copies the weights: ``decay(1) == 0.0``).
        warmup: use ``d = min(decay, (1 + n) / (10 + n))`` after ``n`` applied updates, so the
            average does not stay near the initial weights for thousands of updates.
        average_buffers: average the floating-point buffers too, instead of copying them.
        device: where to keep the average (``None``: with the model; ``"cpu"`` saves GPU memory
            at the cost of a copy per update).

    Raises:
        ConfigError: ``model`` not a module, or sharded by FSDP2; ``decay`` not in [0, 1)
            (when an update's number gives it: at that update), or a function with
            ``warmup=True``;
            at ``fit_start``, in a state of several optimizers, none or several of them hold
            the model's parameters.

    Example:
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> ema = EMA(model, decay=0.5)
        >>> _ = model.weight.data.fill_(1.0)
        >>> ema.update(did_update=torch.tensor(True))
        >>> ema.update(did_update=torch.tensor(False))   # a skipped update changes nothing
        >>> ema.module.weight.item(), ema.updates
        (0.5, 1)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        decay: float | Callable[[int], float] = 0.999,
        warmup: bool = False,
        average_buffers: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"EMA(model) received {describe(model)}; pass the module being trained, e.g. "
                "EMA(model, decay=0.999)."
            )
        if callable(decay) and warmup:
            raise ConfigError(
                "EMA received a function as decay and warmup=True: the function gives the decay "
                "of every update, warmup included. Pass one: EMA(model, decay=fn) or "
                "EMA(model, decay=0.999, warmup=True)."
            )
        if not callable(decay):
            _check_decay(decay, "EMA(decay=...)")
        fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
        if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
            # FSDP2 refuses the deep copy (its "does not support deepcopy" assertion).
            raise ConfigError(
                "EMA(model) received an FSDP2-sharded model, each rank holding a shard of its "
                "parameters: EMA keeps a deep copy of the model, which FSDP2 cannot give. Keep "
                "the EMA under DDP (apply_ddp) or tensor parallelism (apply_tp), or in one "
                "process."
            )
        self.model = model
        self.decay: float | Callable[[int], float] = decay if callable(decay) else float(decay)
        self.warmup = warmup
        self.average_buffers = average_buffers
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        if device is not None:
            self.module.to(device)
        self._averaged: list[torch.Tensor] = self._averages(self.module)
        self._count = torch.zeros((), device=self._averaged[0].device if self._averaged else None)
        self._last: Any = None
        # The name of the optimizer that updates the model, in a state of several; else None;
        # and the names of the run's steps that update it.
        self._optimizer: str | None = None
        self._steps: list[str] = []
        self._found = False  # whether _optimizer was looked up in this run's state

    def on_fit_start(self, event: Event) -> None:
        """Find the optimizer that updates the model (in a state of several optimizers).

        Raises:
            ConfigError: in a state of several optimizers, no optimizer or more than one holds
                the model's parameters (the message names them and the fix).
        """
        self._found = False
        self._follow(event.state)
        steps = errors.step_optimizers("EMA(model)", event)
        if steps:
            self._steps = [
                step for step, optimizer in steps.items() if optimizer == self._optimizer
            ]

    def _follow(self, state: Any) -> None:
        if self._found:
            return
        self._found, self._optimizer = True, None
        names = getattr(state, "names", ())
        if not names:  # one optimizer: every update of the run is the model's
            return
        mine = {id(p) for p in self.model.parameters()}
        holders = [
            name
            for name in names
            if any(id(p) in mine for g in state[name].optimizer.param_groups for p in g["params"])
        ]
        if len(holders) != 1:
            held = f"optimizers {holders}" if holders else "no optimizer"
            raise ConfigError(
                f"EMA(model): {held} of the state ({list(names)}) hold the model's parameters, so "
                "there is no one optimizer whose updates it follows. Average the model that "
                "one optimizer updates, one EMA each: EMA(generator) for the optimizer over "
                "generator.parameters()."
            )
        self._optimizer = holders[0]
        self._steps = [self._optimizer]  # without the run's steps: named by their optimizers

    @property
    def updates(self) -> int:
        """Applied updates averaged so far (reading it is a host sync)."""
        return int(self._count.item())

    def on_micro_step_end(self, event: Event) -> None:
        """In a run of several steps: average if the model's optimizer closed its window."""
        if event.outputs is not None:
            self._follow(event.state)
            if self._optimizer is not None:
                self._average(event, event.outputs)

    def on_step_end(self, event: Event) -> None:
        """Average if this update was applied (``event.output.did_update``); in a run of several
        steps, if the model's optimizer's window closed in a flush (no micro-batch ran)."""
        self._follow(event.state)
        if event.outputs is not None and self._optimizer is not None:
            self._average(event, event.outputs)
            return
        out = event.output
        if out is None or out is self._last:
            return
        self._last = out
        self.update(did_update=out.did_update, step=event.step)

    def _average(self, event: Event, outputs: Mapping[str, Any]) -> None:
        name = self._optimizer
        assert name is not None
        # The optimizer's window is empty after this call only if the call closed it (an
        # update, applied or skipped): a host int, no read of out.did_update.
        if event.state[name].window.size != 0:
            return
        for step in self._steps:
            out = outputs.get(step)  # None: that step did not run (or a flush did not update)
            if out is not None and out is not self._last:
                self._last = out
                self.update(did_update=out.did_update, step=event.state[name].step)

    @torch.no_grad()
    def update(self, *, did_update: torch.Tensor | bool = True, step: int | None = None) -> None:
        """Move the average towards the model's current weights (device ops only).

        Args:
            did_update: whether the optimizer applied an update; a tensor is used as is (no
                host read), so a skipped update is a multiply by zero.
            step: the update's number (``state.step`` after it), for a ``decay`` given as a
                function; the handler passes it.

        Raises:
            ConfigError: the model's parameters changed since the EMA was built; a decay
                function without ``step``, or that gave a value outside [0, 1).
        """
        current = self._averages(self.model)
        averaged = self._averaged
        if len(current) != len(averaged):
            raise ConfigError(
                f"EMA: the model has {len(current)} averaged tensors now, the average "
                f"{len(averaged)}; the model changed after EMA(model) was built. Build "
                "the EMA after the model is final (after wrapping or freezing)."
            )
        applied = torch.as_tensor(did_update).to(self._count.device, torch.float32)
        if applied.dim() > 0:  # a sweep's: each copy updates (or is stopped) on its own
            raise ConfigError(
                f"EMA received did_update of shape {tuple(applied.shape)}, one per copy of a "
                "sweep; an EMA averages one model, whose updates it counts as one. Average a "
                "copy taken out after the sweep: EMA(copies.copy(i)) in its own run."
            )
        self._count += applied
        decay: torch.Tensor | float
        if callable(self.decay):
            if step is None:
                raise ConfigError(
                    "EMA.update() without step=..., for an EMA whose decay is a function of "
                    "the update's number: pass it, ema.update(did_update=..., step=state.step)."
                )
            # A host float, as timm's get_decay gives it: 1 - decay rounds once, as there.
            decay = _check_decay(self.decay(step), f"EMA's decay function at update {step}")
        elif self.warmup:
            decay = torch.clamp((1 + self._count) / (10 + self._count), max=self.decay)
        else:
            decay = self.decay
        weight = (1 - decay) * applied
        current = [c.detach().to(a.device) for c, a in zip(current, averaged, strict=True)]
        # lerp, not average + w * (param - average): its fused multiply-add rounds once, as
        # torch's AveragedModel EMA and timm's ModelEmaV3 do (the two differ in the last bits).
        torch._foreach_lerp_(averaged, current, [weight] * len(averaged))
        for mine, theirs in zip(self.module.buffers(), self.model.buffers(), strict=True):
            if not (self.average_buffers and mine.is_floating_point()):
                mine.copy_(theirs)

    def _averages(self, module: nn.Module) -> list[torch.Tensor]:
        """The tensors of ``module`` that are averaged: its parameters, and its floating-point
        buffers with ``average_buffers``."""
        tensors: list[torch.Tensor] = list(module.parameters())
        if self.average_buffers:
            tensors += [b for b in module.buffers() if b.is_floating_point()]
        return tensors

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights, the decay and the update count (for a checkpoint's extras)."""
        return {**self._built(), "module": self.module.state_dict(), "count": self._count.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ConfigError: the saved decay or warmup differs from this EMA's (a resumed run
                would average differently).
        """
        errors.same_handler("EMA", self._built(), state)
        self.module.load_state_dict(state["module"])
        self._count.copy_(state["count"])

    def _built(self) -> dict[str, Any]:
        # A decay function cannot be compared with the one that saved: any is taken.
        decay = "a function" if callable(self.decay) else self.decay
        return {"decay": decay, "warmup": self.warmup, "average_buffers": self.average_buffers}


def _check_decay(decay: Any, where: str) -> float:
    """``decay`` as a float, or ``ConfigError`` where it is not a number in [0, 1)."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay < 1:
        raise ConfigError(
            f"{where} received {describe(decay)}; it must be a number in [0, 1), "
            "the weight kept by the old average each update, e.g. decay=0.999."
        )
    return float(decay)

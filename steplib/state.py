"""``TrainState`` (everything a step reads and advances) and ``StepOutput`` (what a step reports).

What is replaced and what is changed in place
---------------------------------------------
steplib is functional where Python can afford it and PyTorch where it cannot:

* **Replaced** (a step returns a new ``TrainState``; the one you passed in is never touched):
  the counters ``step``, ``micro_step``, ``epoch``, ``window_size``, ``skipped_updates``,
  ``consecutive_skips``, the accumulation window tensors ``window_loss`` / ``window_targets``,
  and ``extras``.
* **Changed in place** (shared by the old and the new state, exactly as in a plain PyTorch loop):
  the model's parameters and their ``.grad``, the optimizer's buffers, the scheduler's position
  and the ``GradScaler``'s scale. Copying them each step would cost a model's worth of memory.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from steplib.errors import ConfigError, describe

_Scheduler = Any  # torch.optim.lr_scheduler.LRScheduler; Any keeps ReduceLROnPlateau-style objects


class Joinable(Protocol):
    """Work in flight: ``join()`` returns once it has ended."""

    def join(self) -> None: ...


class UpdateFence:
    """Work that must end before the next optimizer update changes the parameters and the
    optimizer's state in place.

    An async checkpoint (``steplib.checkpoint.AsyncSaver``) copies the parameters and the
    optimizer state in a background thread while the next forward and backward run (they only
    read them); it puts that copy here with :meth:`hold`. Every step waits here just before its
    update, and ``load`` before it overwrites them. One fence belongs to the states derived from
    one ``TrainState.create`` (``replace`` keeps it), so nothing is global. Waiting only joins
    threads: no tensor is read.
    """

    __slots__ = ("_lock", "_pending")

    def __init__(self) -> None:
        self._pending: list[Joinable] = []
        self._lock = threading.Lock()

    def hold(self, work: Joinable) -> None:
        """Make the next update (and :meth:`wait`) wait for ``work``."""
        with self._lock:
            self._pending.append(work)

    @property
    def held(self) -> int:
        """How many pieces of work the next update would wait for."""
        return len(self._pending)

    def wait(self) -> None:
        """Block until the work held so far has ended."""
        if not self._pending:  # the common case, once per update: no lock
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for work in pending:
            work.join()


@dataclasses.dataclass(frozen=True, slots=True)
class TrainState:
    """Everything a training step reads and advances. Build it with :meth:`TrainState.create`.

    Attributes:
        model: the module being trained (its parameters change in place).
        optimizer: the optimizer over ``model``'s parameters (its buffers change in place).
        scheduler: an LR scheduler bound to ``optimizer``, stepped once per applied update.
        scaler: a ``torch.amp.GradScaler`` for float16 mixed precision, else ``None``.
        step: closed accumulation windows, i.e. optimizer updates attempted (a skipped update
            counts too, as in Lightning's ``global_step``; ``skipped_updates`` says how many).
        micro_step: micro-batches seen (calls of the step).
        epoch: completed passes over the data, advanced by the loop driver.
        window_size: micro-batches in the open accumulation window.
        window_loss: sum of the loss sums in the open window, a float32 tensor on ``device``
            (the Python float ``0.0`` while the window is empty: no kernel to make a zero).
        window_targets: sum of the target counts in the open window: a Python int while every
            count was an int (a plain scalar loss counts 1), else a 0-dim tensor on ``device``.
        skipped_updates: updates skipped because of non-finite values, in total: an int, or a
            0-dim device tensor when the skip decision stays on the device (a fused optimizer
            with no scheduler or a ``LambdaLR``; see ``steplib.device_skips``).
        consecutive_skips: updates skipped in a row up to now (an int or a tensor, likewise).
        device: the device of the model's parameters (where the window tensors live).
        extras: a read-only mapping for the user's own values (replace it, do not mutate it).
        device_skips: the bookkeeping of a skip decision kept on the device (the scheduler's
            position and its learning-rate table), else ``None``. Checkpoints do not store it:
            it is rebuilt from the scheduler on the next update.
        fence: the :class:`UpdateFence` the next update waits at (async checkpoints hold their
            background copies there); shared by every state derived from this one.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: _Scheduler | None
    scaler: torch.amp.GradScaler | None
    step: int
    micro_step: int
    epoch: int
    window_size: int
    window_loss: torch.Tensor | float
    window_targets: torch.Tensor | int
    skipped_updates: int | torch.Tensor
    consecutive_skips: int | torch.Tensor
    device: torch.device
    extras: Mapping[str, Any]
    device_skips: Any = None  # steplib.step.device_skips.DeviceSkips: the step owns it
    fence: UpdateFence = dataclasses.field(default_factory=UpdateFence, compare=False)

    @classmethod
    def create(
        cls,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: _Scheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> TrainState:
        """Check the pieces belong together and return the state at step 0.

        Args:
            model: an ``nn.Module`` with at least one trainable parameter.
            optimizer: an optimizer whose parameters are all parameters of ``model``.
            scheduler: optional LR scheduler whose ``.optimizer`` is ``optimizer``.
            scaler: optional ``torch.amp.GradScaler`` (needed for float16 mixed precision).
            extras: optional mapping of user values carried along (and checkpointed later).

        Returns:
            A ``TrainState`` with every counter at 0 and an empty accumulation window.

        Raises:
            ConfigError: a piece of the wrong type, an optimizer over parameters that are not
                the model's, a scheduler bound to another optimizer, or a schedule function
                (``warmup_cosine(...)``) where a scheduler (``LambdaLR(optimizer, ...)``) goes.

        Example:
            >>> import torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> state = TrainState.create(model=model, optimizer=opt)
            >>> (state.step, state.micro_step, state.window_size)
            (0, 0, 0)
        """
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"TrainState.create(model=...) received {describe(model)}, which is not a "
                "torch.nn.Module. Pass the module you train, e.g. model=MyNet()."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"TrainState.create(optimizer=...) received {describe(optimizer)}, which is not a "
                "torch.optim.Optimizer. Pass e.g. optimizer=torch.optim.AdamW(model.parameters())."
            )
        model_params = {id(p) for p in model.parameters()}
        if not model_params:
            raise ConfigError(
                f"TrainState.create received a model ({type(model).__name__}) with no parameters; "
                "there is nothing to train. Pass the module that owns the parameters."
            )
        foreign = [
            i
            for group in optimizer.param_groups
            for i, p in enumerate(group["params"])
            if id(p) not in model_params
        ]
        if foreign:
            raise ConfigError(
                f"TrainState.create: the optimizer holds {len(foreign)} parameter(s) that are not "
                f"parameters of the model ({type(model).__name__}); it was probably built for "
                "another model or a copy of it. Build it from this model: "
                "optimizer=torch.optim.AdamW(model.parameters(), ...)."
            )
        if callable(scheduler) and not hasattr(scheduler, "step"):
            # A schedule function (steplib.schedules) is what LambdaLR takes, not a scheduler.
            name = getattr(scheduler, "__qualname__", "")
            if ".<locals>" in name:  # what a builder such as warmup_cosine(...) returns
                example = f"{name.split('.<locals>')[0]}(...)"
                received = f"the function that {example} returns"
            else:
                example, received = name if name.isidentifier() else "schedule", describe(scheduler)
            raise ConfigError(
                f"TrainState.create(scheduler=...) received {received}: a schedule function "
                "(update index -> LR multiplier), not an LR scheduler. Wrap it in a LambdaLR "
                "built from this optimizer: scheduler=torch.optim.lr_scheduler.LambdaLR("
                f"optimizer, {example})."
            )
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
            raise ConfigError(
                f"TrainState.create: the scheduler ({type(scheduler).__name__}) is not bound to "
                "this optimizer, so stepping it would not change this optimizer's learning rate. "
                "Build it from the same optimizer: scheduler=LambdaLR(optimizer, ...)."
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(
                f"TrainState.create(scaler=...) received {describe(scaler)}. Pass a "
                "torch.amp.GradScaler, e.g. scaler=torch.amp.GradScaler('cuda'), or None."
            )
        device = next(iter(model.parameters())).device
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            step=0,
            micro_step=0,
            epoch=0,
            window_size=0,
            window_loss=0.0,
            window_targets=0,
            skipped_updates=0,
            consecutive_skips=0,
            device=device,
            extras=types.MappingProxyType(dict(extras or {})),
        )

    def settle_scheduler(self) -> None:
        """Bring the scheduler up to date on the host when a skip decision kept its position on
        the device (a fused optimizer with ``skip_nonfinite``; see
        ``steplib.step.device_skips``): ``last_epoch``, ``get_last_lr()`` and ``_step_count``
        become what stepping it once per applied update would have left. A no-op otherwise.

        Saving a checkpoint and the end of ``run``/``iterate`` call it; call it yourself before
        reading the scheduler object in your own loop. It reads one number from the device (a
        host sync): call it where one is paid anyway. The rate each update used is ``out.lr``.
        """
        if self.device_skips is not None and self.scheduler is not None:
            self.device_skips.settle(self.scheduler)

    def replace(self, **changes: Any) -> TrainState:
        """The next state with ``changes`` applied (``dataclasses.replace``, checked the same way).

        Raises:
            TypeError: a name that is not a field.
        """
        if not _FIELD_SET.issuperset(changes):  # no set built on the hot path
            unknown = sorted(changes.keys() - _FIELD_SET)
            raise TypeError(f"TrainState has no field(s) {unknown}; fields: {_FIELDS}")
        return _evolve(self, changes)


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
_FIELD_SET = frozenset(_FIELDS)
_SETTERS = tuple(vars(TrainState)[name].__set__ for name in _FIELDS)


def _copier() -> Any:
    """``_evolve(state, changes)``: the next state, ``dataclasses.replace`` without its per-call
    field introspection and ``__init__``. Its body is written out field by field when this
    module is imported, as ``dataclasses`` writes ``__init__``: the step calls it on every
    micro-batch, where a loop over the fields cost ~30 us more per update of the tiny MLP
    (``benchmarks/bench_overhead.py``). Callers pass only field names."""
    body = "".join(
        f"    set_{name}(new, changes['{name}'] if '{name}' in changes else state.{name})\n"
        for name in _FIELDS
    )
    scope: dict[str, Any] = {f"set_{n}": set_ for n, set_ in zip(_FIELDS, _SETTERS, strict=True)}
    scope["new_state"] = TrainState.__new__
    scope["cls"] = TrainState
    exec(f"def _evolve(state, changes):\n    new = new_state(cls)\n{body}    return new\n", scope)
    return scope["_evolve"]


_evolve: Any = _copier()


class StepOutput:
    """What one call of a step reports. Every value is a tensor left where it was computed:
    reading one (``.item()``, ``float()``) is a host sync, so do it in a handler, not per step.

    The tensors are made when first read, from values the step already holds, so a step whose
    outputs are read every 100 updates does not pay for building them on the other 99.

    Attributes:
        loss: the normalised loss. On the call that closes a window it is the window's
            loss (sum of loss sums / sum of targets), i.e. the loss that the applied gradient is
            the gradient of; on other calls it is that micro-batch's own normalised loss.
        num_targets: targets in that loss (the window's total on an update).
        has_targets: (property) whether ``num_targets`` > 0; a window without targets
            contributes no gradient (its gradients are zeroed, never divided by 0 or less).
        did_update: bool tensor, whether the optimizer applied an update on this call.
        skipped: bool tensor, whether an update was due but skipped (non-finite values).
        grad_norm: total gradient norm before clipping, when clipping or a finiteness check
            measured it on this call, else ``None``.
        lr: learning rate (float64) of the first parameter group used by this call.
        aux: the auxiliary tensors returned by ``loss_fn`` for this micro-batch, detached.
    """

    __slots__ = ("_aux", "_did_update", "_lr", "_skipped", "_sum", "_targets", "grad_norm")
    _sum: torch.Tensor
    _targets: torch.Tensor | float
    _did_update: torch.Tensor | bool
    _skipped: torch.Tensor | bool
    grad_norm: torch.Tensor | None
    _lr: torch.Tensor | float
    _aux: Mapping[str, torch.Tensor]

    def __init__(
        self,
        *,
        loss_sum: torch.Tensor,
        num_targets: torch.Tensor | float,
        did_update: torch.Tensor | bool,
        skipped: torch.Tensor | bool,
        grad_norm: torch.Tensor | None,
        lr: torch.Tensor | float,
        aux: Mapping[str, torch.Tensor],
    ) -> None:
        # The slot descriptors' setters: this runs on every micro-batch, and the class's own
        # __setattr__ refuses every assignment.
        set_sum, set_targets, set_did, set_skipped, set_norm, set_lr, set_aux = _OUTPUT_SETTERS
        set_sum(self, loss_sum)
        set_targets(self, num_targets)
        set_did(self, did_update)
        set_skipped(self, skipped)
        set_norm(self, grad_norm)
        set_lr(self, lr)  # the caller passes a copy when the LR is a tensor
        set_aux(self, aux)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepOutput is read-only; cannot set {name!r}")

    @property
    def loss(self) -> torch.Tensor:
        return self._sum.float() / self._targets

    @property
    def num_targets(self) -> torch.Tensor:
        return torch.as_tensor(self._targets)

    @property
    def has_targets(self) -> torch.Tensor:
        """Bool tensor: whether the loss counted any target. A window whose count is 0 (or a
        tensor count <= 0) contributed no gradient: the update saw zero gradients."""
        return torch.as_tensor(self._targets) > 0

    @property
    def did_update(self) -> torch.Tensor:
        return torch.as_tensor(self._did_update)

    @property
    def skipped(self) -> torch.Tensor:
        return torch.as_tensor(self._skipped)

    @property
    def lr(self) -> torch.Tensor:
        return torch.as_tensor(self._lr, dtype=torch.float64)

    @property
    def aux(self) -> Mapping[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._aux.items()}

    def __repr__(self) -> str:
        names = ("loss", "num_targets", "did_update", "skipped", "grad_norm", "lr", "aux")
        return "StepOutput(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


_OUTPUT_SETTERS = tuple(
    vars(StepOutput)[name].__set__
    for name in ("_sum", "_targets", "_did_update", "_skipped", "grad_norm", "_lr", "_aux")
)

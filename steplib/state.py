"""``TrainState`` (everything a step reads and advances) and ``StepOutput`` (what a step reports).

What is replaced and what is changed in place
---------------------------------------------
steplib is functional where Python can afford it and PyTorch where it cannot:

* **Replaced** (a step returns a new ``TrainState``; the one you passed in is never touched):
  the counters ``step``, ``micro_step``, ``epoch``, ``skipped_updates``, ``consecutive_skips``,
  the accumulation ``window`` (:class:`Window`), and ``extras``.
* **Changed in place** (shared by the old and the new state, exactly as in a plain PyTorch loop):
  the model's parameters and their ``.grad``, the optimizer's buffers, the scheduler's position
  and the ``GradScaler``'s scale. Copying them each step would cost a model's worth of memory.

So only the newest state describes them: a step (and a save) refuses any other with a
``ConfigError`` (:mod:`steplib.lineage`). Go on from the state the last call returned;
``state.replace(step=..., micro_step=...)`` makes the state it returns the newest (``load``
does so to go back to a checkpoint); ``copy.deepcopy(state)`` is a run of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from steplib.errors import ConfigError
from steplib.fence import UpdateFence
from steplib.lineage import Lineage
from steplib.state_checks import (
    as_module,
    check_disjoint,
    check_frozen,
    check_names,
    check_no_gradients,
    check_owners,
    check_pieces,
    check_swapped,
)

EVALUATED_AT = "evaluated_at"  # extras: {value name: the update whose model it evaluated}
_Scheduler = Any  # torch.optim.lr_scheduler.LRScheduler; Any keeps ReduceLROnPlateau-style objects
_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


class Window(NamedTuple):
    """The open accumulation window: what the micro-batches since the last update added up to
    (a named tuple: made on every micro-batch, and immutable).

    Attributes:
        size: micro-batches in the window.
        loss: the sum of their loss sums: a tensor on the model's device in float32 (float64
            for a float64 loss), or the Python float ``0.0`` while the window is empty (no
            kernel to make a zero).
        targets: the sum of their target counts: a Python int while every count was an int (a
            plain scalar loss counts 1), else a 0-dim tensor on the model's device.
    """

    size: int = 0
    loss: torch.Tensor | float = 0.0
    targets: torch.Tensor | int = 0


EMPTY_WINDOW = Window()


@dataclasses.dataclass(frozen=True, slots=True)
class Lane:
    """This optimizer's place among the optimizers created together (``TrainState.create(
    optimizer={"G": ..., "D": ...})`` makes several), and the fence their updates wait at.

    Attributes:
        fence: the :class:`~steplib.fence.UpdateFence` the next update waits at (async
            checkpoints hold their background copies there); one for every state derived from
            one ``TrainState.create``, and for every optimizer of it.
        name: the optimizer's name when the state trains several, else ``None``. The
            backward of a step for a named optimizer accumulates into the parameters of its
            groups that require a gradient at that moment (``loss.backward(inputs=...)``, read
            per micro-batch as plain torch reads them, so a parameter frozen, unfrozen or
            added with ``add_param_group`` later is handled), so the generator's step never
            adds to the discriminator's open accumulation window.
        others: on the first optimizer's state, the other optimizers' states by name, as
            their steps left them; empty on theirs.
        lineage: this optimizer's :class:`~steplib.lineage.Lineage`, the counters of its
            newest state (shared by all its states, per optimizer: a step compares without a
            lookup), which a step requires of the state it receives; a ``load`` gives the
            state it returns a new one, and every state from before it is refused.
    """

    fence: UpdateFence
    name: str | None = None
    others: Mapping[str, TrainState] = dataclasses.field(default_factory=lambda: _EMPTY)
    lineage: Lineage = dataclasses.field(default_factory=Lineage, compare=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> Lane:
        # A fence and lineage of the copy's own (the fence's held work reads the original's).
        copied = (self.fence, self.name, self.others, self.lineage)
        return Lane(*(_deepcopy(value, memo) for value in copied))


@dataclasses.dataclass(frozen=True, slots=True)
class TrainState:
    """Everything a training step reads and advances. Build it with :meth:`TrainState.create`.

    A state with several optimizers (a GAN) is the first one's: its fields below are that
    optimizer's, and ``state["D"]`` is the state of the one named ``"D"`` (the same model,
    epoch and extras), which ``make_train_step(loss_fn, optimizer="D")`` advances.

    Attributes:
        model: the module being trained (its parameters change in place).
        optimizer: the optimizer over ``model``'s parameters (its buffers change in place).
        scheduler: an LR scheduler bound to ``optimizer``, stepped once per applied update.
        scaler: a ``torch.amp.GradScaler`` for float16 mixed precision, else ``None``.
        step: closed accumulation windows, i.e. optimizer updates attempted (a skipped update
            counts too, as in Lightning's ``global_step``; ``skipped_updates`` says how many).
        micro_step: micro-batches seen (calls of the step).
        epoch: completed passes over the data, advanced by the loop driver.
        window: the open accumulation window (:class:`Window`): its size, loss sum and target
            count.
        skipped_updates: updates skipped in total (a non-finite loss or gradient, or a window
            with no targets), a 0-dim int64 tensor on the model's device: the decision to skip
            may be made there, and is never read back to count it.
        consecutive_skips: updates skipped in a row up to now, a tensor likewise.
        extras: a read-only mapping for the user's own values (replace it, do not mutate it).
            An evaluation puts its values here, and under ``extras[EVALUATED_AT]`` the update
            each value belongs to (``{"val_loss": 20}``), so that a checkpoint of a later
            model does not record it as its own.
        lane: this optimizer's place among the optimizers created with it (:class:`Lane`:
            its name and the others' states when there are several) and the fence updates
            wait at.
        scheduler_at: the scheduler's position (its ``last_epoch``) as the last update of a
            step left it, or ``None`` when no step has stepped it since it was set (``create``,
            ``replace(scheduler=...)``, a checkpoint's load). The next update refuses a scheduler
            found elsewhere: stepped outside the step too, it would advance twice per update.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: _Scheduler | None
    scaler: torch.amp.GradScaler | None
    step: int
    micro_step: int
    epoch: int
    window: Window
    skipped_updates: torch.Tensor
    consecutive_skips: torch.Tensor
    extras: Mapping[str, Any]
    lane: Lane = dataclasses.field(compare=False)
    scheduler_at: int | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def create(
        cls,
        *,
        model: nn.Module | Mapping[str, nn.Module],
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
        scheduler: _Scheduler | Mapping[str, _Scheduler] | None = None,
        scaler: torch.amp.GradScaler | Mapping[str, torch.amp.GradScaler] | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> TrainState:
        """Check the pieces belong together and return the state at step 0.

        Args:
            model: an ``nn.Module`` with at least one trainable parameter; or a dict of named
                modules (``{"G": g, "D": d}``), which becomes one ``nn.ModuleDict`` that
                ``loss_fn`` receives. A parameter that no optimizer updates must be frozen
                (``teacher.requires_grad_(False)``).
            optimizer: an optimizer whose parameters are all parameters of ``model``; or a
                dict of named optimizers over disjoint parameters (``{"G": opt_g, "D":
                opt_d}``), each with its own window and counters: the first is the state's
                own, and each step names the one it updates.
            scheduler: optional LR scheduler whose ``.optimizer`` is ``optimizer``; with named
                optimizers, a dict by their names (any of them).
            scaler: optional ``torch.amp.GradScaler`` (needed for float16 mixed precision);
                with named optimizers, a dict by their names.
            extras: optional mapping of user values carried along (and checkpointed later).

        Returns:
            A ``TrainState`` with every counter at 0 and an empty accumulation window.

        Raises:
            ConfigError: a piece of the wrong type, an optimizer over parameters that are not
                the model's, a trainable parameter that no optimizer updates, a scheduler
                bound to another optimizer, or a schedule function (``warmup_cosine(...)``)
                where a scheduler (``LambdaLR(optimizer, ...)``) goes, a parameter that holds a
                gradient already (``model.zero_grad()`` first); with named pieces: a name that
                is not an optimizer's, a parameter in two optimizers.

        Example:
            >>> import torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> state = TrainState.create(model=model, optimizer=opt)
            >>> (state.step, state.micro_step, state.window.size)
            (0, 0, 0)

            Two optimizers, one state:

            >>> g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
            >>> state = TrainState.create(
            ...     model={"G": g, "D": d},
            ...     optimizer={"G": torch.optim.Adam(g.parameters()),
            ...                "D": torch.optim.Adam(d.parameters())},
            ... )
            >>> state.names, state["D"].step
            (('G', 'D'), 0)
        """
        modules = as_module(model)
        extras = types.MappingProxyType(dict(extras or {}))
        fence = UpdateFence()  # one for all: a save copies every optimizer's state
        if not isinstance(optimizer, Mapping):
            check_pieces(modules, optimizer, scheduler, scaler, key="")
            check_frozen(model, [optimizer])
            check_no_gradients([optimizer])
            return cls._at_zero(modules, optimizer, scheduler, scaler, extras, Lane(fence))  # type: ignore[arg-type]
        names = check_names(optimizer, scheduler, scaler)
        schedulers: Mapping[str, Any] = scheduler or _EMPTY
        scalers: Mapping[str, Any] = scaler or _EMPTY  # type: ignore[assignment]
        states: dict[str, TrainState] = {}
        for name in names:
            opt, sch, sc = optimizer[name], schedulers.get(name), scalers.get(name)
            check_pieces(modules, opt, sch, sc, key=f"[{name!r}]")
            states[name] = cls._at_zero(modules, opt, sch, sc, extras, Lane(fence, name))
        check_disjoint({name: optimizer[name] for name in names})
        check_owners(model, {name: optimizer[name] for name in names})
        check_frozen(model, [optimizer[name] for name in names])
        check_no_gradients([optimizer[name] for name in names])
        first, *rest = names
        others = types.MappingProxyType({n: states[n] for n in rest})
        lane = dataclasses.replace(states[first].lane, others=others)
        return _evolve(states[first], {"lane": lane})

    @classmethod
    def _at_zero(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: _Scheduler | None,
        scaler: torch.amp.GradScaler | None,
        extras: Mapping[str, Any],
        lane: Lane,
    ) -> TrainState:
        # One zero for both skip counters: a counter is replaced, never changed in place.
        zero = torch.zeros((), dtype=torch.int64, device=next(iter(model.parameters())).device)
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            step=0,
            micro_step=0,
            epoch=0,
            window=EMPTY_WINDOW,
            skipped_updates=zero,
            consecutive_skips=zero,
            extras=extras,
            lane=lane,
        )

    @property
    def device(self) -> torch.device:
        """The device of the model's (first) parameter: where the window and counters live."""
        return self.skipped_updates.device

    @property
    def fence(self) -> UpdateFence:
        """The :class:`~steplib.fence.UpdateFence` the next update waits at (``lane.fence``)."""
        return self.lane.fence

    @property
    def names(self) -> tuple[str, ...]:
        """The optimizers' names, the state's own first, when it trains several; else ``()``."""
        lane = self.lane
        return () if lane.name is None else (lane.name, *lane.others)

    def __getitem__(self, name: str) -> TrainState:
        """The state of the optimizer named ``name``: its optimizer, scheduler, scaler,
        counters and window, with this state's model, epoch and extras.

        Raises:
            KeyError: no optimizer of this state has that name (the message lists them).
        """
        lane = self.lane
        if lane.name is not None:
            if name == lane.name:
                return self
            if name in lane.others:
                return _evolve(lane.others[name], {"epoch": self.epoch, "extras": self.extras})
        raise KeyError(
            f"state[{name!r}]: this state's optimizers are {list(self.names)}"
            + ("" if self.names else " (one, unnamed: TrainState.create(optimizer=opt))")
        )

    def with_lane(self, state: TrainState) -> TrainState:
        """This state with ``state`` (another optimizer's, as ``self[name]`` gives and its
        step or a ``run`` on it returns) put in its place, with its epoch and extras: they are
        the whole state's, which a run on that optimizer's state advanced.

        Raises:
            ConfigError: ``state`` is not the state of one of this state's optimizers.
        """
        lane, theirs = self.lane, state.lane
        if lane.name is None or theirs.name is None or theirs.name not in self.names:
            raise ConfigError(
                f"with_lane received the state of optimizer {theirs.name!r}; this state's "
                f"optimizers are {list(self.names)}. Pass what state[name] or a step for that "
                "name returned."
            )
        if theirs.name == lane.name:
            return state
        others = types.MappingProxyType({**lane.others, theirs.name: state})
        # Its epoch and extras as for the state's own lane (returned whole above): a run on
        # state[name] counted its passes and recorded its evaluations there.
        lane = dataclasses.replace(lane, others=others)
        return _evolve(self, {"lane": lane, "epoch": state.epoch, "extras": state.extras})

    def __deepcopy__(self, memo: dict[int, Any]) -> TrainState:
        """``copy.deepcopy(state)``: a run of its own (its model, optimizer, scheduler, scaler,
        lineage and fence copied, its other optimizers' states with them), to branch off."""
        new = TrainState.__new__(TrainState)
        memo[id(self)] = new
        for name, set_field in _SETTERS:  # the model first: the optimizer's copy refers to it
            set_field(new, _deepcopy(getattr(self, name), memo))
        # torch's Parameter.__deepcopy__ leaves .grad behind: an open window's is the run's.
        for mine, copied in zip(self.model.parameters(), new.model.parameters(), strict=True):
            if mine.grad is not None and copied.grad is None:
                copied.grad = copy.deepcopy(mine.grad, memo)
        return new

    def replace(self, **changes: Any) -> TrainState:
        """The next state with ``changes`` applied (``dataclasses.replace``, checked the same way);
        a model, optimizer, scheduler or scaler swapped in is checked as ``create`` checks it.
        A scheduler passed in is taken at its own position (``scheduler_at`` becomes ``None``
        unless given): pass it again after setting its position by hand (``load_state_dict``).
        New counters (``step``, ``micro_step``) make the state returned the newest of its run:
        a step refuses every other (:mod:`steplib.lineage`).

        Raises:
            TypeError: a name that is not a field.
            ConfigError: the new pieces do not belong together (an optimizer over another
                model's parameters, a scheduler bound to another optimizer, ...), or another
                model for a state of several optimizers.
        """
        if not _FIELD_SET.issuperset(changes):  # no set built on the hot path
            unknown = sorted(changes.keys() - _FIELD_SET)
            raise TypeError(f"TrainState has no field(s) {unknown}; fields: {_FIELDS}")
        if "scheduler" in changes and "scheduler_at" not in changes:
            # A scheduler passed in is taken at its position (a new one, or one set by hand).
            changes = {**changes, "scheduler_at": None}
        new = _evolve(self, changes)
        if not _PIECES.isdisjoint(changes):  # never on the step's path: it replaces counters
            check_swapped(self, new)
        return new


_PIECES = frozenset({"model", "optimizer", "scheduler", "scaler"})
_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
_FIELD_SET = frozenset(_FIELDS)
_SETTERS = tuple(zip(_FIELDS, (vars(TrainState)[name].__set__ for name in _FIELDS), strict=True))


def _evolve(state: TrainState, changes: Mapping[str, Any]) -> TrainState:
    """The next state: ``dataclasses.replace`` without its per-call checks and ``__init__``
    (the step calls it on every micro-batch). Callers pass only field names."""
    new = TrainState.__new__(TrainState)
    for name, set_field in _SETTERS:  # a frozen dataclass's fields are set through their slots
        set_field(new, changes[name] if name in changes else getattr(state, name))
    if "micro_step" in changes or "step" in changes:
        # New counters: this state is now the newest of its optimizer, the one that describes
        # the model and optimizer changed in place; a step refuses any other (lineage.py).
        new.lane.lineage.record(new.step, new.micro_step)
    return new


def _deepcopy(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy``, and a read-only mapping (which it cannot copy) as a read-only copy."""
    if isinstance(value, types.MappingProxyType):
        return types.MappingProxyType(copy.deepcopy(dict(value), memo))
    return copy.deepcopy(value, memo)

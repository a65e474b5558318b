"""The checks ``TrainState.create`` runs on the pieces it is given, before building anything:
a module, optimizers over its parameters, schedulers bound to them, scalers; and for named
pieces (several optimizers), names that match and parameters that belong to one optimizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from steplib.errors import (
    ConfigError,
    describe,
    listed,
    required_arguments,
    stepped_without_arguments,
)


def as_module(model: Any) -> nn.Module:
    """``model`` itself, or a dict of named modules as one ``nn.ModuleDict``.

    Raises:
        ConfigError: not a module, or a dict with a name or value that a ModuleDict refuses.
    """
    if isinstance(model, Mapping):
        for name, module in model.items():
            if not (isinstance(name, str) and name.isidentifier()):
                raise ConfigError(
                    f"TrainState.create(model=...) received the module name {name!r}; name "
                    "each module with an identifier, e.g. model={'G': generator, 'D': critic}."
                )
            if hasattr(nn.ModuleDict, name):
                raise ConfigError(
                    f"TrainState.create(model=...) received a module named {name!r}, which is "
                    f"the name of an nn.Module method or attribute (model.{name}), so the "
                    "ModuleDict that holds the modules cannot take it. Rename it, e.g. "
                    f"model={{{name + '_net'!r}: ...}}."
                )
            if not isinstance(module, nn.Module):
                raise ConfigError(
                    f"TrainState.create(model=...) received a dict whose {name!r} is "
                    f"{describe(module)}, not a torch.nn.Module. Pass the module you train, "
                    "e.g. model=MyNet() (a state_dict goes in with model.load_state_dict(...) "
                    "first), or a dict of modules, e.g. model={'G': Generator(), 'D': Critic()}."
                )
        return nn.ModuleDict(model)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"TrainState.create(model=...) received {describe(model)}, which is not a "
            "torch.nn.Module. Pass the module you train, e.g. model=MyNet()."
        )
    return model


def check_pieces(
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    key: str,
    caller: str = "TrainState.create",
) -> None:
    """Raise ``ConfigError`` unless ``optimizer`` trains parameters of ``model``, ``scheduler``
    is an LR scheduler bound to it and ``scaler`` a GradScaler (``key``: ``"['D']"`` for a
    named optimizer, ``""`` for the one; ``caller``: ``"TrainState.replace"`` there)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{caller}(optimizer{key}=...) received {describe(optimizer)}, which is "
            "not a torch.optim.Optimizer. Pass e.g. "
            "optimizer=torch.optim.AdamW(model.parameters())."
        )
    if required_arguments(optimizer, "step"):
        raise ConfigError(
            f"{caller}(optimizer{key}=...) received {type(optimizer).__name__}, whose step() "
            "needs a closure that evaluates the loss again, several times per update (a line "
            "search). A steplib step runs the forward and backward once, then calls "
            "optimizer.step() without one. Train with a first-order optimizer (AdamW, SGD), or "
            "write that loop by hand: def closure(): optimizer.zero_grad(); loss = "
            "loss_fn(model, batch); loss.backward(); return loss, then optimizer.step(closure)."
        )
    model_params = {id(p) for p in model.parameters()}
    if not model_params:
        raise ConfigError(
            f"{caller} received a model ({type(model).__name__}) with no parameters; "
            "there is nothing to train. Pass the module that owns the parameters."
        )
    foreign = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in foreign if id(p) not in model_params]
    if foreign:
        raise ConfigError(
            f"{caller}: the optimizer{key} holds {len(foreign)} parameter(s) that are "
            f"not parameters of the model ({type(model).__name__}); it was probably built for "
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
            f"{caller}(scheduler{key}=...) received {received}: a schedule function "
            "(update index -> LR multiplier), not an LR scheduler. Wrap it in a LambdaLR "
            "built from this optimizer: scheduler=torch.optim.lr_scheduler.LambdaLR("
            f"optimizer, {example})."
        )
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        raise ConfigError(
            f"{caller}: the scheduler{key} ({type(scheduler).__name__}) is not bound "
            f"to {'this optimizer' if not key else 'the optimizer' + key}, so stepping it would "
            "not change that optimizer's learning rate. Build it from the same optimizer: "
            "scheduler=LambdaLR(optimizer, ...)."
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # Its step takes a value the step does not have: the first update would fail on it.
        raise ConfigError(
            f"{caller}(scheduler{key}=...) received a ReduceLROnPlateau, which steps on a "
            "value (a validation loss), and the step advances the state's scheduler once per "
            "update, with none. Create the state without it (scheduler=None) and feed it after "
            "each evaluation: events=[evaluator, Scheduler(plateau, metric=evaluator)] "
            "(steplib.handlers.Scheduler)."
        )
    if scheduler is not None:
        stepped_without_arguments(f"{caller}(scheduler{key}=...)", scheduler, "after each update")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigError(
            f"{caller}(scaler{key}=...) received {describe(scaler)}. Pass a "
            "torch.amp.GradScaler, e.g. scaler=torch.amp.GradScaler('cuda'), or None."
        )


def check_names(optimizers: Mapping[Any, Any], schedulers: Any, scalers: Any) -> tuple[str, ...]:
    """The optimizers' names, after checking that the schedulers and scalers are dicts over
    some of them.

    Raises:
        ConfigError: no optimizer, a name that is not a string, a single scheduler or scaler
            where a dict by name is needed, a name that is not an optimizer's, or one scaler
            under two names.
    """
    names = tuple(optimizers)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            f"TrainState.create(optimizer=...) received a dict with the names {list(names)}; "
            "name each optimizer with a non-empty string, e.g. optimizer={'G': opt_g, 'D': "
            "opt_d}, or pass a single optimizer."
        )
    for label, pieces in (("scheduler", schedulers), ("scaler", scalers)):
        if pieces is None:
            continue
        if not isinstance(pieces, Mapping):
            raise ConfigError(
                f"TrainState.create(optimizer=...) received named optimizers {list(names)} "
                f"but {label}={describe(pieces)}: say whose it is, e.g. "
                f"{label}={{{names[0]!r}: ...}}."
            )
        unknown = [n for n in pieces if n not in optimizers]
        if unknown:
            raise ConfigError(
                f"TrainState.create({label}=...) names {unknown}, which are not optimizers of "
                f"this state ({list(names)}). Use the optimizers' names as keys."
            )
    _check_own_scalers(scalers)
    return names


def _check_own_scalers(scalers: Mapping[str, Any] | None) -> None:
    """Refuse one GradScaler under two names: each optimizer's update changes the scale, so
    the other's open window would hold gradients scaled by the old scale, unscaled by the new."""
    seen: dict[int, str] = {}
    for name, scaler in (scalers or {}).items():
        first = seen.setdefault(id(scaler), name)
        if first != name:
            raise ConfigError(
                f"TrainState.create(scaler=...) received one GradScaler for both {first!r} and "
                f"{name!r}. Each optimizer's update changes the scale, so the gradients the "
                "other has accumulated so far would be unscaled by a scale they were not scaled "
                f"by. Give each its own: scaler={{{first!r}: torch.amp.GradScaler(device), "
                f"{name!r}: torch.amp.GradScaler(device)}}."
            )


def trained(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, ...]:
    """The parameters ``optimizer`` updates that take gradients (what a backward fills)."""
    return tuple(p for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


def check_no_gradients(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise ``ConfigError`` if a parameter of ``optimizers`` holds a gradient: a state starts
    with an empty window, so its first update would add that gradient to its own."""
    held = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    held = [p for p in held if p.grad is not None]
    if held:
        raise ConfigError(
            f"TrainState.create: {len(held)} parameter(s) that the optimizer updates already "
            "hold a gradient (.grad) from a backward outside this state: one you ran to look "
            "at the gradients, or a step whose accumulation window was open when the state was "
            "built again (a notebook cell run again). The new state's window is empty, so its "
            "first update would add that gradient to its own, in silence. Clear it first: "
            "model.zero_grad(set_to_none=True); or go on with the state that holds the window."
        )


def check_disjoint(optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """Raise ``ConfigError`` if one parameter is updated by two named optimizers."""
    owner: dict[int, str] = {}
    for name, optimizer in optimizers.items():
        for p in trained(optimizer):
            first = owner.setdefault(id(p), name)
            if first != name:
                raise ConfigError(
                    f"TrainState.create: a parameter of shape {tuple(p.shape)} is in both "
                    f"optimizer {first!r} and optimizer {name!r}. Each parameter belongs to one "
                    "optimizer: build each from its own module's parameters."
                )


def check_owners(model: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """For a dict of named modules and named optimizers: raise ``ConfigError`` if an optimizer
    named like a module updates none of that module's parameters but another's (``{"G":
    Adam(D.parameters()), "D": Adam(G.parameters())}``: the "G" step would train D)."""
    if not isinstance(model, Mapping):
        return
    module_of = {id(p): name for name, module in model.items() for p in module.parameters()}
    for name, optimizer in optimizers.items():
        if name not in model:
            continue  # named after no module: nothing to match
        owners = {module_of.get(id(p)) for p in trained(optimizer)}
        elsewhere = {owner for owner in owners if owner is not None and owner != name}
        if elsewhere and name not in owners:  # one that also trains a shared module is fine
            others = ", ".join(f"model[{other!r}]" for other in sorted(elsewhere))
            raise ConfigError(
                f"TrainState.create: optimizer {name!r} updates parameters of {others}, none of "
                f"model[{name!r}], whose name it has; the step for {name!r} would train "
                f"{others}. Build each optimizer from its own module: optimizer={{{name!r}: "
                f"torch.optim.Adam(model[{name!r}].parameters()), ...}}."
            )


def idle_parameters(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """The names of ``model``'s parameters that take gradients but no optimizer updates."""
    updated = {id(p) for optimizer in optimizers for p in trained(optimizer)}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in updated]


def idle_error(where: str, module: str, idle: Sequence[str]) -> ConfigError:
    """The refusal of trainable parameters outside every optimizer (``module``: ``"model"``,
    ``"model['teacher']"``), with the line that freezes the first one's module."""
    owner = idle[0].rpartition(".")[0]
    freeze = module if module != "model" or not owner else f"model.get_submodule({owner!r})"
    shown = listed(idle, shown=5)
    return ConfigError(
        f"{where}: {module} has {len(idle)} trainable parameter(s) that no optimizer updates "
        f"({shown}): they would not train, and their gradients would pile up until one added "
        "to an optimizer (add_param_group) took them all in one update. Put every parameter "
        "in the optimizer from the start (a frozen one too: torch skips a parameter without a "
        "gradient), e.g. optimizer=torch.optim.AdamW(model.parameters()); or freeze those that "
        f"are not trained (a teacher, a frozen body): {freeze}.requires_grad_(False)."
    )


def check_frozen(model: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise ``ConfigError`` if the model (each module of a dict) has trainable parameters that
    no optimizer updates."""
    named = model.items() if isinstance(model, Mapping) else [(None, model)]
    for name, module in named:
        if idle := idle_parameters(module, optimizers):
            where = "model" if name is None else f"model[{name!r}]"
            raise idle_error("TrainState.create", where, idle)


def scheduler_position(scheduler: Any) -> int | None:
    """How many times ``scheduler`` was stepped since it started (torch's ``last_epoch``), or
    ``None`` for no scheduler or one that does not say."""
    position = getattr(scheduler, "last_epoch", None)
    return position if isinstance(position, int) else None


def check_scheduler_at(state: Any, at: int | None) -> None:
    """Raise ``ConfigError`` if ``state.scheduler`` is not at ``at``, the position the state's
    last update left on it (``state.scheduler_at``, or what a step that keeps the position on
    the device last set there): something else stepped it too. Nothing to check after
    ``state.scheduler_at`` was reset (a scheduler passed in, a checkpoint loaded)."""
    scheduler, position = state.scheduler, scheduler_position(state.scheduler)
    if state.scheduler_at is None or at is None or position == at:
        return
    raise ConfigError(
        f"update {state.step + 1}: the state's scheduler ({type(scheduler).__name__}) is at "
        f"position {position}, but the last update left it at {at}: it was stepped outside "
        "the step. The step advances the state's scheduler once per applied update, so a "
        "scheduler.step() in your loop (or a handler) advances it again, and each update "
        "would use a later update's learning rate. Remove that scheduler.step() call; or, to "
        "step it yourself (per epoch, on a plateau), create the state without it, "
        "TrainState.create(..., scheduler=None), and use the Scheduler handler. If you set "
        "its position on purpose (load_state_dict), pass it in again: state = "
        "state.replace(scheduler=scheduler)."
    )


def check_swapped(old: Any, new: Any) -> None:
    """``TrainState.create``'s checks of the pieces, for ``replace`` (``old`` to ``new``):
    swapped in by hand (a new optimizer to lower the learning rate), a piece that does not fit
    trained nothing, or the old one."""
    caller = "TrainState.replace"
    if not isinstance(new.model, nn.Module):
        raise ConfigError(
            f"{caller}(model=...) received {describe(new.model)}, which is not a "
            "torch.nn.Module. Pass the module you train, with its optimizer: "
            "state.replace(model=model, optimizer=torch.optim.AdamW(model.parameters()))."
        )
    if new.model is not old.model and old.names:
        raise ConfigError(
            f"{caller}(model=...) received another model for a state of several optimizers "
            f"({list(old.names)}): each optimizer's state holds the model, and this would change "
            "the first's alone, so the other steps would go on training the old one. Create the "
            "state anew: TrainState.create(model=..., optimizer={...})."
        )
    check_pieces(new.model, new.optimizer, new.scheduler, new.scaler, key="", caller=caller)

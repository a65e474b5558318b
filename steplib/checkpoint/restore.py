"""How a checkpoint goes back into a state: every part checked first (a ``ConfigError`` changes
nothing), then loaded; ``dcp`` loads its tensors itself, then the train state here."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Collection, Mapping
from typing import Any

import torch

from steplib.checkpoint.contents import (
    HANDLERS,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    HandlerStates,
    lanes,
    trainable_part,
)
from steplib.checkpoint.manifest import fingerprint
from steplib.data.epoch_end import restore_position
from steplib.data.shards import check_new_world
from steplib.distributed import rank, world_size
from steplib.distributed.parallelize import plain_name
from steplib.errors import ConfigError, listed
from steplib.lineage import lineage_after_load
from steplib.seeding import restore_rng, rng_is_own
from steplib.state import TrainState, Window

# Observation-only wrappers change no number: resuming with anomaly detection on, or other
# hooks, is the usual way to debug, so they never count.
_OBSERVERS = ("detect_anomaly", "tap")
# Nor do guards: resuming under another limit is how TooManySkipsError's fix ("raise
# max_consecutive") is applied. (amp_wrap's min_loss_scale is not among its settings.)
_GUARDS = (("skip_nonfinite", "max_consecutive"),)


def check_fingerprint(
    saved: list[dict[str, Any]] | None, step: Any, *, checkpoint: str, ignore: Collection[str] = ()
) -> None:
    """``ConfigError`` unless ``step``'s composition is the saved one, wrapper by wrapper, by
    name (the built-in wrappers commute), but those in ``ignore`` (on both sides)."""
    if saved is None or step is None:
        return
    ignore = {*ignore, *_OBSERVERS}
    now = fingerprint(step, caller="load") or []  # compare as JSON values

    def by_name(described: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        kept = {}
        for d in described:
            bare = d["wrapper"].rpartition(":")[2]  # "D:ddp_wrap" (a step of several) is ddp_wrap
            if bare not in ignore:
                left_out = ["wrapper", *(key for name, key in _GUARDS if name == bare)]
                kept[d["wrapper"]] = {k: v for k, v in d.items() if k not in left_out}
        return kept

    before, after = by_name(saved), by_name(now)
    differences = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            differences.append(f"the checkpoint's step applies {_call(name, before[name])}")
        elif name not in before:
            differences.append(f"this step applies {_call(name, after[name])}, the saved did not")
        else:
            for key in sorted(before[name].keys() | after[name].keys()):
                old, new = before[name].get(key), after[name].get(key)
                if old != new:
                    differences.append(f"{name} {key}={old!r} in the checkpoint, {new!r} now")
    if differences:
        raise ConfigError(
            f"load: checkpoint {checkpoint} was trained by the step {_chain(saved)}, this step "
            f"is {_chain(now)}: {'; '.join(differences)}. The counters and the accumulation "
            "window mean something else under another composition. Build the step as the "
            "checkpoint's, or load it unchecked by hand: load(url, state), without step=."
        )


def apply(
    trees: Mapping[str, Any], state: TrainState, *, data: Any, extras: Any, checkpoint: str
) -> TrainState:
    """Load a single-process checkpoint's ``trees`` into ``state``'s objects; return it with the
    saved counters (``ConfigError``, nothing changed, when the checkpoint does not fit)."""
    train_state = trees[TRAIN_STATE]
    weights = state.model.state_dict()
    # Saved by one process by its names: found here under DDP's `module.` too (resumed on ranks).
    names = {plain_name(state.model, name): name for name in weights}
    saved_weights = {names.get(name, name): value for name, value in trees[MODEL].items()}
    check_world(train_state, state, data=data, checkpoint=checkpoint)
    base = train_state["base"]  # a checkpoint of the trainable parameters alone
    if base is not None:
        # The checkpoint's frozen parameters (a resumed model is built before an unfreeze)
        # must be the same base here; the rest, what it holds.
        saved = set(train_state["frozen"])  # by plain names (a compiled model's have a prefix)
        frozen = {name for name in weights if plain_name(state.model, name) in saved}
        weights, here = trainable_part(state.model, weights, frozen)
        if here != base:
            raise ConfigError(
                f"load: checkpoint {checkpoint} holds the trainable parameters alone, trained over "
                f"a frozen base of {base['entries']} parameters (digest {base['digest']}); this "
                "model's are another base. Build the model as the saving run did (the same "
                "pretrained weights, revision, dtype and adapters), then load or resume; if its "
                "frozen parameters changed during the run (a momentum encoder, a teacher "
                "averaged in place), no checkpoint holds them: save with trainable_only=False."
            )
    model_type = type(state.model).__name__
    check_model(
        shapes(saved_weights), shapes(weights), model_type=model_type, checkpoint=checkpoint
    )
    check_fits(train_state, state, data=data, extras=extras, checkpoint=checkpoint)
    state.model.load_state_dict(saved_weights, strict=base is None)  # the base: checked above
    optimizers = trees[OPTIMIZER]["optimizers"].values() if state.names else [trees[OPTIMIZER]]
    for lane, saved in zip(lanes(state), optimizers, strict=True):
        lane.optimizer.load_state_dict(saved)
    rng = rng_is_own(train_state["rng"], checkpoint=checkpoint)  # each rank its own generators
    return restore_train_state(train_state, state, data=data, extras=extras, rng=rng)


def check_world(train_state: Any, state: TrainState, *, data: Any, checkpoint: str) -> None:
    """``ConfigError`` unless a checkpoint saved by one process (rank r of n, as its RNG record
    says) fits this one: another process's open window or data position cannot be its own."""
    saver, saved = (train_state["rng"] or {}).get("process") or [0, 1]
    now = world_size()
    if [saver, saved] == [rank(), now]:
        return
    if any(t["counters"]["window_size"] for t in lane_trees(train_state, state).values()):
        raise ConfigError(
            f"load: checkpoint {checkpoint} was taken inside an accumulation window by rank "
            f"{saver} of {saved} process(es), whose gradients fit only that process (here rank "
            f"{rank()} of {now}). Resume it so, or use one taken between windows."
        )
    if data is not None:
        alone = saver if saved == now else None  # another rank's checkpoint of as many
        check_new_world(
            data,
            train_state["data"],
            saved_world_size=saved,
            world_size=now,
            checkpoint=checkpoint,
            saver=alone,
        )


def restore_train_state(
    train_state: Any, state: TrainState, *, data: Any, extras: Any, rng: bool
) -> TrainState:
    """Load a checked ``train_state`` (its RNG states with ``rng``) into ``state``."""
    trees = lane_trees(train_state, state)
    for name in state.names[1:]:
        state = state.with_lane(_restore_lane(trees[name], state[name]))
    state = _restore_lane(train_state, state)
    frozen, grads = set(train_state["frozen"]), train_state["window_grads"]
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            saved = grads.get(name)
            p.grad = None if saved is None else saved.to(device=p.device, dtype=p.dtype)
            p.requires_grad_(plain_name(state.model, name) not in frozen)
    in_eval = set(train_state["in_eval"])
    for name, module in state.model.named_modules():
        # Each its own, as evaluation restores them; by plain names, as saved.
        module.training = plain_name(state.model, name) not in in_eval
    for name, obj in extras.items():
        if name in train_state["objects"]:  # no handler states in a save() by hand
            obj.load_state_dict(train_state["objects"][name])
    epoch_done = False
    if data is not None:
        epoch_done = restore_position(data, train_state["data"])
    if rng and train_state["rng"] is not None:
        restore_rng(train_state["rng"])
    return state.replace(
        # The data ended its epoch at the save, uncounted yet: the resumed run starts the next.
        epoch=train_state["counters"]["epoch"] + (1 if epoch_done else 0),
        extras=types.MappingProxyType(dict(train_state["extras"])),
    )


def _restore_lane(tree: Mapping[str, Any], state: TrainState) -> TrainState:
    if state.scheduler is not None:
        state.scheduler.load_state_dict(tree["scheduler"])
    if state.scaler is not None:
        state.scaler.load_state_dict(tree["scaler"])
    counters, window, device = tree["counters"], tree["window"], state.device
    return state.replace(
        # The states from before the load are refused from now on, equal counters or not.
        lane=dataclasses.replace(state.lane, lineage=lineage_after_load(state.lane.lineage)),
        step=counters["step"],
        micro_step=counters["micro_step"],
        window=Window(
            counters["window_size"],
            _on_device(window["loss"], device),
            _on_device(window["targets"], device),
        ),
        skipped_updates=torch.tensor(counters["skipped_updates"], device=device),
        consecutive_skips=torch.tensor(counters["consecutive_skips"], device=device),
        scheduler_at=None,  # the scheduler was just loaded: its position is the saved one
    )


def lane_trees(train_state: Mapping[str, Any], state: TrainState) -> dict[Any, Mapping[str, Any]]:
    """Each optimizer's part of ``train_state`` by name (``None``: a single optimizer)."""
    first = state.names[0] if state.names else None
    return {first: train_state, **train_state.get("lanes", {})}


def _on_device(value: Any, device: torch.device) -> Any:
    # Window sums are device tensors or Python numbers (an empty window, integer target
    # counts): restored as the same kind, so the resumed step computes the same.
    return value.to(device) if isinstance(value, torch.Tensor) else value


def check_fits(
    train_state: Any, state: TrainState, *, data: Any, extras: Any, checkpoint: str
) -> None:
    """``ConfigError`` unless the optimizers, schedulers, scalers, extras and data fit ``state``."""
    names = [train_state["optimizer_names"], list(state.names)]  # saved, here
    if names[0] != names[1]:
        said = [f"the optimizers {n}" if n else "one unnamed optimizer" for n in names]
        raise ConfigError(
            f"load: checkpoint {checkpoint} holds {said[0]}, this state {said[1]}. Create the "
            "state as the saving run did: TrainState.create(optimizer=...), same names, same order."
        )
    for name, tree in lane_trees(train_state, state).items():
        lane = state if name is None else state[name]
        scheduler = None if lane.scheduler is None else type(lane.scheduler).__name__
        pairs = {  # as saved, as here
            "optimizer": (tree["optimizer_type"], type(lane.optimizer).__name__),
            "parameter group sizes": (
                tree["group_sizes"],
                [len(g["params"]) for g in lane.optimizer.param_groups],
            ),
            "scheduler": (tree["scheduler_type"], scheduler),
            # Whether it scales: a disabled GradScaler saves {} and loads nothing, as None does.
            "scaler": (bool(tree["scaler"]), lane.scaler is not None and lane.scaler.is_enabled()),
        }
        differ = [f"{k} {a} in the checkpoint, {b} here" for k, (a, b) in pairs.items() if a != b]
        if differ:
            whose = "" if name is None else f" (optimizer {name!r})"
            raise ConfigError(
                f"load: checkpoint {checkpoint} was trained with another set-up{whose}: "
                f"{'; '.join(differ)}. Create the state as the saving run did: the same optimizer "
                "class and groups, scheduler and scaler (GradScaler(enabled=False) counts as None"
                "; torch disables GradScaler('cuda') without CUDA: GradScaler('cpu') loads there)."
            )
    # The attached handlers' states have their own check; a load not given them leaves them out.
    objects, handlers = train_state["objects"], extras.get(HANDLERS)
    if isinstance(handlers, HandlerStates):
        handlers.check(objects.get(HANDLERS), checkpoint=checkpoint)
    named = {name for name, obj in extras.items() if not isinstance(obj, HandlerStates)}
    saved_objects = set(objects) - ({HANDLERS} - named)
    if saved_objects != named:
        raise ConfigError(
            f"load(extras=...) received the names {sorted(named)}, but checkpoint "
            f"{checkpoint} holds {sorted(saved_objects)}. Pass the same names as to save()."
        )
    if data is not None and train_state["data"] is None:
        raise ConfigError(
            f"load(data=...): checkpoint {checkpoint} holds no data position (saved without "
            "data=...). Pass data=None to start the data from the beginning, or save with data=."
        )


Shapes = Mapping[str, tuple[int, ...] | None]  # name -> tensor shape (None: not a tensor)


def shapes(tree: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in tree.items()}


def differences(
    saved: Shapes, expected: Shapes, source: str
) -> tuple[list[str], list[str], list[str], str]:
    """The names of ``expected`` missing from ``saved`` (``source``: "the checkpoint"), those
    only ``saved`` has, those of other shapes, and the three in words ("" when none)."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [
        k
        for k in expected
        if saved.get(k) is not None and expected[k] is not None and saved[k] != expected[k]
    ]
    shown = [f"{k} {saved[k]} in {source}, {expected[k]} here" for k in reshaped]
    labels = (f"missing from {source}", f"unexpected in {source}", "other shapes")
    found = zip(labels, (missing, unexpected, shown), strict=True)
    text = "; ".join(f"{label}: {listed(names)}" for label, names in found if names)
    return missing, unexpected, reshaped, text


def check_model(saved: Shapes, expected: Shapes, *, model_type: str, checkpoint: str) -> None:
    """``ConfigError`` unless the saved entries have the model's names and shapes."""
    if found := differences(saved, expected, "the checkpoint")[3]:
        raise ConfigError(
            f"load: checkpoint {checkpoint} was saved from another model ({model_type} here): "
            f"{found}. Build the model as the run that saved it did; to reuse some weights, "
            "use load_weights(state, url, strict=False) (the weights only, to fine-tune)."
        )


def _call(name: str, settings: Mapping[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in settings.items())})"


def _chain(described: list[dict[str, Any]]) -> str:
    calls = [_call(d["wrapper"], {k: v for k, v in d.items() if k != "wrapper"}) for d in described]
    return " -> ".join(["make_train_step", *calls])

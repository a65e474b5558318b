"""What a checkpoint holds, gathered from a TrainState as plain data that a weights-only load
reads back, with the state of the handlers attached to the run (found, not named)."""

from __future__ import annotations

import collections
import sys
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torchdata.stateful_dataloader import StatefulDataLoader

from steplib.checkpoint.manifest import fingerprint
from steplib.data.loader import ResumableLoader
from steplib.data.order_rng import check_torchdata_order
from steplib.distributed.parallelize import (
    holds_dtensor_parameters,
    is_parallel_model,
    plain_name,
)
from steplib.errors import CheckpointWarning, ConfigError, CorruptCheckpointError, describe
from steplib.events import Events
from steplib.lineage import check_newest
from steplib.seeding import capture_rng
from steplib.state import TrainState

MODEL, OPTIMIZER, TRAIN_STATE = "model.pt", "optimizer.pt", "train_state.pt"
# Exact types: numpy.float64 subclasses float, and weights_only refuses it (a rate set by hand
# from a numpy schedule: every checkpoint written, none readable).
_LEAVES = (type(None), bool, int, float, str)
DCP_DIR = "dcp"
HANDLERS = "handlers"  # the attached handlers' states among a checkpoint's objects
# The distribution may change between the saving and the resuming run (that is resharding).
DISTRIBUTION_WRAPPERS = frozenset({"ddp_wrap", "fsdp_wrap"})


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_sharded(state: Any) -> bool:
    """Whether ``state`` is saved sharded: its model holds DDP / FSDP2 modules (with a process
    group) or DTensor parameters."""
    model = getattr(state, "model", None)
    if not isinstance(model, torch.nn.Module):
        return False
    grouped = dist.is_available() and dist.is_initialized()
    if grouped and any(is_parallel_model(m) for m in model.modules()):
        return True
    if holds_dtensor_parameters(model):
        if not grouped:
            raise ConfigError(
                f"the state's model ({type(model).__name__}) holds DTensor parameters and no "
                "process group is initialised to save or load them. Save and load on every "
                "rank before dist.destroy_process_group(), or into a plain model."
            )
        return True
    return False


def holds_only_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DDP modules and no FSDP2 one (window gradients are plain)."""
    parallel = [m for m in model.modules() if is_parallel_model(m)]
    return bool(parallel) and all(isinstance(m, DistributedDataParallel) for m in parallel)


def prunes_here(state: Any) -> bool:
    """Whether this process prunes after saving ``state`` (sharded: rank 0 alone)."""
    return not is_sharded(state) or dist.get_rank() == 0


def check_arguments(
    caller: str, state: Any, *, data: Any, extras: Any, step: Any
) -> Mapping[str, Any]:
    """Check the inputs shared by save and load (``ConfigError``); return ``extras`` as a dict."""
    if not isinstance(state, TrainState):
        raise ConfigError(
            f"{caller} received state={describe(state)}, not a TrainState. Pass the state your "
            "step returns (TrainState.create(...) at the start)."
        )
    if caller != "load":  # a load makes the state it returns the newest, from any state of the run
        for lane in lanes(state):
            check_newest(lane, caller)  # else its counters would not match the weights saved
    if data is not None and not is_stateful(data):
        raise ConfigError(
            f"{caller}(data=...) received {describe(data)}, which has no state_dict() to save "
            "its position. Pass data=steplib.data.resumable_loader(dataset, batch_size=...)."
        )
    if isinstance(data, StatefulDataLoader) and not isinstance(data, ResumableLoader):
        check_torchdata_order(caller, data)
    extras = {} if extras is None else extras
    if not isinstance(extras, Mapping) or not all(isinstance(k, str) for k in extras):
        raise ConfigError(
            f"{caller}(extras=...) received {describe(extras)}; pass a dict of name -> object "
            "with state_dict() / load_state_dict(), e.g. extras={'ema': ema_model}."
        )
    for name, obj in extras.items():
        if not is_stateful(obj):
            raise ConfigError(
                f"{caller}(extras=...): extras[{name!r}] is {describe(obj)}, without "
                "state_dict() / load_state_dict(). Pass objects that have them (a module, an "
                "EMA); plain values go in state.replace(extras={..., 'name': value})."
            )
    if caller != "load":  # a metric loads its states whatever its flags: only a save loses them
        check_metric_states(caller, extras)
    fingerprint(step, caller=caller)  # a Step, several by name, or None
    return extras


def check_metric_states(caller: str, extras: Mapping[str, Any]) -> None:
    """``ConfigError`` for a torchmetrics metric among ``extras`` (or inside one of them) with
    states that are not persistent: torchmetrics' default, which leaves them out of its
    ``state_dict()``, so a checkpoint would hold none of what it accumulated."""
    torchmetrics = sys.modules.get("torchmetrics")  # no metric exists before it is imported
    if torchmetrics is None:
        return
    for name, obj in extras.items():
        modules = obj.modules() if isinstance(obj, torch.nn.Module) else ()
        for module in modules:
            flags = getattr(module, "_persistent", {})
            if isinstance(module, torchmetrics.Metric) and not all(flags.values()):
                left_out = [state for state, kept in flags.items() if not kept]
                raise ConfigError(
                    f"{caller}(extras=...): extras[{name!r}] holds the torchmetrics "
                    f"{type(module).__name__}, whose states {left_out} are not persistent "
                    "(torchmetrics' default): its state_dict() leaves them out, so a resume "
                    f"would start it from zero. Call .persistent(True) on extras[{name!r}] "
                    "before saving (a MetricCollection passes it on to its metrics)."
                )


def settle_schedulers(step: Any, state: TrainState, caller: str) -> None:
    """Set the schedulers to the positions ``step`` keeps on the device (on CUDA the objects lag
    an update or two behind: a fused optimizer's ``LambdaLR`` in a step that may skip); without
    the step, ``ConfigError`` where such a position may be."""
    if step is not None:
        for one in step.values() if isinstance(step, Mapping) else (step,):
            one.settle(state)
        return
    for lane in lanes(state):
        fused = getattr(lane.optimizer, "_step_supports_amp_scaling", False)
        if fused and type(lane.scheduler) is LambdaLR and lane.device.type == "cuda":
            raise ConfigError(
                f"{caller} has no step (save's step=, or the Step run calls), and this state's "
                f"LambdaLR over a fused {type(lane.optimizer).__name__} on CUDA may be an update "
                "or two behind its position on the device (where the step decides its skips): "
                "the checkpoint would resume the schedule late. Pass the step you train with: "
                "save(..., step=step), or run(step, ...) with a Step for checkpoint_every."
            )


def gather(
    state: TrainState, *, data: Any, extras: Mapping[str, Any], trainable_only: bool = False
) -> dict[str, Any]:
    """The files of a single-process checkpoint by name (live tensors)."""
    model, base = state.model, None
    weights = model.state_dict()
    if trainable_only:
        check_base_untrained(state)
        weights, base = trainable_part(model, weights)
    train_state = {**train_state_tree(state, data=data, extras=extras), "base": base}
    named = {"optimizers": {name: state[name].optimizer.state_dict() for name in state.names}}
    optimizers = named if state.names else state.optimizer.state_dict()
    trees = {MODEL: weights, OPTIMIZER: optimizers, TRAIN_STATE: train_state}
    for file_name, tree in trees.items():
        check_plain(tree, file_name)
    return trees


def train_state_tree(state: TrainState, *, data: Any, extras: Mapping[str, Any]) -> dict[str, Any]:
    """Everything of ``state`` but the model and optimizer tensors (both back-ends write it)."""
    tree = lane_tree(state)
    tree["counters"]["epoch"] = state.epoch
    open_window = any(lane.window.size > 0 for lane in lanes(state))
    model = state.model
    params = dict(model.named_parameters())
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    tree.update(
        extras=dict(state.extras),
        objects={name: obj.state_dict() for name, obj in extras.items()},
        rng=capture_rng(),
        data=None if data is None else data.state_dict(),
        # By the names DCP gives (no DDP or compile wrapper in them): a sharded checkpoint
        # resumes into a model wrapped otherwise (DDP on 2 ranks, plain on 1).
        frozen=[plain_name(model, name) for name, p in params.items() if not p.requires_grad],
        # A frozen body kept in eval mode (its BatchNorm statistics fixed) and switched back to
        # train mode at the unfreeze: a resume past it must train in the mode the run had.
        in_eval=[plain_name(model, name) for name, m in model.named_modules() if not m.training],
        optimizer_names=list(state.names),
        window_grads=grads if open_window else {},
        base=None,
    )
    if state.names:
        tree["lanes"] = {name: lane_tree(state[name]) for name in state.names[1:]}
    return tree


def lane_tree(state: TrainState) -> dict[str, Any]:
    """One optimizer's counters, window, scheduler and scaler, and what the optimizer is."""
    return {
        "counters": {
            "step": state.step,
            "micro_step": state.micro_step,
            "window_size": state.window.size,
            # Device tensors when the skip decision stays on the device; ints in the file.
            "skipped_updates": int(state.skipped_updates),
            "consecutive_skips": int(state.consecutive_skips),
        },
        "window": {"loss": state.window.loss, "targets": state.window.targets},
        "optimizer_type": type(state.optimizer).__name__,
        "group_sizes": [len(g["params"]) for g in state.optimizer.param_groups],
        "scheduler_type": None if state.scheduler is None else type(state.scheduler).__name__,
        "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
        "scaler": None if state.scaler is None else state.scaler.state_dict(),
    }


def lanes(state: TrainState) -> list[TrainState]:
    return [state[name] for name in state.names] or [state]


def read_tree(source: Any, checkpoint: str, file_name: str, *, mmap: bool = False) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU, or ``CorruptCheckpointError``."""
    try:  # verified first: a missing or altered file has failed its checksum already
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # any failure to parse the file: UnpicklingError, RuntimeError...
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {file_name} cannot be read by torch.load("
            f"weights_only=True) ({err}): written by another program or torch version. Load "
            "it with that version, or use another checkpoint."
        ) from err


def check_base_untrained(state: TrainState) -> None:
    """``ConfigError`` for frozen parameters that were trained (their optimizer holds state for
    them): left out as base, their trained values would be in no checkpoint."""
    trained = {id(p) for lane in lanes(state) for p, held in lane.optimizer.state.items() if held}
    named = state.model.named_parameters()
    if lost := [name for name, p in named if not p.requires_grad and id(p) in trained]:
        raise ConfigError(
            f"save(trainable_only=True): {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} "
            "are frozen now but were trained (the optimizer holds state for them): left out as "
            "the frozen base, they would be in no checkpoint. Pass trainable_only=False for a "
            "run that freezes what it trained."
        )


def trainable_part(
    model: torch.nn.Module, weights: Mapping[str, Any], frozen: Collection[str] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``weights`` but the ``frozen`` parameters (by default those not requiring a gradient;
    buffers kept: a frozen BatchNorm's move), and the count and digest of those a load must
    find in place."""
    if frozen is None:
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if len(frozen) == len(list(model.parameters())):
        raise ConfigError(
            f"trainable_only=True: no parameter of the model ({type(model).__name__}) requires "
            "a gradient: no weights to save. Pass trainable_only=False, or unfreeze first."
        )
    base, digest = sorted(weights.keys() & frozen), xxhash.xxh3_64()
    for name in base:
        value = weights[name].detach()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).cpu().contiguous().view(torch.uint8).numpy())
    kept = {name: value for name, value in weights.items() if name not in frozen}
    return kept, {"entries": len(base), "digest": digest.hexdigest()}


def check_metrics(metrics: Mapping[str, Any] | None, caller: str) -> dict[str, float]:
    """The metrics as floats (``ConfigError`` if not numbers by name)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            f"{caller}(metrics=...) received {describe(metrics)}; pass a dict of name -> "
            "number, e.g. metrics={'val_loss': 0.42}."
        )
    numbers = {name: as_number(value) for name, value in metrics.items()}
    for name, number in numbers.items():
        if not isinstance(name, str) or number is None:
            raise ConfigError(
                f"{caller}(metrics=...): {name!r} is {describe(metrics[name])}; metrics are "
                "numbers (or one-element tensors) by string name, e.g. {'val_loss': 0.42}."
            )
    return {name: number for name, number in numbers.items() if number is not None}


def as_number(value: Any) -> float | None:
    """``value`` as a float (a one-element tensor: a host sync, at save time only), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def check_plain(tree: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` would refuse, before writing anything."""
    if type(tree) in _LEAVES or isinstance(tree, torch.Tensor):  # isinstance: Parameter too
        return
    # Exact types: a subclass (a namedtuple) is pickled by class name: weights_only refuses it;
    # Counter (MultiStepLR's milestones) is on weights_only's allowlist.
    if type(tree) in (dict, collections.OrderedDict, collections.Counter):
        for key, value in tree.items():
            if type(key) not in (str, int):
                raise ConfigError(_not_plain(f"{where} key {key!r}", key))
            check_plain(value, f"{where}[{key!r}]")
        return
    if type(tree) in (list, tuple):
        for index, value in enumerate(tree):
            check_plain(value, f"{where}[{index}]")
        return
    raise ConfigError(_not_plain(where, tree))


def _not_plain(where: str, value: Any) -> str:
    return (
        f"save: {where} is {describe(value)}. A checkpoint holds only numbers, strings, "
        "tensors, lists and dicts, so loading it runs no pickled code (weights_only=True). "
        "Store a plain value (a numpy number: float(x) or int(x)), or the object through "
        "save(..., extras={'name': obj})."
    )


def is_stateful(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("state_dict", "load_state_dict"))


class HandlerStates:
    """The handlers with state attached to a run, by key; saved as one extra object."""

    def __init__(self, handlers: Mapping[str, Any]) -> None:
        self.handlers = dict(handlers)

    def state_dict(self) -> dict[str, Any]:
        return {key: handler.state_dict() for key, handler in self.handlers.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        for key, handler in self.handlers.items():
            handler.load_state_dict(saved[key])

    def check(self, saved: Mapping[str, Any] | None, *, checkpoint: str) -> None:
        """``ConfigError`` (nothing loaded) unless ``saved`` holds these handlers' states;
        ``None`` (a ``save`` by hand): a warning."""
        if saved is None:
            if self.handlers:
                warnings.warn(
                    f"checkpoint {checkpoint} holds no handler states (saved by hand); "
                    f"{', '.join(self.handlers)} start from the state they were built with.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return
        missing, extra = sorted(saved.keys() - self.handlers), sorted(self.handlers - saved.keys())
        if not (missing or extra):
            return
        parts = [f"not attached now: {', '.join(missing)}"] if missing else []
        parts += [f"attached now, not in the checkpoint: {', '.join(extra)}"] if extra else []
        raise ConfigError(
            f"load: checkpoint {checkpoint} holds the state of the handlers "
            f"{sorted(saved) or 'none'}, this run has {sorted(self.handlers) or 'none'} "
            f"({'; '.join(parts)}). Attach the same ones, in the same order, as the run that "
            "saved it; or load the state alone by hand: load(latest(directory), state)."
        )


def with_handlers(
    caller: str, extras: Mapping[str, Any] | None, events: Events | None
) -> dict[str, Any]:
    """``extras`` and, under :data:`HANDLERS`, the other handlers with state attached to
    ``events``, keyed by class and index (``Evaluator[0]``): the same in the same order, the
    same keys."""
    named = dict(extras or {})
    if HANDLERS in named:
        raise ConfigError(
            f"{caller}(extras=...) received the name {HANDLERS!r}, which a checkpoint keeps for "
            "the attached handlers' states. Give that object another name."
        )
    if events is None:
        return named
    skip = {id(obj) for obj in named.values()}
    counts: collections.Counter[str] = collections.Counter()
    found = {}
    for handler in events.attached():
        if id(handler) not in skip and is_stateful(handler):
            kind = type(handler).__name__
            found[f"{kind}[{counts[kind]}]"] = handler
            counts[kind] += 1
    return {**named, HANDLERS: HandlerStates(found)}

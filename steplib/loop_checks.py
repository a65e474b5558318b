"""What ``run`` and ``iterate`` check before the first batch (raised where they are called, not
at the first ``next`` of the generator). Imports nothing from steplib."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def check_args(
    step: Any, state: Any, data: Any, max_steps: Any, max_epochs: Any, feed: Any
) -> None:
    """``ValueError`` for what ``run`` / ``iterate`` cannot run: unnamed or non-Step steps, a
    ``feed`` that names no step, data that is not iterable, a limit that is not a positive
    int, or steps none of which updates the state's counted optimizer."""
    several = isinstance(step, Mapping)
    steps = step if several else {"": step}
    if several and (not step or not all(isinstance(name, str) and name for name in step)):
        raise ValueError(
            f"run/iterate received the steps {list(step)!r}; name each step with a non-empty "
            'string, in the order they run: run({"D": d_step, "G": g_step}, state, data).'
        )
    for name, one in steps.items():
        if not callable(one) or not callable(getattr(one, "flush", None)):
            where = f"the step {name!r}" if several else "step"
            raise ValueError(
                f"run/iterate received {where} of type {type(one).__name__}, which is not a "
                "Step. Build one: step = make_train_step(loss_fn), then wrap it as you like; "
                'several steps go in a dict: run({"D": d_step, "G": g_step}, state, data).'
            )
    if feed is not None and (
        not several
        or not isinstance(feed, Mapping)
        or not all(name in step and callable(fn) for name, fn in feed.items())
    ):
        raise ValueError(
            f"run/iterate received feed={feed!r}; it maps the names of several steps to "
            "functions of (batch, earlier) that give that step its input, e.g. "
            'run({"D": d_step, "G": g_step}, state, data, feed={"G": lambda batch, earlier: '
            f'earlier["D"]["fake"]}}). The steps here: {list(steps) if several else "one"}.'
        )
    if not hasattr(data, "__iter__"):
        raise ValueError(
            f"run/iterate received data of type {type(data).__name__}, which is not iterable. "
            "Pass a DataLoader, a list of batches, or any re-iterable."
        )
    for label, value in (("max_steps", max_steps), ("max_epochs", max_epochs)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"run/iterate received {label}={value!r}; it must be a positive int or None."
            )
    # Steps none of which updates the counted optimizer would never fire step_end, in silence.
    updated, names = [getattr(one, "optimizer", None) for one in steps.values()], state.names
    if names and all(isinstance(n, str) for n in updated) and names[0] not in updated:
        raise ValueError(
            f"run/iterate received steps that update {sorted(map(str, updated))!r} but not "
            f"{names[0]!r}, the state's first optimizer, whose updates the run counts (state.step, "
            f"step_end, every=, max_steps): they would never advance. Add a step that updates it, "
            f"create the state with the counted optimizer first, or run on the state of the one "
            f"updated: state = state.with_lane(run(step, state[{updated[0]!r}], ...))."
        )


def limits_reached(state: Any, max_steps: int | None, max_epochs: int | None) -> bool:
    """Whether ``state`` has made ``max_steps`` updates or completed ``max_epochs`` epochs
    (a limit of ``None`` is none): where a run stops."""
    return (max_steps is not None and state.step >= max_steps) or (
        max_epochs is not None and state.epoch >= max_epochs
    )


def warn_nothing_to_train(state: Any, max_steps: int | None, max_epochs: int | None) -> None:
    """Warn that the run trains nothing: the state it was given has reached a limit already.
    ``max_epochs`` and ``max_steps`` count from the run's start, not this call's, so a cell run
    again to train more returned its state untouched in silence. (A resume that loads a
    finished run, a job requeued after its end, trains nothing as meant: no warning.)"""
    reached = [
        f"{name}={limit} (state.{counter} is {now})"
        for name, limit, counter, now in (
            ("max_steps", max_steps, "step", state.step),
            ("max_epochs", max_epochs, "epoch", state.epoch),
        )
        if limit is not None and now >= limit
    ]
    warnings.warn(
        f"run/iterate trains nothing: the state has reached {' and '.join(reached)} already "
        "(the limits count the run's updates and epochs from its start, not this call's). "
        "To train more, raise the limit: max_epochs=state.epoch + n, max_steps=state.step + n.",
        stacklevel=4,
    )


# Modules whose forward depends on the mode: in eval mode, no dropout, BatchNorm's statistics fixed.
_MODE_DEPENDENT = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def check_run_start(state: Any, step: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """After ``fit_start``: :func:`warn_eval_mode`; return ``call`` (the loop's call of the
    step on a batch), made to check the run's first batch where the step is data-parallel
    on several ranks (:func:`warn_same_batch`)."""
    warn_eval_mode(state.model)
    steps = step.values() if isinstance(step, Mapping) else (step,)
    wrappers = {
        described["wrapper"].rpartition(":")[2]  # "D:ddp_wrap" in a run of several steps
        for one in steps
        for described in (one.describe() if callable(getattr(one, "describe", None)) else [])
    }
    parallel = sorted(wrappers & {"ddp_wrap", "fsdp_wrap"})
    if not parallel or not dist.is_initialized() or dist.get_world_size() < 2:
        return call
    first = True

    def checked(state: Any, batch: Any, close: bool) -> Any:
        nonlocal first
        if first:
            first = False
            warn_same_batch(batch, parallel[0])
        return call(state, batch, close)

    return checked


def warn_eval_mode(model: Any) -> None:
    """Warn that the run would train ``model`` in eval mode: its root is (``model.eval()`` in a
    notebook cell to look at predictions, then a run) and it holds dropout or BatchNorm layers,
    which then act as in evaluation. A part kept in eval mode on purpose (a frozen backbone's
    BatchNorm) leaves the root in train mode: not warned about."""
    if not isinstance(model, torch.nn.Module) or model.training:
        return
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _MODE_DEPENDENT)})
    if kinds:
        warnings.warn(
            f"run/iterate: the state's model ({type(model).__name__}) is in eval mode "
            f"(model.eval()), and its {', '.join(kinds)} layers act as in evaluation there: the "
            "run would train without dropout and with BatchNorm's statistics fixed. Call "
            "model.train() before the run; to keep a part in eval mode on purpose, call "
            "part.eval() after it (model.backbone.eval()).",
            stacklevel=5,
        )


def warn_same_batch(batch: Any, wrapper: str) -> None:
    """Warn when every rank was given the same first batch while the step averages their
    gradients: each update would average copies of one (a ``DataLoader`` without a
    ``DistributedSampler`` under ``torchrun``: the first mistake of data parallelism, which
    Lightning and Accelerate avoid by replacing the sampler). One ``all_gather_object`` of a
    digest of the batch's CPU tensors and plain values, once per run; a batch holding a GPU
    tensor or an object of another kind is not compared."""
    hasher = hashlib.blake2b(digest_size=16)

    def feed(obj: Any) -> bool:  # False: something it cannot compare (a GPU tensor)
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                return False
            flat = obj.detach().contiguous().reshape(-1)
            hasher.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
            hasher.update(flat.view(torch.uint8).numpy().tobytes())
            return True
        if isinstance(obj, Mapping):
            return all(feed(key) and feed(value) for key, value in obj.items())
        if isinstance(obj, list | tuple):
            return all(feed(value) for value in obj)
        if isinstance(obj, int | float | str | bytes | None):
            hasher.update(repr(obj).encode())
            return True
        return False  # an object of its own: alike or not, its repr cannot tell

    digest: str | None = hasher.hexdigest() if feed(batch) else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if digest is not None and all(theirs == digest for theirs in every):
        warnings.warn(
            f"run/iterate: every one of the {len(every)} ranks was given the same first batch, "
            f"and the step averages their gradients ({wrapper}): each update would average "
            f"{len(every)} copies of one gradient. Give each rank its own share of the data: "
            "resumable_loader(dataset, ..., shard=True), or DataLoader(dataset, "
            "sampler=DistributedSampler(dataset)).",
            stacklevel=5,
        )

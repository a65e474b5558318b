"""Which checkpoints to keep: the newest ``keep_last`` and the best ``keep_best`` by a metric,
united (a best one survives however old; the newest is always kept: a resume needs it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from steplib import errors
from steplib.checkpoint import storage
from steplib.checkpoint.manifest import CheckpointInfo, list_checkpoints, scan, sort_key
from steplib.checkpoint.storage import StorageOptions
from steplib.errors import CheckpointError, ConfigError, describe


def check_retention(caller: str, *, keep_last: Any, keep_best: Any, metric: Any, mode: Any) -> None:
    """Raise ``ConfigError`` for retention settings that cannot be followed."""
    errors.optional_positive_int(caller, "keep_last", keep_last)
    errors.optional_positive_int(caller, "keep_best", keep_best)
    if keep_best is not None and (not isinstance(metric, str) or not metric):
        raise ConfigError(
            f"{caller}(keep_best={keep_best}) needs the metric to rank by, received "
            f"metric={describe(metric)}: name one saved with the checkpoints, e.g. metric='val'."
        )
    errors.mode(caller, mode)


def _ranked(checkpoints: Sequence[CheckpointInfo], metric: str, mode: str) -> list[CheckpointInfo]:
    # Best first; never one without the metric (or NaN); a tie is no improvement (BestValue's).
    sign = 1.0 if mode == "min" else -1.0
    ranked = [c for c in checkpoints if not math.isnan(c.metrics.get(metric, math.nan))]
    return sorted(ranked, key=lambda c: sign * c.metrics[metric])  # stable: oldest first


def select_retained(
    checkpoints: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
) -> list[CheckpointInfo]:
    """Of ``checkpoints`` (oldest first), the newest ``keep_last`` (at least one) and the best
    ``keep_best`` by ``metric``; all when both are ``None``."""
    if keep_last is None and keep_best is None:
        return list(checkpoints)
    newest = checkpoints[-(keep_last or 1) :]
    best = [] if keep_best is None else _ranked(checkpoints, str(metric), mode)[:keep_best]
    return [c for c in checkpoints if c in newest or c in best]


def prune(
    directory: str,
    *,
    keep_last: int | None,
    keep_best: int | None = None,
    metric: str | None = None,
    mode: str = "min",
    storage_options: StorageOptions = None,
    leftovers: str = "older",
) -> list[str]:
    """Delete the checkpoints of ``directory`` not retained, and what crashed saves left
    (uncommitted, corrupt, ``.tmp-*``) older than the newest checkpoint. A checkpoint is
    uncommitted before its files go: a crash never leaves a half-deleted one.

    Args:
        directory: the directory given to ``save``.
        keep_last: keep the newest this many (at least the newest one; ``None``: all).
        keep_best, metric, mode: also the best ``keep_best`` by ``metric``, lower (``"min"``) or
            higher (``"max"``) better; of equal values the older; never one without it or NaN.
        storage_options: passed to fsspec.
        leftovers: ``"older"``, or ``"all"`` when no save into ``directory`` is in flight.

    Returns:
        The URLs of the deleted checkpoints (not of the debris).

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> from steplib.checkpoint import save
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> for s in (1, 2, 3):
        ...     _ = save(state.replace(step=s), "memory://doctest-prune/ckpt")
        >>> prune("memory://doctest-prune/ckpt", keep_last=2)
        ['memory://doctest-prune/ckpt/step-00000001']
    """
    check_retention("prune", keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode)
    if leftovers not in ("older", "all"):
        raise ConfigError(
            f"prune(leftovers=...) received {describe(leftovers)}; pass 'older' (keep what a "
            "save in flight may own) or 'all' (no save into the directory is in flight)."
        )
    location = storage.resolve(directory, storage_options, caller="prune")
    checkpoints, debris = scan(location)
    retained = select_retained(
        checkpoints, keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode
    )
    deleted = [c for c in checkpoints if c not in retained]
    for checkpoint in deleted:
        storage.remove(location.child(checkpoint.name))
    newest = sort_key(checkpoints[-1].name) if checkpoints else None
    for leftover in debris:
        name = leftover.name  # ".tmp-step-00000120-1a2b3c4d": of "step-00000120"
        if name.startswith((storage.STAGING_PREFIX, storage.TRASH_PREFIX)):
            name = name.split("-", 1)[1].rsplit("-", 1)[0]
        if leftovers == "all" or (newest is not None and (sort_key(name) or (-1, -1)) < newest):
            storage.remove(leftover)
    return [c.url for c in deleted]


def best_checkpoint(
    directory: str, metric: Any, *, mode: str | None = None, storage_options: StorageOptions = None
) -> str:
    """The URL of the best checkpoint in ``directory`` by ``metric`` (the oldest of equal ones).

    Args:
        directory: the directory of checkpoints (``checkpoint_every``'s).
        metric: a metric saved with the checkpoints, or the ``Evaluator`` that monitors it.
        mode: ``"min"`` (default) or ``"max"``; the evaluator's when given one.
        storage_options: passed to fsspec.

    Returns:
        The URL of the best checkpoint.

    Raises:
        CheckpointError: no checkpoint records ``metric``.

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> from steplib.checkpoint import load, save
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> urls = [save(state.replace(step=step), "memory://doctest-best", metrics={"val_loss": v})
        ...         for step, v in [(1, 0.9), (2, 0.4), (3, 0.6)]]
        >>> load(best_checkpoint("memory://doctest-best", "val_loss"), state).step
        2
    """
    name, mode = errors.monitor_and_mode("best_checkpoint", metric, mode)
    errors.mode("best_checkpoint", mode)
    infos = list_checkpoints(directory, storage_options=storage_options)
    ranked = _ranked(infos, name, mode)
    if not ranked:
        recorded = sorted({key for info in infos for key in info.metrics})
        raise CheckpointError(
            f"best_checkpoint({directory!r}, {name!r}): no checkpoint there records {name!r} "
            f"({len(infos)} checkpoint(s); they record: {recorded or 'none'}). Name one of "
            "those, or save with checkpoint_every(..., metric=...)."
        )
    return ranked[0].url

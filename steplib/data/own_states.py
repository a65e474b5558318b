"""The states of what a :class:`~steplib.data.loader.ResumableLoader` calls in this process,
saved with its position: the dataset's and the ``collate_fn``'s (a batch transform with a
generator of its own: mixup / cutmix), when they have ``state_dict()`` / ``load_state_dict()``.

Without workers they live on from epoch to epoch in this process, their states with them;
torchdata keeps the dataset's only inside an unsharded epoch, and the ``collate_fn``'s never.
With workers each worker calls its own copies, made anew every epoch: the dataset's states are
the workers' then (``steplib.data.worker_rng``), and a ``collate_fn`` with a state is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchdata.stateful_dataloader import Stateful

from steplib.errors import ConfigError

# The keys of the dataset's and the collate_fn's states in a position.
DATASET, COLLATE = "dataset", "collate"


def own_states(loader: Any) -> dict[str, Any]:
    """``{"dataset": state or None, "collate": state or None}`` of ``loader`` (None with
    workers, or for one without ``state_dict()``)."""
    here = loader.num_workers == 0
    owners = {DATASET: loader.dataset, COLLATE: loader.collate_fn}
    return {
        k: o.state_dict() if here and isinstance(o, Stateful) else None for k, o in owners.items()
    }


def load_own_states(loader: Any, position: Mapping[str, Any]) -> None:
    """Load the states :func:`own_states` saved in ``position`` (a position saved before the
    ``collate_fn``'s was kept has none: that one is left as it is)."""
    for key, owner in ((DATASET, loader.dataset), (COLLATE, loader.collate_fn)):
        if position.get(key) is not None and loader.num_workers == 0:
            owner.load_state_dict(position[key])


def check_collate(collate_fn: Any, num_workers: int) -> None:
    """Refuse a ``collate_fn`` with a state that worker processes would call.

    Raises:
        ConfigError: ``collate_fn`` has ``state_dict()`` / ``load_state_dict()`` and
            ``num_workers`` > 0.
    """
    if num_workers and isinstance(collate_fn, Stateful):
        raise ConfigError(
            f"resumable_loader(collate_fn=...) received a {type(collate_fn).__name__} with "
            f"state_dict() and num_workers={num_workers}: each worker calls its own copy, made "
            "anew every epoch, so its state (a generator of its own) starts over each epoch and "
            "cannot be saved with the position. Draw from torch's global generator in it "
            "(each worker's is seeded per epoch and saved with the position), or pass "
            "num_workers=0."
        )

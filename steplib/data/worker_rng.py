"""The generators of a ``DataLoader`` worker as part of the loader's position.

A worker draws random augmentations from its own global generators (torch's, numpy's,
Python's), seeded ``base_seed + worker_id`` when the epoch's workers start. torchdata restores
which samples come next, not where those generators were: a resumed worker starts from the seed
again and repeats the augmentations of the epoch's first batches. torchdata does keep, with
every batch, the state of a dataset that has ``state_dict()`` / ``load_state_dict()``, in the
worker that made the batch; :class:`WorkerRng` gives the dataset those methods, holding the
worker's generators, so that a resumed worker continues them where the saved run's had them.

A sharded loader (``shard=True``) resumes from its own position, with a fresh pass that
torchdata gives no worker state; it hands the saved states to the pass's workers through
:attr:`WorkerRng.resume_states` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import Dataset, get_worker_info

from steplib.errors import ConfigError
from steplib.seeding import capture_rng, restore_rng

_RNG = "worker_rng"
_INNER = "dataset"
# The key of a sharded position's worker states in ResumableLoader.state_dict().
WORKERS = "workers"


class WorkerRng(Dataset[Any]):
    """``dataset`` whose state (in a worker process) holds that worker's generators.

    In the main process (``num_workers=0``) the state holds only ``dataset``'s own: the
    checkpoint restores the main process's generators itself.

    Args:
        dataset: a map-style dataset; its own ``state_dict`` / ``load_state_dict`` (when it
            has them) are kept and called as before.

    Attributes:
        resume_states: set in the main process before a pass begins: worker ``i`` of that
            pass loads ``resume_states[i]`` (a :meth:`state_dict` of a saved run's worker)
            before its first sample. ``None``: the workers start from their seeds.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.resume_states: list[dict[str, Any]] | None = None

    def _resume_once(self) -> None:
        # In a worker, whose copy of the dataset was made when the pass started: load the saved
        # state once, before anything is drawn (torchdata reads state_dict at the worker's start).
        info = get_worker_info()
        if self.resume_states is not None and info is not None:
            states, self.resume_states = self.resume_states, None
            self.load_state_dict(states[info.id])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        self._resume_once()
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        # torch's fetcher uses a dataset's batched read when it has one: keep the user's.
        self._resume_once()
        batched = getattr(self.dataset, "__getitems__", None)
        return batched(indices) if batched is not None else [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        self._resume_once()
        inner = getattr(self.dataset, "state_dict", None)
        state: dict[str, Any] = {_INNER: inner() if callable(inner) else None}
        if get_worker_info() is not None:
            state[_RNG] = capture_rng(cuda=False)  # CUDA cannot start in a forked worker
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get(_INNER) is not None:
            self.dataset.load_state_dict(state[_INNER])
        if _RNG in state and get_worker_info() is not None:
            restore_rng(state[_RNG])


def worker_states(loader_state: Mapping[str, Any]) -> list[Any] | None:
    """Each worker's dataset state in torchdata's state (workers only), ordered from the worker
    that makes the next batch: worker ``i`` of a fresh pass makes its ``i``-th batch."""
    snapshot = loader_state.get("_snapshot")
    if not isinstance(snapshot, Mapping) or "_last_yielded_worker_id" not in snapshot:
        return None
    if loader_state.get("_steps_since_snapshot", 0):
        raise ConfigError(
            "ResumableLoader(shard=True).state_dict: torchdata's worker states are "
            f"{loader_state['_steps_since_snapshot']} batches old, so the workers' random "
            "augmentations cannot resume where they were. Leave snapshot_every_n_steps=1 "
            "(build the loader with resumable_loader)."
        )
    workers = snapshot.get("_worker_snapshots", {})
    first = int(snapshot["_last_yielded_worker_id"]) + 1
    keys = [f"worker_{(first + i) % len(workers)}" for i in range(len(workers))]
    return [workers[key]["dataset_state"] for key in keys]

"""The generators of a ``DataLoader`` worker as part of the loader's position.

A worker draws random augmentations from its own global generators (torch's, numpy's,
Python's), seeded ``base_seed + worker_id`` when the epoch's workers start. torchdata restores
which samples come next, not where those generators were: a resumed worker starts from the seed
again and repeats the augmentations of the epoch's first batches. torchdata does keep, with
every batch, the state of a dataset that has ``state_dict()`` / ``load_state_dict()``, in the
worker that made the batch; :class:`WorkerRng` gives the dataset those methods, holding the
worker's generators, so that a resumed worker continues them where the saved run's had them.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, get_worker_info

from steplib.seeding import capture_rng, restore_rng

_RNG = "worker_rng"
_INNER = "dataset"


class WorkerRng(Dataset[Any]):
    """``dataset`` whose state (in a worker process) holds that worker's generators.

    In the main process (``num_workers=0``) the state holds only ``dataset``'s own: the
    checkpoint restores the main process's generators itself.

    Args:
        dataset: a map-style dataset; its own ``state_dict`` / ``load_state_dict`` (when it
            has them) are kept and called as before.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        # torch's fetcher uses a dataset's batched read when it has one: keep the user's.
        batched = getattr(self.dataset, "__getitems__", None)
        return batched(indices) if batched is not None else [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
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

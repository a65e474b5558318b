"""What torchdata's ``StatefulDataLoader`` state says about the position in the epoch, read
with defaults so that another torchdata version degrades to "position unknown" instead of
failing (its keys are those of 0.10 and 0.11)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Whether the epoch's iterator has yielded its last batch and ended.
FINISHED = "_iterator_finished"


def batches_yielded(loader_state: Mapping[str, Any]) -> int | None:
    """Batches of the current epoch already yielded, from torchdata's state (None: unknown)."""
    if "_num_yielded" in loader_state:  # no workers
        return int(loader_state["_num_yielded"])
    snapshot = loader_state.get("_snapshot")  # workers: the last snapshot plus the steps since
    if isinstance(snapshot, Mapping) and "_snapshot_step" in snapshot:
        return int(snapshot["_snapshot_step"]) + int(loader_state.get("_steps_since_snapshot", 0))
    return None

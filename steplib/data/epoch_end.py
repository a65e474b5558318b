"""``at_epoch_end``: whether a loader has yielded the last batch of its epoch while the loop's
``epoch_end`` is still to come, where a checkpoint would resume past that ``epoch_end``; and
``restore_position``, which loads such a position and says that the epoch ended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from steplib.data.shards import ShardedSampler
from steplib.data.torchdata_state import FINISHED, batches_yielded


def at_epoch_end(data: Any) -> bool:
    """At a ``step_end``: whether ``data`` has yielded the last batch of its epoch: every batch
    of a full pass (a position :func:`restore_position` resumes in the
    next epoch), or its pass has ended (the update was flushed after it; resumed, the epoch
    would not count as ended). Either way the loop's ``epoch_end`` is still to come.

    Args:
        data: the run's loader; ``False`` for what does not tell (a list, unsized data).

    Returns:
        Whether a position saved now would resume without that epoch's ``epoch_end``.
    """
    if not isinstance(data, StatefulDataLoader):
        return False
    loader_state = StatefulDataLoader.state_dict(data)  # torchdata's, of a ResumableLoader too
    if loader_state.get(FINISHED, False):
        return True
    yielded = batches_yielded(loader_state)
    if isinstance(data.sampler, ShardedSampler) and yielded is not None:
        # Its pass may be the rest of a resumed epoch, whose batches torchdata counts from the
        # pass's start: the sampler knows where that pass began.
        where = data.sampler.position(
            batch_size=data.batch_size or 1,
            batches=yielded,
            finished=False,
            drop_last=data.drop_last,
        )
        return bool(where["uncounted_epoch_end"])
    try:
        return yielded is not None and yielded >= StatefulDataLoader.__len__(data)
    except TypeError:  # unsized: where its epoch ends is unknown before the pass ends
        return False


def restore_position(data: Any, position: Any) -> bool:
    """Load a saved position into ``data`` (anything with ``load_state_dict``).

    Args:
        data: a :class:`ResumableLoader`, a ``StatefulDataLoader`` or any object with
            ``state_dict`` / ``load_state_dict``.
        position: what ``data.state_dict()`` returned when the checkpoint was taken.

    Returns:
        Whether that position was the end of an epoch that the loop had not yet counted (every
        batch yielded, the pass not yet ended): the caller should then count the epoch as done.
    """
    data.load_state_dict(position)
    completed = getattr(data, "epoch_completed_on_load", None)  # a ResumableLoader's, Zipped's
    if isinstance(completed, bool):
        return completed
    # Unsized data (no len) tells its epoch's end by ending: the loop ends that epoch.
    sized = hasattr(getattr(data, "dataset", None), "__len__")
    if isinstance(data, StatefulDataLoader) and isinstance(position, Mapping) and sized:
        yielded = batches_yielded(position)
        if yielded is not None and yielded >= len(data) and not position.get(FINISHED, False):
            # A plain StatefulDataLoader would yield an empty first pass here; run it now, so
            # that the next pass is the next epoch.
            for _ in data:
                pass
            return True
    return False

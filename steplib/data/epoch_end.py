"""``at_epoch_end``: whether a loader has yielded the last batch of its epoch while the loop's
``epoch_end`` is still to come, where a checkpoint would resume past that ``epoch_end``."""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from steplib.data.loader import FINISHED, batches_yielded


def at_epoch_end(data: Any) -> bool:
    """At a ``step_end``: whether ``data`` has yielded the last batch of its epoch: every batch
    of a full pass (a position :func:`~steplib.data.loader.restore_position` resumes in the
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
    try:
        return yielded is not None and yielded >= StatefulDataLoader.__len__(data)
    except TypeError:  # unsized: where its epoch ends is unknown before the pass ends
        return False

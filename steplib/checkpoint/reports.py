"""``Reports``: the committed checkpoints not yet reported, and their ``checkpoint_end`` events.

A background save commits in the writer's thread, at any moment of training. Handlers run one
at a time on the training thread and may return a ``Stop`` or a ``NewState`` (which only the
training thread can act on), so the writer only queues what it committed; the checkpointer
reports the queue at the next event it handles. So a synchronous save is reported at once, by
the handler that saved; a background save at the first update end after its write landed, at
the next save (which waits for it) or at ``fit_end`` (which waits for it). ``event.state`` is
the state at that moment; ``event.checkpoint.step`` is the checkpoint's own update.

Imports ``events`` and ``checkpoint.listing``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from steplib.checkpoint.listing import CheckpointInfo
from steplib.events import Emitted, Event, Events


class Reports:
    """Committed checkpoints waiting for their ``checkpoint_end`` event, oldest first.

    Example:
        >>> import types
        >>> seen = []
        >>> events = Events().on("checkpoint_end", lambda e: seen.append((e.step, e.checkpoint)))
        >>> reports = Reports()
        >>> reports.add("step-2")  # the writer thread: what it committed
        >>> state = types.SimpleNamespace(step=3, micro_step=3, epoch=0)
        >>> reports.deliver(events, Event.at("step_end", state)) is not None, seen
        (True, [(3, 'step-2')])
    """

    def __init__(self) -> None:
        # A deque: append (the writer thread) and popleft (the training thread) are atomic.
        self._committed: collections.deque[Any] = collections.deque()

    def add(self, checkpoint: Any) -> None:
        """Queue a committed checkpoint (from any thread).

        Args:
            checkpoint: its ``CheckpointInfo``.
        """
        self._committed.append(checkpoint)

    def deliver(
        self, events: Events | None, event: Event, *, earlier: Emitted | None = None
    ) -> Emitted | None:
        """Emit ``checkpoint_end`` on ``events`` for each queued checkpoint, oldest first, at
        ``event`` (each emission sees the state the previous one left).

        Args:
            events: the ``Events`` to emit on; ``None`` (a checkpointer never attached) drops
                the queue.
            event: the event being handled on the training thread.
            earlier: the outcome of an earlier delivery while handling ``event``, to go on
                from (its state) and to keep (its stop).

        Returns:
            The outcome to return from the handler (``earlier`` when nothing was queued).
        """
        if events is None:
            self._committed.clear()
            return earlier
        if not self._committed:
            return earlier
        state, stop = (event.state, None) if earlier is None else (earlier.state, earlier.stop)
        while self._committed:
            checkpoint = self._committed.popleft()
            emitted = events.emit(Event.at("checkpoint_end", state, checkpoint=checkpoint))
            state, stop = emitted.state, stop or emitted.stop
        return Emitted(state, stop)


def committed_info(
    url: str, state: Any, *, metrics: Mapping[str, float], time: float
) -> CheckpointInfo:
    """The ``CheckpointInfo`` of a checkpoint of ``state`` committed at ``url``: what
    ``list_checkpoints`` gives for it, without reading it back.

    Args:
        url: the committed checkpoint's URL.
        state: the saved ``TrainState`` (its counters).
        metrics: the numbers recorded in its manifest.
        time: when the save started (unix seconds).

    Returns:
        The info.
    """
    return CheckpointInfo(
        url=url,
        name=url.rstrip("/").rsplit("/", 1)[-1],
        step=state.step,
        micro_step=state.micro_step,
        epoch=state.epoch,
        time=time,
        metrics=dict(metrics),
    )

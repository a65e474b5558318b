"""``UpdateFence``: work that must end before the next optimizer update. Imports nothing from
steplib (``TrainState`` holds one)."""

from __future__ import annotations

import threading
from typing import Protocol


class Joinable(Protocol):
    """Work in flight: ``join()`` returns once it has ended."""

    def join(self) -> None: ...


class UpdateFence:
    """Work that must end before the next optimizer update changes the parameters and the
    optimizer's state in place.

    An async checkpoint (``steplib.checkpoint.AsyncSaver``) copies the parameters and the
    optimizer state in a background thread while the next forward and backward run (they only
    read them); it puts that copy here with :meth:`hold`. Every step waits here just before its
    update, and ``load`` before it overwrites them. One fence belongs to the states derived from
    one ``TrainState.create`` (``replace`` keeps it), so nothing is global. Waiting only joins
    threads: no tensor is read.
    """

    __slots__ = ("_lock", "_pending")

    def __init__(self) -> None:
        self._pending: list[Joinable] = []
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, object]) -> UpdateFence:
        """A fence of its own (``copy.deepcopy`` of a state): the work held here reads the
        original's tensors, not the copy's."""
        return UpdateFence()

    def hold(self, work: Joinable) -> None:
        """Make the next update (and :meth:`wait`) wait for ``work``."""
        with self._lock:
            self._pending.append(work)

    @property
    def held(self) -> int:
        """How many pieces of work the next update would wait for."""
        return len(self._pending)

    def wait(self) -> None:
        """Block until the work held so far has ended."""
        if not self._pending:  # the common case, once per update: no lock
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for work in pending:
            work.join()

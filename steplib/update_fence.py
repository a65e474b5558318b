"""Work that must end before an optimizer changes its parameters and state in place.

An async checkpoint (``steplib.checkpoint.AsyncSaver``) copies the parameters and the
optimizer's state in a background thread while training goes on: the next forward and backward
only read them. The step waits here, just before the next update changes them (``Step._close``,
before phase 2), and so does ``load``, which overwrites them. Waiting only joins a thread:
nothing is read from a tensor.

The registry is keyed by ``id(optimizer)``: the copies in flight for that optimizer (two
savers may save one state), removed by the wait. An entry outliving its optimizer is harmless:
its copy has ended, so a new optimizer that happens to get the same id waits for nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol


class Pending(Protocol):
    """A copy in flight: ``join()`` returns once it has ended."""

    def join(self) -> None: ...


_pending: dict[int, list[Pending]] = {}
_lock = threading.Lock()


def hold(optimizer: Any, copy: Pending) -> None:
    """Make the next update of ``optimizer`` (and ``wait``) wait for ``copy``."""
    with _lock:
        _pending.setdefault(id(optimizer), []).append(copy)


def wait(optimizer: Any) -> None:
    """Block until the copies of ``optimizer``'s parameters and state in flight have ended."""
    if not _pending:  # the common case, once per update: no lock, no lookup
        return
    with _lock:
        copies = _pending.pop(id(optimizer), [])
    for copy in copies:
        copy.join()

"""The contenders: one module per way of training, all behind the :class:`Contender` interface.

A contender owns its copy of the model, optimizer, scheduler and a position in the shared data
pool. The harness calls ``advance(n)`` to run exactly ``n`` optimizer updates (``n`` times the
accumulation micro-batches), many times, interleaved with the other contenders, so a contender
must be resumable at any update boundary. Peers that own the loop (Ignite, the Lightning
Trainer) are paused inside their own loop rather than restarted, so that no set-up cost of
theirs is charged per chunk.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
from collections.abc import Iterator
from typing import ClassVar

from torch import nn

from benchmarks.workloads import Batch, Setup


class Contender(abc.ABC):
    """One way of training the workload.

    Class attributes:
        name: the ``--contenders`` name and JSON key.
        label: the table's column label.
        requires: importable module names the contender needs (missing: reported unavailable).
        distributions: the pip distributions whose versions the JSON records.
        notes: how it is driven and any per-step cost it forces (goes into the JSON).
    """

    name: ClassVar[str]
    label: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    distributions: ClassVar[tuple[str, ...]] = ()
    notes: ClassVar[str] = ""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._pos = 0
        # Whether a contender that times itself waits for the device before stopping its clock;
        # the harness turns it off while counting host syncs (its wait is not the peer's).
        self.timing_sync = True

    @classmethod
    def available(cls) -> bool:
        return all(importlib.util.find_spec(name) is not None for name in cls.requires)

    @abc.abstractmethod
    def build(self) -> None:
        """Make the model, optimizer, scheduler and the peer's own objects."""

    @abc.abstractmethod
    def advance(self, steps: int) -> int | None:
        """Run ``steps`` optimizer updates.

        Returns:
            ``None`` when the harness's own clock around the call is the measurement, or the
            nanoseconds the contender measured itself (a contender running in another thread
            measures there, so the thread hand-off is not charged to it).
        """

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The trained module, whose parameters are compared with the raw loop's."""

    def close(self) -> None:  # noqa: B027 - optional hook: most contenders hold nothing
        """Release what ``build`` made (threads, global state of the peer)."""

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Entered by the harness (outside the timed region) around every call into the
        contender. Peers override it to silence their own warnings and log lines, which would
        otherwise fail a ``filterwarnings = error`` test run and clutter the table."""
        yield

    def next_batch(self) -> Batch:
        """The next micro-batch from the pool (cycled): the same sequence for every contender."""
        batches = self.setup.batches
        batch = batches[self._pos]
        self._pos = (self._pos + 1) % len(batches)
        return batch

    def take(self, count: int) -> list[Batch]:
        """The next ``count`` micro-batches as a list (for drivers that take an iterable)."""
        return [self.next_batch() for _ in range(count)]


def registry() -> dict[str, type[Contender]]:
    """All contenders, in table order (imports the peer modules lazily: only their names here)."""
    from benchmarks.contenders.peer_accelerate import AccelerateContender
    from benchmarks.contenders.peer_fabric import FabricContender
    from benchmarks.contenders.peer_ignite import IgniteContender
    from benchmarks.contenders.peer_trainer import TrainerContender
    from benchmarks.contenders.raw import RawContender
    from benchmarks.contenders.steplib_loop import SteplibContender, SteplibRunContender

    classes: list[type[Contender]] = [
        RawContender,
        SteplibContender,
        SteplibRunContender,
        FabricContender,
        IgniteContender,
        AccelerateContender,
        TrainerContender,
    ]
    return {c.name: c for c in classes}

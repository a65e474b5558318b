"""``AsyncSaver``: take the snapshot now, write it in a background thread, train on.

The snapshot copies every tensor of the checkpoint into CPU buffers (pinned for GPU tensors),
which are kept and reused by the next save, so that after the first save no memory is
allocated or page-faulted for it. Of the CPU tensors, the parameters and the optimizer's state
(most of the bytes) change only when the optimizer updates them: a background thread copies
them while training goes on, and the next update waits for that copy (``TrainState.fence``,
called by every step before it processes the gradients, and by ``load``). The rest (buffers,
which a forward pass may change, the gradients of an open window, extras, RNG and data states)
is copied before ``save`` returns. Both copies are done by a few threads in chunks
(``copying.py``: a busy core delays one chunk, not the whole copy). GPU tensors are copied
asynchronously on the training stream, ahead of the kernels that will change them, and only
the writer thread waits for those copies. Writing, checksumming and committing happen in a
thread at the lowest CPU priority (``_lowest_priority``); torch's file writing and xxhash's checksum
release the GIL, so the training thread keeps running.

A tensor that something other than the optimizer changes in place while the background copy
runs (``Tensor._version`` tells) fails that checkpoint loudly rather than committing a torn
copy: call :func:`wait_snapshot` before such a change.

A DDP, FSDP2 or DTensor state is saved as a sharded (DCP) checkpoint
(``steplib.checkpoint.sharded``): every rank snapshots its part, and the background threads of
all ranks write and commit it together on a process group of their own (see
``AsyncSaver._checkpoint_group``).

A second save waits for the first (the buffers are reused, and two commits in flight could
land out of order). An error in the background is raised by the next ``save``, by ``wait``
or by ``close``: it is never lost.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from steplib.checkpoint.contents import lanes
from steplib.checkpoint.copying import BackgroundCopy, Path, snapshot_tree, update_only_storages
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.saving import SavePlan, check_durable, prepare, write
from steplib.checkpoint.sharded.layout import is_sharded
from steplib.checkpoint.sharded.save import prepare_sharded, snapshot_plan, write_sharded
from steplib.errors import CheckpointError
from steplib.state import TrainState


class AsyncSaver:
    """Saves checkpoints in a background thread (one at a time).

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> with AsyncSaver() as saver:
        ...     url = saver.save(state, "memory://doctest-async/ckpt")
        ...     # training goes on here while the checkpoint is written
        >>> url
        'memory://doctest-async/ckpt/step-00000000'
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[Path, torch.Tensor] = {}
        self._sharded_buffers: dict[Path, torch.Tensor] = {}
        self._group: Any = None
        self._group_of: Any = None

    def save(
        self,
        state: TrainState,
        directory: str,
        *,
        data: Any = None,
        extras: Mapping[str, Any] | None = None,
        step: Any = None,
        metrics: Mapping[str, Any] | None = None,
        storage_options: StorageOptions = None,
        durable: bool = True,
        after: Callable[[str], Any] | None = None,
    ) -> str:
        """Snapshot ``state`` and write it in the background; see ``steplib.checkpoint.save``.

        Args:
            state: the state to save, as for ``save``.
            directory: the checkpoint directory, as for ``save``.
            data: the loader whose position is saved, as for ``save``.
            extras: further objects with ``state_dict``, as for ``save``.
            step: the step whose composition is recorded, as for ``save``.
            metrics: numbers for the manifest, as for ``save``.
            storage_options: passed to fsspec, as for ``save``.
            durable: as for ``save``: fsync the checkpoint before it counts as committed
                (``True``), or not (``False``; a power loss soon after may lose it).
            after: called with the checkpoint's URL in the background thread once the
                checkpoint is committed (e.g. pruning old checkpoints, queueing a report); its
                errors surface like the write's.

        Returns:
            The URL the checkpoint will have once committed.

        Raises:
            CheckpointError: the previous background save failed (raised here, before this
                save starts), or an argument error as for ``save``.
            ConfigError: a bad argument (``durable`` not a bool, and those of ``save``).
        """
        check_durable(durable, "AsyncSaver.save")
        self.wait()
        # Copied in the background: nothing but the next update changes them.
        deferred = set().union(*(update_only_storages(lane.optimizer) for lane in lanes(state)))
        arguments: dict[str, Any] = {
            "data": data,
            "extras": extras,
            "step": step,
            "metrics": metrics,
            "storage_options": storage_options,
            "caller": "AsyncSaver.save",
        }
        write_plan: Callable[[], Any]
        if is_sharded(state):
            # Every rank snapshots its part now and writes it in the background, on a process
            # group of its own: see _checkpoint_group.
            sharded_plan = prepare_sharded(state, directory, **arguments)
            sharded_copy, copied = snapshot_plan(
                sharded_plan, self._sharded_buffers, deferred=deferred
            )
            group = self._checkpoint_group()
            url, name = sharded_plan.url, sharded_plan.name

            def write_plan() -> Any:
                _wait(copied)
                return write_sharded(sharded_copy, group=group, fsync=durable)

        else:
            plan = prepare(state, directory, **arguments)
            trees, copied = snapshot_tree(plan.trees, self._buffers, deferred=deferred)
            copy = SavePlan(plan.directory, plan.name, trees, plan.manifest)
            url, name = plan.url, plan.name

            def write_plan() -> Any:
                _wait(copied)
                return write(copy, fsync=durable)

        for pending in copied:
            if isinstance(pending, BackgroundCopy):
                state.fence.hold(pending)
        self._thread = threading.Thread(
            target=self._write, args=(write_plan, after), name=f"steplib-save-{name}"
        )
        self._thread.start()
        return url

    @property
    def pending(self) -> bool:
        """Whether a background save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the background save (if any) is committed.

        Raises:
            CheckpointError: that save failed (the error it raised is its ``__cause__``).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(
                f"a background checkpoint save failed ({type(error).__name__}: {error}); "
                "nothing was committed by it and older checkpoints are intact. Fix the cause "
                "and save again."
            ) from error

    def close(self) -> None:
        """Wait for the background save and release the snapshot buffers."""
        try:
            self.wait()
        finally:
            self._buffers = {}
            self._sharded_buffers = {}

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _checkpoint_group(self) -> Any:
        """The process group the background sharded saves communicate on, created on the
        first one (by every rank, as ``new_group`` requires) and reused by the next ones.

        Training keeps issuing collectives on the default group while DCP writes in the
        background; two threads issuing collectives on one gloo group mix their messages up
        and crash. A gloo group also keeps DCP's small metadata exchanges off the GPU.
        """
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:  # a new default group
            self._group = dist.new_group(backend="gloo")
            self._group_of = world
        return self._group

    def _write(self, write_plan: Callable[[], str], after: Callable[[str], Any] | None) -> None:
        _lowest_priority()
        try:
            url = write_plan()
            if after is not None:
                after(url)
        except BaseException as err:  # surfaced by wait(); a thread cannot raise to its caller
            self._error = err


def _lowest_priority() -> None:
    """Make the calling thread (and the threads it starts) the last to get a core: Linux's
    nice 19 for this thread alone.

    Serialising, checksumming and copying into the page cache keep a core busy for about as
    long as a sync save takes. Where training keeps every core busy (CPU training; a loaded
    host), that work took cores from the training threads: on 2 cores an update next to the
    writer ran 3x slower, and the async save cost training as much time as a sync one
    (``benchmarks/bench_checkpoint.py``). At nice 19 the writer runs in the time training
    leaves idle and yields to it otherwise; the write takes longer only where the cores are
    busy, and a save, ``wait`` or ``close`` waiting for it leaves it the cores. (Elsewhere
    ``setpriority`` takes a process id, not a thread's: nothing is changed there.)
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # e.g. a sandbox without the system call
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def wait_snapshot(state: TrainState) -> None:
    """Wait until a pending async save has copied the parameters and optimizer state of
    ``state``: after this they may change in place without tearing that checkpoint.

    Steps and ``load`` call it themselves before they change them; call it before changing
    parameters in place outside the optimizer (a weight projection in a handler, say) while an
    ``AsyncSaver.save`` may be in flight. It returns at once when none is. Without it, such a
    change fails that checkpoint (``Tensor._version`` tells), except a change through
    ``.data``, which has a version counter of its own: that one would go unnoticed.

    Args:
        state: the state given to ``AsyncSaver.save`` (its optimizer identifies the save).

    Example:
        >>> import torch
        >>> from steplib import TrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> with AsyncSaver() as saver:
        ...     url = saver.save(state, "memory://doctest-wait-snapshot/ckpt")
        ...     wait_snapshot(state)
        ...     with torch.no_grad():
        ...         _ = model.weight.mul_(0)  # the checkpoint keeps the weights at save time
    """
    state.fence.wait()


def _wait(copied: list[Any]) -> None:
    """In the writer: wait until the snapshot's copies (GPU copies into the pinned buffers, the
    background copy of CPU tensors) have landed; raise if one is not a snapshot."""
    for copy in copied:
        copy.synchronize()

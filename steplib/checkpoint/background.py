"""Asynchronous saves: a snapshot into reused CPU buffers (pinned for GPU tensors), written in a
background thread. What only the next update changes is copied meanwhile (``TrainState.fence``)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Mapping
from copy import copy as shallow_copy
from typing import Any

import torch

from steplib.checkpoint import pipeline
from steplib.checkpoint.contents import DCP_DIR, lanes
from steplib.checkpoint.pipeline import Checkpoints
from steplib.checkpoint.storage import StorageOptions
from steplib.errors import CheckpointError, listed
from steplib.state import TrainState

Path = tuple[Any, ...]  # where a tensor sits in a tree: the key of its reused buffer


def snapshot(
    tree: Any, buffers: dict[Path, torch.Tensor], *, deferred: set[int]
) -> tuple[Any, list[Any]]:
    """A deep copy of ``tree``, each tensor in a CPU buffer reused by path (once if seen twice;
    ``deferred`` storages by a :class:`BackgroundCopy`), and what the writer must synchronize."""
    dtensor: Any = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    copies: dict[int, torch.Tensor] = {}
    used: dict[Path, torch.Tensor] = {}
    later: list[tuple[Path, torch.Tensor, torch.Tensor]] = []
    devices: set[torch.device] = set()

    def to_buffer(obj: Any, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        # Keyed by the id of the tree's own object (a DTensor's to_local() is new each time).
        if id(obj) not in copies:
            source = tensor.detach()
            if source.layout != torch.strided:  # sparse and other layouts: a plain copy
                copies[id(obj)] = source.to("cpu", copy=True)
                return copies[id(obj)]
            cuda = source.device.type == "cuda"
            buffer = buffers.get(path)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=cuda)
            if cuda:
                buffer.copy_(source, non_blocking=True)
                devices.add(source.device)
            elif _storage(source) in deferred and not source.is_inference():  # no _version
                later.append((path, buffer, source))
            else:
                buffer.copy_(source)
            used[path] = copies[id(obj)] = buffer
        return copies[id(obj)]

    def copy(obj: Any, path: Path) -> Any:
        if dtensor is not None and isinstance(obj, dtensor):
            local = to_buffer(obj, obj.to_local(), path)
            return dtensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                stride=obj.stride(),
            )  # fmt: skip
        if isinstance(obj, torch.Tensor):
            return to_buffer(obj, obj, path)
        if isinstance(obj, dict):
            copied = shallow_copy(obj)  # keeps what a state dict carries beside its items
            for key, value in obj.items():  # assigned: a Counter's update() adds the counts
                copied[key] = copy(value, (*path, key))
            return copied
        if isinstance(obj, list | tuple):
            return type(obj)(copy(v, (*path, i)) for i, v in enumerate(obj))
        return obj  # numbers, strings, None: immutable

    result = copy(tree, ())
    waits: list[Any] = [torch.cuda.current_stream(device).record_event() for device in devices]
    if later:
        waits.append(BackgroundCopy(later))
    buffers.clear()
    buffers.update(used)
    return result, waits


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def update_only_storages(state: TrainState) -> set[int]:
    """The CPU storages only an optimizer update changes: parameters and optimizer state."""
    dtensor: Any = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    tensors: list[torch.Tensor] = []
    for optimizer in (lane.optimizer for lane in lanes(state)):
        # A frozen parameter is not changed by the update, but may be by a forward or a
        # handler (a momentum encoder: MoCo's key encoder), through .data: no _version tells.
        tensors += [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = set()
    for tensor in tensors:
        local = tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor
        if local.device.type == "cpu" and local.layout == torch.strided:
            storages.add(_storage(local))
    storages.discard(0)  # empty tensors have no storage to tell apart
    return storages


class BackgroundCopy:
    """Copies CPU tensors into their buffers in a thread; a tensor changed in place meanwhile
    (``Tensor._version`` tells) fails the checkpoint instead of tearing it."""

    def __init__(self, copies: list[tuple[Path, torch.Tensor, torch.Tensor]]) -> None:
        self._copies: list[tuple[Path, torch.Tensor, torch.Tensor, int]] | None = [
            (path, buffer, source, source._version) for path, buffer, source in copies
        ]
        self._changed: list[Path] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="steplib-snapshot-background")
        self._thread.start()

    def _run(self) -> None:
        copies = self._copies
        assert copies is not None
        try:
            for _, buffer, source, _ in copies:
                buffer.copy_(source)
            # Any in-place change made during the copy has bumped the version by now.
            self._changed = [
                path for path, _, source, version in copies if source._version != version
            ]
        except BaseException as err:  # raised by synchronize(), in the writer
            self._error = err
        finally:
            self._copies = None  # keep no live tensor (a parameter) alive past the copy

    def join(self) -> None:
        self._thread.join()

    def synchronize(self) -> None:
        """Wait, then raise ``CheckpointError`` if a tensor changed during the copy."""
        self.join()
        if self._error is not None:
            raise self._error
        if self._changed:
            names = listed(["/".join(map(str, path)) for path in self._changed], shown=5)
            raise CheckpointError(
                f"{names} changed in place while the async checkpoint copied them (between the "
                "save and the next optimizer update): no snapshot, nothing was committed. Call "
                "state.fence.wait() before changing them, or save after."
            )


class AsyncSaver:
    """Saves checkpoints in a background thread, one at a time: the snapshot is taken now, the
    write runs while training goes on. An error there is raised by the next ``save``, ``wait``
    or ``close``: never lost.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> with AsyncSaver() as saver:
        ...     url = saver.save(state, "memory://doctest-async/ckpt")
        >>> url
        'memory://doctest-async/ckpt/step-00000000'
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[Path, torch.Tensor] = {}
        # Two threads' collectives on one gloo group mix up: the writes get a group of their own.
        self._group = pipeline.GlooGroup()

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
        trainable_only: bool = False,
        after: Callable[[str], Any] | None = None,
    ) -> str:
        """Snapshot ``state`` and write it in the background.

        Args:
            state, directory, data, extras, step, metrics, storage_options, durable,
                trainable_only: as ``save``.
            after: ``after(url)`` is called in the writer once committed.

        Returns:
            The URL the checkpoint will have (the previous save's error is raised first).
        """
        given = Checkpoints(directory, data, extras, step, storage_options, durable, trainable_only)
        return self.submit(given, state, metrics=metrics, after=after)

    def submit(
        self, given: Checkpoints, state: TrainState, *, metrics: Any, after: Any = None
    ) -> str:
        """:meth:`save` with its inputs given once (``checkpoint_every``'s)."""
        self.wait()
        plan = given.plan(state, metrics=metrics, caller="AsyncSaver.save")
        tree = {**plan.files, DCP_DIR: plan.tensors}  # DCP's tensors (None: not sharded) too
        files, waits = snapshot(tree, self._buffers, deferred=update_only_storages(state))
        copy = dataclasses.replace(plan, tensors=files.pop(DCP_DIR), files=files)
        for pending in waits:
            if isinstance(pending, BackgroundCopy):
                state.fence.hold(pending)
        group = self._group.get() if plan.tensors is not None else None

        def work() -> None:
            try:
                for pending in waits:
                    pending.synchronize()
                url = pipeline.write(copy, group=group)
                if after is not None:
                    after(url)
            except BaseException as err:  # surfaced by wait(); a thread cannot raise to its caller
                self._error = err

        self._thread = threading.Thread(target=work, name=f"steplib-save-{plan.manifest.name}")
        self._thread.start()
        return plan.url

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the background save is committed (``CheckpointError`` if it failed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(
                f"a background checkpoint save failed ({type(error).__name__}: {error}); it "
                "committed nothing and older checkpoints are intact. Fix the cause, save again."
            ) from error

    def close(self) -> None:
        """Wait for the background save and release the snapshot buffers."""
        try:
            self.wait()
        finally:
            self._buffers = {}

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

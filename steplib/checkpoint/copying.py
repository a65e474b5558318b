"""Copy many CPU tensors into preallocated buffers at memory speed: the snapshot of an async save.

``dst.copy_(src)`` of a large CPU tensor runs on torch's OpenMP team with a static split of the
work: each thread gets its share up front, and the copy ends when the slowest thread ends. On a
machine whose cores are shared (other processes, the data loader's workers, the background
writer of the previous save), one descheduled thread stalls the whole copy for its time slice,
and a snapshot that takes 15 ms when the machine is quiet takes hundreds of ms when it is not.

Here the bytes are cut into chunks of a few MiB that a few threads take one after the other
(dynamic scheduling): a thread that is descheduled delays only the chunk it holds. Each chunk
is one ``memmove`` through ``ctypes``, which releases the GIL, so the threads copy in parallel.
Only plain, dense, contiguous tensors of one dtype and shape are copied this way (their bytes
are the whole story); anything else goes through ``copy_``.

The parameters and the optimizer's state, most of a checkpoint's bytes, change only when the
optimizer updates them: those are copied by a :class:`BackgroundCopy` while training goes on,
and the next update waits for it (``TrainState.fence``). Everything else (buffers, which a
forward pass may change; the gradients of an open window; extras) is copied before the save
returns.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from collections.abc import Container, Sequence
from copy import copy as shallow_copy
from typing import Any

import torch

from steplib.errors import CheckpointError

Path = tuple[Any, ...]  # where a tensor sits in a tree: the key of its reused buffer

CHUNK_BYTES = 4 << 20
# A copy is bound by memory bandwidth, which a few threads saturate.
MAX_WORKERS = 8


def snapshot_tree(
    tree: Any, buffers: dict[Path, torch.Tensor], *, deferred: Container[int] = ()
) -> tuple[Any, list[Any]]:
    """A deep copy of ``tree`` with every tensor copied into a CPU buffer: the snapshot of an
    async save (plain and sharded alike).

    ``buffers`` (by path in the tree) are reused when a tensor at the same place has the same
    shape and dtype (the caller's previous snapshot has been written: nothing reads them any
    more), and are replaced by this snapshot's in place, so that after the first save nothing
    is allocated or page-faulted while training waits. A tensor seen twice (tied weights) is
    copied once; a ``DTensor`` stays a ``DTensor`` (its local shard copied), so that DCP still
    knows which part of the global tensor this rank holds.

    CPU tensors are copied by :func:`copy_tensors`: before this returns, except those whose
    storage (``untyped_storage().data_ptr()``) is in ``deferred``, which a
    :class:`BackgroundCopy` copies while the caller goes on. GPU tensors go into pinned buffers
    with ``non_blocking=True`` on their device's current stream: every later kernel of training
    on that stream (the optimizer step changing them in place) runs after the copy, so training
    need not wait for it.

    Args:
        tree: nested dicts, lists and tuples of tensors and plain values.
        buffers: the previous snapshot's buffers, by path; replaced by this one's.
        deferred: storages that nothing changes until the caller says so (the parameters and
            optimizer state, until the next update: see ``TrainState.fence``).

    Returns:
        The copy, and what the writer must ``synchronize()`` before reading the buffers: one
        CUDA event per device recorded after its copies, and the background copy, if any.
    """
    # A DTensor exists only once torch.distributed.tensor is imported: no import here.
    dtensor: Any = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    copies: dict[int, torch.Tensor] = {}
    used: dict[Path, torch.Tensor] = {}
    on_cpu: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, tensor): copied below
    later: list[tuple[Path, torch.Tensor, torch.Tensor]] = []  # (path, buffer, tensor): deferred
    devices: set[torch.device] = set()

    def to_buffer(obj: Any, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        # Keyed by the id of the tree's own object, alive during the whole walk (a DTensor's
        # to_local() is a new object each time, whose id could be reused).
        if id(obj) in copies:
            return copies[id(obj)]
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
            on_cpu.append((buffer, source))
        used[path] = copies[id(obj)] = buffer
        return buffer

    def copy(obj: Any, path: Path) -> Any:
        if dtensor is not None and isinstance(obj, dtensor):
            return dtensor.from_local(
                to_buffer(obj, obj.to_local(), path),
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            return to_buffer(obj, obj, path)
        if isinstance(obj, dict):
            out = {k: copy(v, (*path, k)) for k, v in obj.items()}
            if isinstance(obj, collections.OrderedDict):
                # A shallow copy keeps what the state dict carries beside its items (torch's
                # module versions, which load_state_dict reads); the items are then replaced.
                ordered = shallow_copy(obj)
                ordered.update(out)
                return ordered
            return out
        if isinstance(obj, list | tuple):
            return type(obj)(copy(v, (*path, i)) for i, v in enumerate(obj))
        return obj  # numbers, strings, None: immutable

    result = copy(tree, ())
    copy_tensors(on_cpu)  # meanwhile the GPU copies (if any) run on their own
    copied: list[Any] = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        copied.append(event)
    if later:
        copied.append(BackgroundCopy(later))
    buffers.clear()
    buffers.update(used)
    return result, copied


class BackgroundCopy:
    """Copies CPU tensors into their buffers in a thread, and checks that none of them changed
    in place meanwhile (``Tensor._version``): such a copy could hold half old, half new values.

    ``join()`` waits for the copy (what the next optimizer update does, through
    ``TrainState.fence``); ``synchronize()`` waits too and raises if the copy is not a
    snapshot (what the writer does before writing the buffers).
    """

    def __init__(self, copies: list[tuple[Path, torch.Tensor, torch.Tensor]]) -> None:
        self._copies: list[tuple[Path, torch.Tensor, torch.Tensor, int]] | None = [
            (path, buffer, source, source._version) for path, buffer, source in copies
        ]
        self._changed: list[Path] = []
        self._error: BaseException | None = None
        # At the caller's CPU priority, unlike the writer's (the next update waits for this).
        self._thread = threading.Thread(target=self._run, name="steplib-snapshot-background")
        self._thread.start()

    def _run(self) -> None:
        copies = self._copies
        assert copies is not None
        try:
            copy_tensors([(buffer, source) for _, buffer, source, _ in copies])
            # Any in-place change made during the copy has bumped the version by now.
            self._changed = [
                path for path, _, source, version in copies if source._version != version
            ]
        except BaseException as err:  # raised by synchronize(), in the writer
            self._error = err
        finally:
            self._copies = None  # keep no live tensor (a parameter) alive past the copy

    def join(self) -> None:
        """Wait until every tensor is copied."""
        self._thread.join()

    def synchronize(self) -> None:
        """Wait until every tensor is copied, then raise if some changed during the copy.

        Raises:
            CheckpointError: a tensor changed in place before its copy ended (names it).
        """
        self.join()
        if self._error is not None:
            raise self._error
        if self._changed:
            names = ", ".join("/".join(map(str, path)) for path in self._changed[:5])
            more = len(self._changed) - 5
            raise CheckpointError(
                f"{names}{f' and {more} more' if more > 0 else ''} changed in place while the "
                "async checkpoint was copying them in the background (between AsyncSaver.save "
                "and the next optimizer update), so the copy is not a snapshot; nothing was "
                "committed. Something outside the optimizer changed parameters or optimizer "
                "state in place: call steplib.checkpoint.wait_snapshot(state) before changing "
                "them (it waits for the copy), or change them before saving."
            )


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def update_only_storages(optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages that only ``optimizer``'s update changes: its parameters (``DTensor``
    shards included) and the tensors of its state. What :func:`snapshot_tree` may defer."""
    dtensor: Any = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    tensors: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    storages = set()
    for tensor in tensors:
        local = tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor
        if local.device.type == "cpu" and local.layout == torch.strided:
            storages.add(_storage(local))
    storages.discard(0)  # empty tensors have no storage to tell apart
    return storages


def copy_tensors(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair of CPU tensors, in parallel chunks.

    ``dst`` must not overlap ``src`` or another ``dst`` (they are the snapshot's own buffers).

    Args:
        pairs: ``(dst, src)`` tensors on the CPU; ``dst`` has ``src``'s shape.
        chunk_bytes: the unit of work a thread takes at a time.
        workers: threads copying (the caller's included); default: torch's intra-op thread
            count, at most ``MAX_WORKERS``.

    Example:
        >>> src = [torch.arange(6.0), torch.ones(2, 3).t()]
        >>> dst = [torch.empty(6), torch.empty(3, 2)]
        >>> copy_tensors(list(zip(dst, src)))
        >>> all(torch.equal(d, s) for d, s in zip(dst, src))
        True
    """
    jobs: list[tuple[int, int, int]] = []
    for dst, src in pairs:
        if not _raw_copyable(dst, src):
            dst.copy_(src)
            continue
        size = src.numel() * src.element_size()
        to, start = dst.data_ptr(), src.data_ptr()
        jobs += [
            (to + offset, start + offset, min(chunk_bytes, size - offset))
            for offset in range(0, size, chunk_bytes)
        ]
    if not jobs:
        return
    count = min(workers or min(torch.get_num_threads(), MAX_WORKERS), len(jobs))
    queue = iter(jobs)  # next() on a list iterator is atomic under the GIL
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for to, start, size in queue:
                ctypes.memmove(to, start, size)  # releases the GIL
        except BaseException as err:  # pragma: no cover - memmove does not raise
            errors.append(err)

    helpers = [
        threading.Thread(target=work, name="steplib-snapshot-copy") for _ in range(count - 1)
    ]
    for helper in helpers:
        helper.start()
    work()
    for helper in helpers:
        helper.join()
    if errors:  # pragma: no cover
        raise errors[0]


def _raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src``'s bytes, copied as they are into ``dst``, make ``dst`` equal to it."""
    return (
        type(dst) is torch.Tensor
        and type(src) is torch.Tensor
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.layout == torch.strided
        and src.layout == torch.strided
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (src.is_quantized or dst.is_quantized)
        and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
        and src.numel() > 0
    )

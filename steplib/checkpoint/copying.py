"""Copy many CPU tensors into preallocated buffers at memory speed: the snapshot an async save
makes while training waits.

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
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch

CHUNK_BYTES = 4 << 20
# A copy is bound by memory bandwidth, which a few threads saturate.
MAX_WORKERS = 8


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

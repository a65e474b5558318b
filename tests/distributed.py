"""Run a function on 2 CPU processes over gloo: fork start (no re-import), every join bounded,
so a hung rank fails the test instead of hanging CI."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(fn: Callable[[int, int], Any], rank: int, world: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)  # a forked child must not share the parent's OpenMP pool
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
    )
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        # Bytes, not tensors: a tensor sent through a queue is a shared-memory handle that dies
        # with this process, often before the parent reads it.
        buffer = io.BytesIO()
        torch.save(fn(rank, world), buffer)
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], Any], *, world: int = 2, timeout: float = 120) -> list[Any]:
    """``fn(rank, world)`` on ``world`` processes; returns the results in rank order.

    ``fn`` must free its DDP/FSDP models before returning (the process group is destroyed
    after it, and a live DDP reducer at that point can hang the teardown).
    """
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in procs:
            rank, status, payload = out.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    except Exception as err:  # queue.Empty: a rank hung
        errors.append(f"a rank did not answer within {timeout}s ({type(err).__name__})")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]

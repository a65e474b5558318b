"""Distributed checks: ``assert_ranks_in_sync`` inside a run, and ``run_ranks``, a small
multi-process gloo runner for CPU tests of distributed steps."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from steplib.errors import ConfigError

_SHOWN = 5  # differing parameters named in a message before "and N more"
# Asks a rank that did not answer for its stacks. Not SIGUSR1: `preemption` listens for that one.
_DUMP_STACKS = signal.SIGUSR2


def assert_ranks_in_sync(model: nn.Module, *, grads: bool = True) -> None:
    """Assert that every rank holds the same parameters (and gradients), by a cheap checksum.

    Each rank computes, per parameter, the sum and the sum of squares of its values in float64
    (and the same of its gradient, and whether it has one); one ``all_gather`` brings every
    rank's table to every rank, and each rank compares them. Every rank therefore raises the
    same error, and none waits for another. Sharded parameters (FSDP2 ``DTensor``) are compared
    whole (``full_tensor()``, a collective every rank makes in the same order): the same on
    every rank by construction, so for a model sharded alone (FSDP2 without replicas) the check
    cannot fail, and catches drift only in the replicated parameters beside the shards. Call it
    at the same point on every rank, e.g. after an update in a test, or every N steps in a
    handler.

    Buffers are not compared: BatchNorm's running statistics legitimately differ across ranks
    under DDP (rank 0's are broadcast at the start of each forward, then every rank updates
    them from its own batch; with ``broadcast_buffers=False`` they differ for good), so a
    buffer check would fail every correct DDP run with BatchNorm.

    Args:
        model: the model on this rank (a DDP-wrapped one is fine).
        grads: also compare gradients where present (they are ``None`` right after an update,
            which zeroes them; call it before the update, or in a ``tap`` hook, to compare
            the synchronised gradients).

    Raises:
        AssertionError: the ranks differ. The message names the first parameter that differs,
            what differs (value, gradient, or a gradient on some ranks only), each group of
            ranks with its checksum, and the other parameters that differ.
        ConfigError: no process group is initialised, or the ranks hold different numbers of
            parameters.

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        >>> assert_ranks_in_sync(torch.nn.Linear(2, 2))
        >>> dist.destroy_process_group()
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "assert_ranks_in_sync needs an initialised torch.distributed process group; call it "
            "inside the distributed run (torchrun, or steplib.testing.run_ranks in a test)."
        )
    named = list(model.named_parameters())
    device = torch.device("cpu")
    if _on_nccl():  # NCCL moves CUDA tensors only; gloo takes CPU tensors
        device = torch.device("cuda", torch.cuda.current_device())
    rows = [_row(p, grads).to(device) for _, p in named]
    mine = torch.stack(rows) if rows else torch.zeros(0, 5, dtype=torch.float64, device=device)
    world = dist.get_world_size()
    count = torch.tensor([float(len(named))], dtype=torch.float64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    if len({int(c.item()) for c in counts}) > 1:
        raise ConfigError(
            "assert_ranks_in_sync: the ranks hold different numbers of parameters "
            f"({[int(c.item()) for c in counts]} by rank); they are not training one model."
        )
    tables = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(tables, mine)
    tables = [t.cpu() for t in tables]
    differing = [i for i in range(len(named)) if not all(_same(t[i], tables[0][i]) for t in tables)]
    if not differing:
        return
    first = differing[0]
    name = named[first][0]
    groups: dict[tuple[float, ...], list[int]] = {}
    for rank, table in enumerate(tables):
        groups.setdefault(tuple(table[first].tolist()), []).append(rank)
    what = _what_differs([row for row, _ in groups.items()])
    shown = ", ".join(repr(named[i][0]) for i in differing[1:_SHOWN])
    more = len(differing) - _SHOWN
    others = f" Also differ: {shown}{f' and {more} more' if more > 0 else ''}." if shown else ""
    ranks = "; ".join(f"{_ranks(r)}: {_format(row)}" for row, r in groups.items())
    raise AssertionError(
        f"assert_ranks_in_sync: parameter {name!r} differs across ranks ({what}): {ranks}.{others} "
        "The ranks are no longer training one model: gradients not averaged (a no_sync "
        "misuse, static_graph), a per-rank decision (a skipped step on one rank only), or "
        "different initial weights (seed before building the model, or let DDP broadcast)."
    )


def run_ranks(
    fn: Callable[[int, int], Any], *, world: int = 2, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world)`` on ``world`` CPU processes joined by a gloo process group.

    Processes are forked (no re-import; ``fn`` may be a closure), each uses one thread, and
    every wait is bounded, so a hung rank fails the test instead of hanging it. Each result
    travels back as ``torch.save`` bytes (a tensor sent through a queue is a shared-memory
    handle that dies with its process) and is read with ``weights_only=True``: return
    tensors, numbers, strings and containers of them. ``fn`` must free a DDP/FSDP model
    before returning (a live reducer can hang the group's teardown). ``fn`` may compile even
    where this process has compiled before: each rank compiles in its own thread.

    Args:
        fn: ``fn(rank, world) -> result``, run after ``init_process_group("gloo")``.
        world: the number of processes.
        timeout: seconds to wait for every rank's result.

    Returns:
        The results in rank order.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or did not answer in
            time (the message holds the Python stack of each thread of each rank that was still
            running, or the exit code of one that died).

    Example:
        Two ranks each contribute ``rank + 1`` to an all-reduce (well under a second):

        >>> def total(rank, world):
        ...     value = torch.tensor([rank + 1.0])
        ...     dist.all_reduce(value)
        ...     return (rank, world, value.item())
        >>> run_ranks(total, world=2, timeout=60)
        [(0, 2, 3.0), (1, 2, 3.0)]

        In a test of a distributed step::

            def check(rank, world):
                model = DistributedDataParallel(build_model())
                ...  # train a few steps
                assert_ranks_in_sync(model)
                return rank

            assert run_ranks(check) == [0, 1]
    """
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    with contextlib.ExitStack() as files:  # where a rank that does not answer writes its stacks
        stacks = [files.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        # The ranks meet in a file of this call's own, not at a port that a concurrent call
        # (another test worker) may have picked too: _free_port's port is free when chosen only.
        store = os.path.join(files.enter_context(tempfile.TemporaryDirectory()), "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world, port, store, out, stacks[r]))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        try:
            results, errors, silent = _collect(out, procs, timeout)
            # The dead first: a rank that died is the cause of the others' wait, not a hang.
            died = any(not procs[rank].is_alive() for rank in silent)
            for rank in sorted(silent, key=lambda rank: procs[rank].is_alive()):
                errors.append(_where(rank, procs[rank], stacks[rank], timeout, died))
                procs[rank].kill()  # nothing more to wait for
        finally:
            for proc in procs:
                proc.join(timeout=10)  # an answered rank may still be leaving its group
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        raise AssertionError("run_ranks: " + "\n".join(errors))
    return [results[r] for r in range(world)]


def _collect(
    out: Any, procs: list[Any], timeout: float
) -> tuple[dict[int, Any], list[str], list[int]]:
    """Each rank's result or error, until all answered, one died, or ``timeout`` passed; and
    the ranks that did not answer."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    pending = set(range(len(procs)))
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        # Seen dead before the read: whatever such a rank sent is already in the pipe.
        dead = [rank for rank in pending if not procs[rank].is_alive()]
        try:
            rank, status, payload = out.get(timeout=0.2)
        except queue.Empty:
            if dead:
                break
            continue
        pending.discard(rank)
        if status != "ok":
            errors.append(f"rank {rank} failed:\n{payload}")
            continue
        try:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as err:
            errors.append(
                f"rank {rank}'s result could not be read back ({err}); return tensors, numbers, "
                "strings and containers of them."
            )
    return results, errors, sorted(pending)


def _where(rank: int, proc: Any, stacks: IO[bytes], timeout: float, died: bool) -> str:
    """Why a rank did not answer: how it ended, or its threads' Python stacks (at the timeout,
    or when another rank ``died``, which stopped the wait before it)."""
    if not proc.is_alive():
        return f"rank {rank} died without an answer (exit code {proc.exitcode})."
    os.kill(proc.pid, _DUMP_STACKS)  # faulthandler in the rank writes every thread's stack
    # faulthandler writes line by line: wait until something is written and it stops growing
    # (a read after the first line alone showed "Current thread ..." and no frame).
    deadline, size = time.monotonic() + 5, -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = os.fstat(stacks.fileno()).st_size
        if now > 0 and now == size:
            break
        size = now
    stacks.seek(0)
    text = stacks.read().decode(errors="replace").strip() or "(it wrote no stack in 5 s)"
    if died:  # stopped by another's death, long before the timeout: no hang to claim
        return f"rank {rank} was still running when the ranks were stopped, at:\n{text}\n"
    return f"rank {rank} did not answer within {timeout}s; it was still running, at:\n{text}\n"


def _worker(
    fn: Callable[[int, int], Any],
    rank: int,
    world: int,
    port: int,
    store: str,
    out: Any,
    stacks: IO[bytes],
) -> None:
    torch.set_num_threads(1)  # a forked child must not share the parent's OpenMP pool
    faulthandler.register(_DUMP_STACKS, file=stacks, all_threads=True)
    _compile_in_process()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
    os.environ.update({**env, "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            store=dist.FileStore(store, world),
            timeout=datetime.timedelta(seconds=60),
        )
        # Gloo's connections are up on this rank, perhaps not yet on the others: a rank whose
        # fn ends at once would close them mid-handshake ("Connection closed by peer").
        dist.barrier()
        buffer = io.BytesIO()
        torch.save(fn(rank, world), buffer)
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _compile_in_process() -> None:
    # A parent that has compiled holds inductor's compile ThreadPoolExecutor; a forked child
    # inherits the executor but not its threads, and torch's at-fork hook resets only the
    # process pool (torch 2.13). A kernel the child submits there never runs: the rank hangs
    # at its first cache miss. One compile thread makes inductor compile in the calling thread.
    if "torch._inductor.config" in sys.modules:  # else the child starts its own, live, pools
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _on_nccl() -> bool:
    return dist.get_backend() == "nccl"


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a sharded DTensor: gather it whole
    return full() if callable(full) else tensor


def _row(p: torch.Tensor, grads: bool) -> torch.Tensor:
    """Value sum, value sum of squares, has-gradient flag, gradient sum and sum of squares."""
    value = _whole(p.detach()).double()
    grad = p.grad if grads else None
    g = value.new_zeros(()) if grad is None else _whole(grad.detach()).double()
    has = value.new_tensor(0.0 if grad is None else 1.0)
    return torch.stack([value.sum(), value.pow(2).sum(), has, g.sum(), g.pow(2).sum()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _what_differs(rows: list[tuple[float, ...]]) -> str:
    if len({row[:2] for row in rows}) > 1:
        return "its values"
    if len({row[2] for row in rows}) > 1:
        return "a gradient on some ranks only"
    return "its gradient"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _format(row: tuple[float, ...]) -> str:
    text = f"value sum {row[0]:.9g}, sum of squares {row[1]:.9g}"
    if row[2]:
        text += f"; gradient sum {row[3]:.9g}, sum of squares {row[4]:.9g}"
    return text

"""``run_ranks`` from a process that has already compiled: the forked ranks compile too.

A process that has compiled holds inductor's compile thread pool. A forked rank inherits the
pool object but not its threads, so before the fix its first compile that missed the on-disk
cache waited forever (CI hung twice on ``compile_step(ddp_wrap(...))`` this way). Each kernel
here carries a constant drawn for this run, so neither the parent's nor a rank's compile can be
served from an earlier run's cache.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from steplib.testing import run_ranks

_SCALE = random.Random().uniform(1.0, 2.0)  # a new kernel source every run: a cache miss


def _compile_fresh(rank: int, world: int) -> float:
    scale = _SCALE + 0.5 + rank  # a kernel neither the parent nor the other rank compiled

    @torch.compile(backend="inductor")
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * scale).sin().sum()

    value = f(torch.ones(8))
    dist.all_reduce(value)
    return float(value)


def test_ranks_forked_after_a_compile_compile_their_own_kernels() -> None:
    @torch.compile(backend="inductor")
    def g(x: torch.Tensor) -> torch.Tensor:
        return (x * _SCALE).cos().sum()

    torch.testing.assert_close(g(torch.ones(8)), (torch.ones(8) * _SCALE).cos().sum())
    expected = sum(8 * torch.sin(torch.tensor(_SCALE + 0.5 + r)).item() for r in range(2))
    # Well under the timeout once fixed (~10 s cold here); before the fix, both ranks hung.
    results = run_ranks(_compile_fresh, timeout=120)
    for result in results:
        assert abs(result - expected) < 1e-4

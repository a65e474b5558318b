"""``run_ranks``: ranks forked from a process that has already compiled compile too, and a rank
that hangs or dies is reported with where it was.

A process that has compiled holds inductor's compile thread pool. A forked rank inherits the
pool object but not its threads, so before the fix its first compile that missed the on-disk
cache waited forever (CI hung twice on ``compile_step(ddp_wrap(...))`` this way). Each kernel
here carries a constant drawn for this run, so neither the parent's nor a rank's compile can be
served from an earlier run's cache.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
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


def _rank_1_waits_forever(rank: int, world: int) -> int:
    if rank == 1:
        threading.Event().wait()
    return rank


def _rank_1_dies(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_does_not_answer_is_shown_where_it_waits() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_1_waits_forever, timeout=5)
    message = str(info.value)
    assert "rank 1 did not answer within 5s; it was still running, at:" in message
    assert "in _rank_1_waits_forever" in message  # the hung rank's own frame
    assert "rank 0" not in message  # rank 0 answered: nothing to say about it


def test_a_rank_that_died_is_named_with_its_exit_code_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 died without an answer \\(exit code 3\\)"):
        run_ranks(_rank_1_dies, timeout=120)
    # Not after the timeout: a dead rank is noticed while the others are waited for.
    assert time.monotonic() - started < 60


def _rank_1_dies_while_rank_0_waits(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    threading.Event().wait()  # as in a collective with the dead rank
    return rank


def test_a_rank_stopped_because_another_died_is_not_said_to_have_timed_out() -> None:
    # It said "rank 0 did not answer within 120s" first, after 1 s: a hang that did not happen.
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank_1_dies_while_rank_0_waits, timeout=120)
    message = str(info.value)
    assert message.startswith("run_ranks: rank 1 died without an answer (exit code 3).")
    assert "within 120s" not in message
    assert "rank 0 was still running when the ranks were stopped" in message
    assert "in _rank_1_dies_while_rank_0_waits" in message  # where rank 0 was


class _NotATensor:
    """A result ``torch.load(weights_only=True)`` refuses to rebuild."""


def _returns_an_object(rank: int, world: int) -> _NotATensor:
    return _NotATensor()


def test_a_result_that_cannot_be_read_back_is_named_as_such() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_returns_an_object, timeout=60)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank}'s result could not be read back" in message
    assert "return tensors, numbers, strings and containers of them" in message
    assert "did not answer" not in message  # both answered: no timeout is claimed

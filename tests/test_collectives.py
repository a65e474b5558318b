"""The collectives of steplib.distributed on 2 gloo ranks, against what torch says of the
same numbers in one process (``torch.max`` of a tensor holding a NaN is NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from steplib.distributed import any_rank, every_rank, max_over_ranks
from steplib.testing import run_ranks

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "values",
    [(1.0, NAN), (NAN, 1.0), (NAN, NAN), (-INF, NAN), (2.0, 3.0), (-INF, -INF), (INF, 1.0)],
)
def test_max_over_ranks_equals_torch_max_also_with_a_nan_on_any_rank(values) -> None:
    want = float(torch.tensor(values, dtype=torch.float64).max())
    for got in run_ranks(lambda rank, world: max_over_ranks(values[rank])):
        assert got == want or (math.isnan(got) and math.isnan(want)), (values, got, want)


def test_any_rank_and_every_rank_on_two_ranks() -> None:
    def flags(rank: int, world: int) -> list[bool]:
        mine = rank == 1
        return [any_rank(mine), every_rank(mine), any_rank(False), every_rank(True)]

    assert run_ranks(flags) == [[True, False, False, True]] * 2

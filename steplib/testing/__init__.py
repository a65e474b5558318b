"""Tools that let you prove your own steps right: the checks steplib's own laws use, public.

* :func:`assert_steps_equivalent`: two ``(step, state)`` factories train alike, update by update.
* :func:`assert_accumulation_exact`: ``accumulate(step, k)`` equals one step on the
  concatenated batch (the test of a token-weighted ``loss_fn``).
* :func:`assert_no_host_sync`: a step never reads a tensor on the host.
* :func:`verify_resume`: save, rebuild from scratch, load, continue = the uninterrupted run.
* :func:`assert_ranks_in_sync` and :func:`run_ranks`: ranks hold the same model; a 2-process
  gloo runner for CPU tests.
* :func:`reference_loop`: the plain PyTorch loop the laws are stated against.

Every assertion raises ``AssertionError`` naming where two runs parted first (the update or
call, the parameter, the quantity, the difference), so pytest shows what went wrong without a
debugger. The pytest fixtures ``tmp_checkpoint_dir`` and ``gloo_ranks`` live in
``steplib.testing.plugin``; importing this package does not import pytest.
"""

from steplib.testing.equivalence import (
    assert_accumulation_exact,
    assert_steps_equivalent,
    concat_batches,
)
from steplib.testing.host_sync import HOST_READS, assert_no_host_sync
from steplib.testing.ranks import assert_ranks_in_sync, run_ranks
from steplib.testing.reference import UpdateRecord, reference_loop
from steplib.testing.resume import verify_resume

__all__ = [
    "HOST_READS",
    "UpdateRecord",
    "assert_accumulation_exact",
    "assert_no_host_sync",
    "assert_ranks_in_sync",
    "assert_steps_equivalent",
    "concat_batches",
    "reference_loop",
    "run_ranks",
    "verify_resume",
]

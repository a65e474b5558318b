"""Preloaded by the fault-injection test's forkserver: importing it there trains one tiny step.

torch imports much of itself lazily (the optimizers pull in torch._dynamo and sympy: seconds
of imports). A forkserver child starts from the server's memory, so whatever the server has
imported, every child has for free; this module makes the server import it all once.

It does so only where ``STEPLIB_FORK_WARMUP=1`` (set by that test for its forkserver), so that
importing it elsewhere (``pytest --doctest-modules tests``) changes nothing.
"""

from __future__ import annotations

import io
import os

import torch

from steplib import Events, run
from tests.resume_worker import Setup, build

if os.environ.get("STEPLIB_FORK_WARMUP") == "1":
    # One thread: no OpenMP pool is started in the server, so no forked child inherits a pool
    # whose threads did not survive the fork.
    torch.set_num_threads(1)
    _step, _state, _loader = build(Setup(steps=4))
    _state = run(_step, _state, _loader, events=Events(), max_steps=1)
    _buffer = io.BytesIO()
    torch.save(_state.optimizer.state_dict(), _buffer)
    torch.load(io.BytesIO(_buffer.getvalue()), weights_only=True)
    # What the background-save kill test's children build (torchmetrics, the handlers, the
    # evaluator) is imported once here too: seconds a child otherwise.
    import tests.test_checkpoint_fault_injection
    import tests.test_resume_combinations  # noqa: F401

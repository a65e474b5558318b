"""PyTorch Ignite: an ``Engine`` with the accumulation and clipping in its update function.

``create_supervised_trainer`` has ``gradient_accumulation_steps`` but no clipping hook between
backward and ``optimizer.step``, so the recipe needs a custom update function, which is how
Ignite's docs write anything beyond the basic step. Its default ``output_transform`` would call
``loss.item()`` every iteration; this one returns the detached loss tensor instead.

Interleaving: one ``engine.run`` over the cycled pool, paused with ``engine.interrupt()`` (an
ITERATION_COMPLETED handler fires it at the chunk's last iteration) and resumed by calling
``engine.run`` again, which continues the same run generator and data iterator.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from benchmarks.contenders import Contender
from benchmarks.contenders._quiet import quiet
from benchmarks.workloads import Batch


class _Pool:
    """The data pool as an iterable the engine re-iterates once per epoch."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class IgniteContender(Contender):
    name = "ignite"
    label = "Ignite"
    requires = ("ignite",)
    distributions = ("pytorch-ignite",)
    notes = (
        "Engine(update) over the pool; update: forward, (loss / k).backward(), and every k-th "
        "iteration clip_grad_norm_, optimizer.step, zero_grad, scheduler.step; returns "
        "loss.detach() (create_supervised_trainer has no clipping and its default "
        "output_transform calls loss.item() per iteration). Chunks: engine.interrupt() from an "
        "ITERATION_COMPLETED handler, resumed with engine.run()."
    )

    def build(self) -> None:
        # importlib, not `import ignite`: the bench extra is optional (mypy without it).
        engine_mod: Any = importlib.import_module("ignite.engine")
        model = self.setup.make_model()
        optimizer = self.setup.make_optimizer(model.parameters())
        scheduler = self.setup.make_scheduler(optimizer)
        loss_fn, k, max_norm = self.setup.loss_fn, self.setup.accumulation, self.setup.max_norm
        self.model = model

        def update(engine: Any, batch: Batch) -> torch.Tensor:
            loss = loss_fn(model, batch)
            (loss / k).backward()
            if engine.state.iteration % k == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            return loss.detach()

        self.engine = engine_mod.Engine(update)
        self._stop_at = 0

        def pause(engine: Any) -> None:
            if engine.state.iteration >= self._stop_at:
                engine.interrupt()

        self.engine.add_event_handler(engine_mod.Events.ITERATION_COMPLETED, pause)
        self._pool = _Pool(list(self.setup.batches))

    def advance(self, steps: int) -> None:
        self._stop_at += steps * self.setup.accumulation
        # max_epochs far beyond the run: the engine never completes, it is only interrupted.
        self.engine.run(self._pool, max_epochs=1_000_000)

    def module(self) -> nn.Module:
        return self.model

    def close(self) -> None:
        # End the paused run the way Ignite ends one (terminate, then resume so it fires
        # TERMINATE/COMPLETED and returns); a run generator left suspended would be closed by the
        # garbage collector at exit and log a spurious "terminating due to exception".
        if self.engine._internal_run_generator is not None:
            self.engine.terminate()
            self.engine.run(self._pool, max_epochs=1_000_000)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with quiet(["ignite"]):
            yield

"""Hugging Face Accelerate, with ``accelerator.accumulate`` and ``clip_grad_norm_``."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from benchmarks.contenders import Contender
from benchmarks.contenders._quiet import quiet


class AccelerateContender(Contender):
    name = "accelerate"
    label = "HF Accelerate"
    requires = ("accelerate",)
    distributions = ("accelerate",)
    notes = (
        "Accelerator(gradient_accumulation_steps=k, mixed_precision='no'); model, optimizer and "
        "scheduler through prepare(); per micro-batch: `with accelerator.accumulate(model):` "
        "forward, accelerator.backward(loss) (divides by k itself), clip_grad_norm_ when "
        "sync_gradients, optimizer.step, scheduler.step, optimizer.zero_grad (the prepared "
        "objects skip on non-final micro-batches). The data pool is not a prepared DataLoader "
        "(already on the device), so the window is counted by Accelerate's step counter."
    )

    def build(self) -> None:
        # importlib, not `import accelerate`: the bench extra is optional (mypy without it).
        acc: Any = importlib.import_module("accelerate")
        self._acc_mod = acc
        self.accelerator = acc.Accelerator(
            cpu=self.setup.device.type != "cuda",
            gradient_accumulation_steps=self.setup.accumulation,
            mixed_precision="no",
        )
        model = self.setup.make_model()
        optimizer = self.setup.make_optimizer(model.parameters())
        scheduler = self.setup.make_scheduler(optimizer)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            model, optimizer, scheduler
        )

    def advance(self, steps: int) -> None:
        accelerator, model = self.accelerator, self.model
        optimizer, scheduler = self.optimizer, self.scheduler
        loss_fn, max_norm = self.setup.loss_fn, self.setup.max_norm
        for _ in range(steps * self.setup.accumulation):
            with accelerator.accumulate(model):
                loss = loss_fn(model, self.next_batch())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    def module(self) -> nn.Module:
        unwrapped: nn.Module = self.accelerator.unwrap_model(self.model)
        return unwrapped

    def close(self) -> None:
        # Accelerate keeps process-wide singletons (AcceleratorState, GradientState); reset
        # them so the next workload (or test) starts from a clean state.
        state_mod: Any = importlib.import_module("accelerate.state")
        self.accelerator.free_memory()
        state_mod.AcceleratorState._reset_state(True)
        state_mod.GradientState._reset_state()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with quiet(["accelerate"]):
            yield

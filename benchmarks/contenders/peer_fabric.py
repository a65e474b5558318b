"""Lightning Fabric, with its documented accumulation and clipping APIs."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from benchmarks.contenders import Contender
from benchmarks.contenders._quiet import quiet


class FabricContender(Contender):
    name = "fabric"
    label = "Lightning Fabric"
    requires = ("lightning",)
    distributions = ("lightning",)
    notes = (
        "Fabric(devices=1, precision='32-true'); per micro-batch: forward and "
        "fabric.backward(loss / k) inside fabric.no_backward_sync(model, enabled=not last); "
        "on the last: fabric.clip_gradients(max_norm=1.0, error_if_nonfinite=False; Fabric's "
        "default True reads the norm on the host, a sync per update), optimizer.step, "
        "zero_grad, scheduler.step. The user's own loop, no logging."
    )

    def build(self) -> None:
        # importlib, not `import lightning`: the bench extra is optional, and mypy must pass
        # where it is not installed.
        fabric_mod: Any = importlib.import_module("lightning.fabric")
        accelerator = "cuda" if self.setup.device.type == "cuda" else "cpu"
        self.fabric = fabric_mod.Fabric(accelerator=accelerator, devices=1, precision="32-true")
        model = self.setup.make_model()
        optimizer = self.setup.make_optimizer(model.parameters())
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        # Fabric does not wrap schedulers; the user steps the torch one.
        self.scheduler = self.setup.make_scheduler(optimizer)

    def advance(self, steps: int) -> None:
        fabric, model, optimizer, scheduler = (
            self.fabric,
            self.model,
            self.optimizer,
            self.scheduler,
        )
        loss_fn, k, max_norm = self.setup.loss_fn, self.setup.accumulation, self.setup.max_norm
        for _ in range(steps):
            for i in range(k):
                last = i == k - 1
                with fabric.no_backward_sync(model, enabled=not last):
                    loss = loss_fn(model, self.next_batch())
                    fabric.backward(loss / k)
            # error_if_nonfinite=False: Fabric defaults it to True, which makes torch test the
            # norm on the host (a device sync per update); the raw loop uses torch's False.
            fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

    def module(self) -> nn.Module:
        inner: nn.Module = self.model.module
        return inner

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with quiet(["lightning.fabric", "lightning_fabric"]):
            yield

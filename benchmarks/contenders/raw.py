"""The reference: a plain PyTorch loop, the way the PyTorch docs write accumulation."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.contenders import Contender


class RawContender(Contender):
    name = "raw"
    label = "raw loop"
    notes = (
        "(loss / k).backward() per micro-batch; clip_grad_norm_, optimizer.step, "
        "zero_grad(set_to_none=True), scheduler.step once per window. No .item()."
    )

    def build(self) -> None:
        self.model = self.setup.make_model()
        self.optimizer = self.setup.make_optimizer(self.model.parameters())
        self.scheduler = self.setup.make_scheduler(self.optimizer)

    def advance(self, steps: int) -> None:
        model, optimizer, scheduler = self.model, self.optimizer, self.scheduler
        loss_fn, k, max_norm = self.setup.loss_fn, self.setup.accumulation, self.setup.max_norm
        for _ in range(steps):
            for _ in range(k):
                loss = loss_fn(model, self.next_batch())
                # Dividing a mean loss by k = 4 (a power of two) per micro-batch is bit-identical
                # to summing the gradients and dividing once, which is what steplib does.
                (loss / k).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()

    def module(self) -> nn.Module:
        return self.model

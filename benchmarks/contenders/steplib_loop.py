"""steplib, driven by the user's own Python loop and by ``steplib.run``."""

from __future__ import annotations

from torch import nn

import steplib
from benchmarks.contenders import Contender


class SteplibContender(Contender):
    name = "steplib"
    label = "steplib"
    notes = (
        "accumulate(clip(make_train_step(loss_fn), max_norm=1.0), 4), called as "
        "`state, out = step(state, batch)` in a plain for loop (the user's own loop)."
    )

    def build(self) -> None:
        model = self.setup.make_model()
        optimizer = self.setup.make_optimizer(model.parameters())
        self.state = steplib.TrainState.create(
            model=model, optimizer=optimizer, scheduler=self.setup.make_scheduler(optimizer)
        )
        base = steplib.make_train_step(self.setup.loss_fn)
        self.step = steplib.accumulate(
            steplib.clip(base, max_norm=self.setup.max_norm), self.setup.accumulation
        )

    def advance(self, steps: int) -> None:
        step, state = self.step, self.state
        for _ in range(steps * self.setup.accumulation):
            state, _out = step(state, self.next_batch())
        self.state = state

    def module(self) -> nn.Module:
        return self.state.model


class SteplibRunContender(SteplibContender):
    name = "steplib-run"
    label = "steplib.run"
    notes = (
        "the same step driven by steplib.run(step, state, batches, max_steps=...) once per "
        "chunk, over a list of the chunk's micro-batches (no events registered); the run() "
        "call's own set-up is charged to the chunk."
    )

    def advance(self, steps: int) -> None:
        batches = self.take(steps * self.setup.accumulation)
        self.state = steplib.run(self.step, self.state, batches, max_steps=self.state.step + steps)

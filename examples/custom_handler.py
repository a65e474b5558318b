"""A custom handler: stop a run when the loss spikes, without a host sync per update.

``LossSpikeStop`` keeps a running average of the update loss on the device and a device flag
of the first update whose loss exceeded ``factor`` times that average. Every ``check_every``
updates it reads the flag once (one host transfer) and returns ``Stop(reason)`` if it is set:
the loop then ends cleanly (``fit_end`` handlers run, a checkpoint handler saves).

It shows the shape of a stateful handler: an object you build and hold, a method named after
the event it runs on (``on_step_end``: ``Events`` registers it), work on the device on every
event and host reads on an interval it checks itself (``due``), a
``Stop`` to end the run, and ``state_dict`` / ``load_state_dict`` so that a checkpoint carries
it (attached to the run, it is saved by ``checkpoint_every`` and restored by ``resume_from``).
``docs/custom_wrappers_and_handlers.md`` walks through it; ``tests/test_custom_examples.py``
tests it.

    python examples/custom_handler.py
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, Event, Events, Stop, TrainState, make_train_step, run
from steplib.cadence import due
from steplib.errors import same_handler
from steplib.events import Handler


class LossSpikeStop(Handler):  # Handler gives it attach(events); Events(spikes) works without
    """Stop when an update's loss exceeds ``factor`` times its running average.

    Args:
        factor: how many times the running average counts as a spike, > 1.
        decay: weight of the old average at each update, in [0, 1).
        warmup: updates to average before spikes count (early losses move fast).
        check_every: read the flag on the host every this many updates.

    Attributes:
        spike_step: the update of the first spike, once a check has seen it; else ``None``.

    Raises:
        ConfigError: a setting out of range.

    Example:
        >>> spikes = LossSpikeStop(factor=2.0, warmup=2, check_every=1)
        >>> for step, loss in enumerate([1.0, 1.0, 1.0, 5.0], start=1):
        ...     out = type("Out", (), {"loss": torch.tensor(loss)})()
        ...     event = Event("step_end", state=None, output=out, step=step)
        ...     spikes.update(event)
        ...     stop = spikes.check(event)
        >>> stop.reason
        'loss spike at update 4: more than 2.0x its running average'
    """

    def __init__(
        self, *, factor: float = 3.0, decay: float = 0.9, warmup: int = 10, check_every: int = 10
    ) -> None:
        if not factor > 1:
            raise ConfigError(f"LossSpikeStop(factor=...) received {factor!r}; pass a number > 1.")
        if not 0 <= decay < 1:
            raise ConfigError(f"LossSpikeStop(decay=...) received {decay!r}; pass one in [0, 1).")
        for name, value in (("warmup", warmup), ("check_every", check_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"LossSpikeStop({name}=...) received {value!r}; pass an int >= 1."
                )
        self.factor, self.decay, self.warmup, self.check_every = factor, decay, warmup, check_every
        self.spike_step: int | None = None
        self._average: torch.Tensor | None = None  # running average of the loss, on the device
        self._first: torch.Tensor | None = None  # update of the first spike, -1 for none
        self._seen = 0  # updates averaged (a host int: counting needs no device read)

    def on_step_end(self, event: Event) -> Stop | None:
        """:meth:`update` on every update, :meth:`check` every ``check_every``."""
        self.update(event)
        if not due(self.check_every, event):
            return None
        return self.check(event)

    def update(self, event: Event) -> None:
        """Fold this update's loss into the average and flag a spike: device ops only."""
        loss = event.output.loss.detach().float()
        if self._average is None or self._first is None:
            self._average = loss.clone()
            self._first = torch.full((), -1, dtype=torch.long, device=loss.device)
        else:
            if self._seen >= self.warmup:
                spike = (loss > self.factor * self._average) & (self._first < 0)
                self._first = torch.where(spike, event.step, self._first)
            # A NaN loss would poison the average; NonFiniteAlarm is the handler for NaNs.
            finite = torch.isfinite(loss)
            blended = torch.lerp(self._average, loss, 1 - self.decay)
            self._average = torch.where(finite, blended, self._average)
        self._seen += 1

    def check(self, event: Event) -> Stop | None:
        """Read the flag (one host transfer); ``Stop`` if a spike was seen."""
        if self._first is None:
            return None
        first = int(self._first)  # the host read, once per `check_every` updates
        if first < 0:
            return None
        self.spike_step = first
        return Stop(f"loss spike at update {first}: more than {self.factor}x its running average")

    def _built(self) -> dict[str, Any]:
        # What tells this stopper from another: two of them swapped at a resume would carry on
        # from each other's average in silence (docs/custom_wrappers_and_handlers.md, rule 4).
        return {"factor": self.factor, "decay": self.decay, "warmup": self.warmup}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the average after a resume, and its settings."""
        return {"average": self._average, "first": self._first, "seen": self._seen, **self._built()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ConfigError``: another stopper's)."""
        same_handler("LossSpikeStop", self._built(), state)
        self._average, self._first, self._seen = state["average"], state["first"], state["seen"]


def main() -> dict[str, Any]:
    """Train on data whose 25th batch is corrupted (inputs x100): the run stops at update 30."""
    torch.manual_seed(0)
    x = torch.randn(64 * 16, 4)
    y = x @ torch.randn(4, 1)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    batches[24] = (batches[24][0] * 100, batches[24][1])  # a corrupted batch

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)

    model = nn.Linear(4, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    spikes = LossSpikeStop(factor=3.0, check_every=10)
    events = spikes.attach(Events())
    state = run(make_train_step(loss_fn), state, batches, events=events)
    print(f"stopped after update {state.step}; spike at update {spikes.spike_step}")
    return {"step": state.step, "spike_step": spikes.spike_step}


if __name__ == "__main__":
    main()

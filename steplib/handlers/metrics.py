"""Training metrics kept on the device: running means of the loss and the aux tensors.

A step's outputs are tensors where they were computed; reading one is a host sync. So
:class:`TrainMetrics` only adds them up as tensors on every update, and reads them (one host
transfer) when a logger asks, every N updates::

    train = TrainMetrics()
    train.attach(events)                              # device adds on every step_end
    events.on("step_end", Log(jsonl, sources=[train.read]), every=50)

The loss mean is token-weighted (sum of loss sums / sum of targets over the interval), the
same normalisation the step uses, and leaves out updates that were skipped as non-finite. An
aux value is averaged over the updates that reported it and were not skipped. With a process
group, the aux sums are all-reduced at read time (the loss and target counts of a step are
already global).

For evaluation metrics use torchmetrics (:func:`steplib.handlers.evaluate`).

Imports ``events`` only (handlers never import ``loop`` or ``step``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from steplib.events import Event, Handler

# Names a record already uses; an aux value with one of these names is written as "aux.<name>".
_RESERVED = ("loss", "num_targets", "updates", "skipped", "lr", "step", "epoch", "micro_step")


class TrainMetrics(Handler):
    """Running means of the training loss and aux tensors, summed on the device.

    Args:
        aux: which aux names to average (``None``: all that the loss function returns).
            A non-scalar aux tensor is averaged over its elements first.

    Example:
        >>> import torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: (m(b).pow(2).sum(), 4, {"n": torch.tensor(2.0)}))
        >>> train = TrainMetrics()
        >>> state = run(step, state, [torch.zeros(4, 2)] * 3, events=train.attach(Events()))
        >>> values = train.read(None)
        >>> sorted(values), values["updates"], values["num_targets"], values["n"]
        (['loss', 'lr', 'n', 'num_targets', 'updates'], 3, 12, 2.0)
    """

    def __init__(self, *, aux: list[str] | tuple[str, ...] | None = None) -> None:
        self.aux = None if aux is None else tuple(aux)
        self._last: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget the sums (a read resets them too)."""
        self._loss: torch.Tensor | None = None  # sum of loss * targets, non-skipped updates
        self._targets: torch.Tensor | None = None  # sum of targets, non-skipped updates
        self._skipped: torch.Tensor | None = None  # skipped updates
        # name -> (sum, count) over the updates not skipped; both on the device.
        self._aux: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lr: torch.Tensor | None = None
        self._updates = 0

    def on_step_end(self, event: Event) -> None:
        """:meth:`update` on every update."""
        self.update(event)

    def update(self, event: Event) -> None:
        """Add one update's loss, targets and aux values (device ops only, no host read)."""
        out = event.output
        if out is None or out is self._last:  # read() may already have added this one
            return
        self._last = out
        loss = out.loss.detach().float()
        targets = out.num_targets.to(loss.device, torch.float32)
        skipped = out.skipped.to(loss.device)
        # A window counts once, on the call that closes it (its loss is the window's): in a run
        # of several steps the last step's window may still be open at the counted step's
        # update, and that call reports one micro-batch, which its window's loss counts again.
        left_out = skipped | ~out.did_update.to(loss.device)  # skipped, or no window closed
        # where(), not a product: a skipped update's loss may be NaN, and NaN * 0 is NaN.
        weighted = torch.where(left_out, 0.0, loss * targets)
        targets = torch.where(left_out, 0.0, targets)
        if self._loss is None or self._targets is None or self._skipped is None:
            self._loss, self._targets, self._skipped = weighted, targets, skipped.float()
        else:
            self._loss = self._loss + weighted
            self._targets = self._targets + targets
            self._skipped = self._skipped + skipped
        # A skipped update trained nothing: its aux values (often NaN) are left out, as its
        # loss is; where(), not a product (NaN * 0 is NaN).
        dropped = skipped.any()
        for name, value in out.aux.items():
            if self.aux is not None and name not in self.aux:
                continue
            value = torch.where(dropped, 0.0, value.detach().float().mean().to(loss.device))
            kept = (~dropped).float()
            if name in self._aux:
                total, count = self._aux[name]
                value, kept = total + value, count + kept
            self._aux[name] = (value, kept)
        self._lr = out.lr
        self._updates += 1

    def state_dict(self) -> dict[str, Any]:
        """The sums of the interval not yet read. Attached to a run, they are saved with each
        checkpoint and restored on resume (``checkpoint.contents``), so that the first record
        after a resume covers the same updates as without the interruption.

        Example:
            >>> TrainMetrics().state_dict()["updates"]
            0
        """
        return {
            "loss": self._loss,
            "targets": self._targets,
            "skipped": self._skipped,
            "aux": {name: [total, count] for name, (total, count) in self._aux.items()},
            "lr": self._lr,
            "updates": self._updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the sums stay where they were loaded:
        :meth:`read` brings them to the device of the latest update)."""
        self._loss, self._targets = state["loss"], state["targets"]
        self._skipped, self._lr = state["skipped"], state["lr"]
        self._aux = {
            # An int in older checkpoints.
            name: (total, torch.as_tensor(count, dtype=torch.float32))
            for name, (total, count) in state["aux"].items()
        }
        self._updates = int(state["updates"])

    def read(self, event: Event | None) -> dict[str, Any]:
        """The means since the last read, then reset: one host transfer (and, with a process
        group, one all-reduce of the aux sums, so every rank must call it).

        Args:
            event: the event being logged; its output is added first if :meth:`update` has not
                seen it (so the order of registration does not matter). ``None`` reads as is.

        Returns:
            ``loss`` (token-weighted mean over the non-skipped updates; NaN if all were
            skipped), ``num_targets`` (sum), ``updates``, ``skipped`` (when any), ``lr`` (of the
            latest update), and the mean of each aux value. Empty when nothing was added.
        """
        if event is not None:
            self.update(event)
        if self._loss is None or self._targets is None or self._skipped is None:
            return {}
        names = list(self._aux)
        aux = [self._aux[name][0] for name in names] + [self._aux[name][1] for name in names]
        device = self._loss.device
        # A resumed interval's sums may sit on the CPU (as loaded) and the new ones on the GPU.
        sums = torch.stack([t.to(device) for t in (self._loss, self._targets, self._skipped, *aux)])
        if names and dist.is_available() and dist.is_initialized():
            # Aux values and their counts are per rank; the loss and targets a step reports are
            # already summed over ranks, so they are not reduced again.
            local = sums[3:].clone()
            dist.all_reduce(local)
            sums = torch.cat([sums[:3], local])
        values = sums.tolist()  # the one host read of the interval
        lr = self._lr.item() if self._lr is not None else None
        loss_sum, targets, skipped = values[:3]
        record: dict[str, Any] = {
            "loss": loss_sum / targets if targets > 0 else float("nan"),
            "num_targets": int(targets) if float(targets).is_integer() else targets,
            "updates": self._updates,
            "lr": lr,
        }
        if skipped:
            record["skipped"] = int(skipped)
        totals, counts = values[3 : 3 + len(names)], values[3 + len(names) :]
        for name, total, count in zip(names, totals, counts, strict=True):
            mean = total / count if count > 0 else float("nan")  # NaN: every update skipped
            record[f"aux.{name}" if name in _RESERVED else name] = mean
        self.reset()
        return record

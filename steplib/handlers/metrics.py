"""Training metrics kept on the device: running means of the loss and the aux tensors.

A step's outputs are tensors where they were computed; reading one is a host sync. So
:class:`TrainMetrics` only adds them up as tensors on every update, and reads them (one host
transfer) when a logger asks, every N updates::

    train = TrainMetrics()
    train.attach(events)                              # device adds on every step_end
    events.on("step_end", Log(jsonl, sources=[train.read]), every=50)

The loss mean is token-weighted (sum of loss sums / sum of targets over the interval), the
same normalisation the step uses, and leaves out updates that were skipped as non-finite. An
aux value is averaged over the micro-batches of the windows that closed in the interval and
were not skipped (with accumulation, every micro-batch of a window, not its last alone). With
a process group, the aux sums are all-reduced at read time (the loss and target counts of a
step are already global).

In a run of several steps (``run({"D": d_step, "G": g_step}, ...)``) each step's numbers are
its own, over the windows it closed, under its name as the logs write them: ``D/loss``,
``G/loss``, ``G/num_targets``, ``D/lr``, ``D/<aux>``; ``updates`` counts the run's (its first
optimizer's).

For evaluation metrics use torchmetrics (:func:`steplib.handlers.evaluate`).

Imports ``events``, ``errors``, ``distributed`` and ``output`` only (handlers never import
``loop`` or ``step``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from steplib import errors
from steplib.distributed import rank, world_size
from steplib.events import Event, Handler
from steplib.output import Unread, closed_window, window_sums

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
        self._unread = Unread()
        # Per step, the aux sums of its open window (name -> (sum, micro-batches)): added to
        # the interval's when the window closes, so they outlive a read.
        self._open: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the sums (a read resets them too)."""
        # Per step ("" for a run of one step): the sum of loss * targets and of targets over
        # the windows closed and not skipped, and the skipped updates; all on the device.
        self._sums: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Per step, aux name -> (sum, count) over the micro-batches of those windows.
        self._aux: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lr: dict[str, torch.Tensor] = {}
        self._updates = 0

    def on_micro_step_end(self, event: Event) -> None:
        """:meth:`update` on every micro-batch (each step's aux, and windows that close)."""
        self.update(event)

    def on_step_end(self, event: Event) -> None:
        """:meth:`update` on every update."""
        self.update(event)

    def update(self, event: Event) -> None:
        """Add the event's outputs: a window's loss and targets once, on the call that closes
        it; each micro-batch's aux values (device ops only, no host read). A ``step_end``
        counts one update."""
        if event.output is None:
            return
        for name, out in self._unread.outputs(event):
            self._add(name, out)
        for name, out in (event.outputs or {"": event.output}).items():
            self._lr[name] = out.lr  # the rate as of this event: that update's, given again
        if self._unread.counts(event):
            self._updates += 1

    def _add(self, name: str, out: Any) -> None:
        sums = window_sums(out)
        device = sums[0].device
        skipped = out.skipped.to(device)
        before = self._sums.get(name)
        if before is None:
            self._sums[name] = (*sums, skipped.float())
        else:
            self._sums[name] = (before[0] + sums[0], before[1] + sums[1], before[2] + skipped)
        # Each micro-batch's aux goes into its window's sums; when the window closes they are
        # added to the interval's, unless it was skipped (its aux values are often NaN). A
        # flush reports no aux: it closes what the window's micro-batches added.
        # A sweep's outputs hold one value per copy ([N]): each copy's aux is averaged over
        # its own elements and kept unless that copy's update was skipped, as its own run's.
        copies = tuple(out.loss.shape)
        closes = closed_window(out).to(device).any()
        kept = closes & out.did_update.to(device)  # not skipped, nor a sweep's stopped copy
        window, totals = self._open.setdefault(name, {}), self._aux.setdefault(name, {})
        values = {k: v for k, v in out.aux.items() if self.aux is None or k in self.aux}
        for key in dict.fromkeys([*window, *values]):
            total, count = window.get(key, (torch.zeros((), device=device),) * 2)
            if key in values:
                value = values[key].detach().float().reshape(*copies, -1).mean(-1)
                total = total + value.to(device)
                count = count + 1
            done, seen = totals.get(key, (torch.zeros((), device=device),) * 2)
            totals[key] = (done + torch.where(kept, total, 0.0), seen + torch.where(kept, count, 0))
            window[key] = (torch.where(closes, 0.0, total), torch.where(closes, 0, count))

    def state_dict(self) -> dict[str, Any]:
        """The sums of the interval not yet read, and the aux sums of each open window.
        Attached to a run, they are saved with each checkpoint and restored on resume
        (``checkpoint.contents``), so that the first record after a resume covers the same
        updates as without the interruption.

        Example:
            >>> TrainMetrics().state_dict()["updates"]
            0
        """
        return {
            "steps": {
                name: {
                    "sums": list(sums),
                    "aux": {k: list(v) for k, v in self._aux.get(name, {}).items()},
                    "lr": self._lr.get(name),
                }
                for name, sums in self._sums.items()
            },
            "open": {name: {k: list(v) for k, v in w.items()} for name, w in self._open.items()},
            "updates": self._updates,
            # Resumed on another number of ranks, every rank loads rank 0's state: the aux sums
            # of every rank (one all-reduce, as a read makes) carry the whole interval there.
            "world_size": world_size(),
            "aux_over_ranks": _over_ranks(self._aux),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the sums stay where they were loaded:
        :meth:`read` brings them to the device of the latest update)."""
        self.reset()
        if "steps" not in state:  # an older checkpoint: one step's sums, no open window
            state = _older(state)
        for name, saved in state["steps"].items():
            loss, targets, skipped = saved["sums"]
            self._sums[name] = (loss, targets, skipped)
            self._aux[name] = {k: _pair(v) for k, v in saved["aux"].items()}
            if saved["lr"] is not None:
                self._lr[name] = saved["lr"]
        self._open = {
            name: {k: _pair(v) for k, v in w.items()} for name, w in state["open"].items()
        }
        self._updates = int(state["updates"])
        over_ranks = state.get("aux_over_ranks")  # absent from an older checkpoint
        if over_ranks is not None and state["world_size"] != world_size():
            self._aux = _resharded(over_ranks, saved=state["world_size"])

    def read(self, event: Event | None) -> dict[str, Any]:
        """The means since the last read, then reset: one host transfer (and, with a process
        group, one all-reduce of the aux sums, so every rank must call it).

        Args:
            event: the event being logged; its outputs are added first if :meth:`update` has
                not seen them (so the order of registration does not matter). ``None`` reads
                as is.

        Returns:
            ``loss`` (token-weighted mean over the non-skipped updates; NaN if all were
            skipped), ``num_targets`` (sum), ``updates``, ``skipped`` (when any), ``lr`` (of the
            latest update), and the mean of each aux value. In a run of several steps each
            step's under its name (``D/loss``, ``G/lr``, ...), ``updates`` the run's. Empty
            when nothing was added.
        """
        if event is not None:
            errors.reader_attached("TrainMetrics", self, event, "train")
            self.update(event)
        if not self._sums:
            return {}
        names = list(self._sums)
        keys = [(name, key) for name in names for key in self._aux.get(name, {})]
        aux = [self._aux[n][k][i] for i in (0, 1) for n, k in keys]
        device = self._sums[names[-1]][0].device
        # A resumed interval's sums may sit on the CPU (as loaded) and the new ones on the GPU.
        # Each is one number, or a sweep's one per copy: flattened into one read, split back.
        parts = [t.to(device).float() for name in names for t in self._sums[name]]
        extra = [t.to(device).float() for t in aux]
        shapes = [t.shape for t in (*parts, *extra)]
        sums = torch.cat([t.reshape(-1) for t in (*parts, *extra)])
        if keys and dist.is_available() and dist.is_initialized():
            # Aux values and their counts are per rank; the loss and targets a step reports are
            # already summed over ranks, so they are not reduced again.
            first = sum(t.numel() for t in parts)
            local = sums[first:].clone()
            dist.all_reduce(local)
            sums = torch.cat([sums[:first], local])
        flat = iter(sums.tolist())  # the one host read of the interval
        values = [_unflat(flat, shape) for shape in shapes]
        record: dict[str, Any] = {"updates": self._updates}
        for i, name in enumerate(names):
            prefix = f"{name}/" if name else ""
            loss_sum, targets, skipped = values[3 * i : 3 * i + 3]
            lr = self._lr.get(name)
            record[prefix + "loss"] = _each(_mean, loss_sum, targets)
            record[prefix + "num_targets"] = _each(_count, targets)
            record[prefix + "lr"] = None if lr is None else lr.tolist()
            if any(skipped) if isinstance(skipped, list) else skipped:
                record[prefix + "skipped"] = _each(int, skipped)
        totals, counts = (
            values[len(parts) : len(parts) + len(keys)],
            values[len(parts) + len(keys) :],
        )
        for (name, key), total, count in zip(keys, totals, counts, strict=True):
            prefix = f"{name}/" if name else ""
            mean = _each(_mean, total, count)  # NaN: every window skipped
            record[prefix + (f"aux.{key}" if key in _RESERVED else key)] = mean
        self.reset()
        return record


def _over_ranks(
    aux: Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
) -> dict[str, dict[str, list[torch.Tensor]]] | None:
    """The aux sums and counts summed over the ranks (one all-reduce: every rank saves a
    sharded state together); ``None`` in one process or without aux values."""
    keys = [(name, key) for name, sums in aux.items() for key in sums]
    if not keys or world_size() == 1:
        return None
    tensors = [t for name, key in keys for t in aux[name][key]]
    device = tensors[0].device
    flat = torch.cat([t.to(device).float().reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    parts = iter(flat.split([t.numel() for t in tensors]))
    summed: dict[str, dict[str, list[torch.Tensor]]] = {}
    for name, key in keys:
        total, count = aux[name][key]
        summed.setdefault(name, {})[key] = [
            next(parts).reshape(total.shape),
            next(parts).reshape(count.shape),
        ]
    return summed


def _resharded(
    over_ranks: Mapping[str, Mapping[str, Any]], *, saved: int
) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The interval's aux sums saved by ``saved`` ranks, as this rank holds them on this world
    size: on rank 0 all of them, on the others none, so that the next read's all-reduce counts
    each once. Each rank added one mean per micro-batch of its share: the sums and counts are
    scaled to as many ranks as there are now, so that a micro-step before the save weighs what
    one after it does (exact when the ranks' shares are even, as in the uninterrupted run)."""
    scale = world_size() / saved if rank() == 0 else 0.0
    resharded: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, sums in over_ranks.items():
        pairs = {key: _pair(pair) for key, pair in sums.items()}
        resharded[name] = {key: (t * scale, c * scale) for key, (t, c) in pairs.items()}
    return resharded


def _unflat(values: Any, shape: torch.Size) -> Any:
    """The next number of ``values`` for a 0-dim sum, the next N (a list) for a sweep's."""
    return next(values) if not shape else [next(values) for _ in range(shape.numel())]


def _each(fn: Any, *values: Any) -> Any:
    """``fn`` of one number each, or of each copy's numbers (a list) for a sweep."""
    if isinstance(values[0], list):
        return [fn(*one) for one in zip(*values, strict=True)]
    return fn(*values)


def _mean(total: float, count: float) -> float:
    return total / count if count > 0 else float("nan")


def _count(targets: float) -> int | float:
    return int(targets) if float(targets).is_integer() else targets


def _pair(saved: Any) -> tuple[torch.Tensor, torch.Tensor]:
    total, count = saved
    return total, torch.as_tensor(count, dtype=torch.float32)  # an int in older checkpoints


def _older(state: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint written before the sums were kept per step: one step's (or none)."""
    steps = {}
    if state["loss"] is not None:
        steps[""] = {
            "sums": [state["loss"], state["targets"], state["skipped"]],
            "aux": state["aux"],
            "lr": state["lr"],
        }
    return {"steps": steps, "open": {}, "updates": state["updates"]}

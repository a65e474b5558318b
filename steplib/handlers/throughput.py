"""Throughput: updates/s, samples/s, tokens/s (batches/s for a mean loss), FLOP/s and MFU.

FLOPs are counted once, before training, with ``torch.utils.flop_counter.FlopCounterMode``:
:func:`flops_per_batch` runs one forward and backward of the loss function on the *meta* device
(no memory, no compute, no RNG draw, no change to the model), and :func:`count_flops` counts any
function you give it. MFU (model FLOPs utilisation) is the achieved FLOP/s over a peak FLOP/s
that *you* give: steplib does not guess hardware peaks (they depend on the dtype, sparsity,
clocks and the exact SKU). Look yours up in the vendor's data sheet, e.g. dense bf16 tensor-core
peak of one GPU.

:class:`Throughput` adds the tokens of each window on the device and reads them once per log
interval, so it costs no host sync per step::

    flops = flops_per_batch(model, batch, loss_fn=loss_fn) * accumulation
    speed = Throughput(samples_per_step=batch_size * accumulation, flops_per_step=flops,
                       peak_flops=989e12)
    speed.attach(events)
    events.on("step_end", Log(jsonl, sources=[train.read, speed.read]), every=50)

Imports ``events``, ``errors``, ``distributed``, ``output`` and ``handlers.step_plan`` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from steplib import errors
from steplib.distributed import is_parallel_model, world_size
from steplib.distributed.parallelize import holds_dtensor_parameters
from steplib.errors import ConfigError, describe
from steplib.events import Event, Events, Handler
from steplib.handlers.step_plan import full_window, loss_batches
from steplib.output import Unread, closed_window


def count_flops(fn: Callable[[], Any]) -> int:
    """The FLOPs of the matrix multiplications and convolutions run by ``fn()`` (torch's
    ``FlopCounterMode``: elementwise operations are not counted, as in the MFU literature).

    ``fn`` runs for real: a training step there changes the model. Prefer
    :func:`flops_per_batch`, which counts on the meta device.

    Args:
        fn: a function of no arguments, run once under the counter (close over what it
            needs, e.g. ``lambda: model(batch)``); its return value is discarded.

    Returns:
        The FLOP count (a multiply-add counts 2), summed over every counted operation
        ``fn`` ran, forward and backward alike.

    Example:
        >>> a, b = torch.ones(8, 16), torch.ones(16, 4)
        >>> count_flops(lambda: a @ b)  # 2 * 8 * 16 * 4
        1024
        >>> count_flops(lambda: a + 1)  # elementwise: not counted
        0
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap its parameters."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)


def flops_per_batch(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], Any],
    backward: bool = True,
) -> int:
    """The FLOPs of one forward (and backward) of ``loss_fn(model, batch)`` on one micro-batch.

    Counted on the meta device: parameters, buffers and the batch's tensors are replaced by
    meta tensors of the same shapes, so nothing is computed, allocated, drawn from the RNG or
    changed in ``model``. Multiply by the micro-batches per update (``accumulate``) to get the
    FLOPs of one update of one process.

    Args:
        model: the model (in the mode it trains in).
        batch: one micro-batch as ``loss_fn`` takes it (tensors in tuples, lists, dicts).
        loss_fn: the training loss function; its first returned value (or itself) is the loss.
        backward: count the backward pass too.

    Returns:
        The FLOP count.

    Raises:
        ConfigError: ``loss_fn`` cannot run on meta tensors (e.g. it calls ``.item()``); the
            message says how to count on real tensors instead. A model with DTensor parameters
            (FSDP2, tensor parallel): count the model before it is sharded.

    Example:
        >>> model = torch.nn.Linear(16, 4)
        >>> def loss_fn(model, batch):
        ...     return model(batch).pow(2).mean()
        >>> flops_per_batch(model, torch.ones(8, 16), loss_fn=loss_fn)   # 2*8*16*4 * (1 + 1)
        2048
    """
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ConfigError(
            f"flops_per_batch received model={describe(model)}, loss_fn={describe(loss_fn)}; "
            "pass the nn.Module and the loss_fn(model, batch) you train with."
        )
    if holds_dtensor_parameters(model):
        raise ConfigError(
            "flops_per_batch received a model with DTensor parameters (FSDP2, tensor "
            "parallel), which cannot run on the meta device; and under tensor parallelism the "
            "counter counts each operation at its global shape, where a rank computes a share: "
            "Throughput's mfu would be overstated by about the degree. Count the model before "
            "apply_fsdp / apply_tp; under tensor parallelism divide by the degree: "
            "flops_per_batch(plain_model, batch, loss_fn=loss_fn) * accumulation / tp_size."
        )
    wrapper = _LossModule(model, loss_fn)
    tensors = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in wrapper.named_parameters()
    }
    tensors.update(
        {name: torch.empty_like(t, device="meta") for name, t in wrapper.named_buffers()}
    )
    try:
        with FlopCounterMode(display=False) as counter:
            out = functional_call(wrapper, tensors, (_to_meta(batch),))
            loss = out[0] if isinstance(out, tuple | list) else out
            if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    except Exception as error:
        raise ConfigError(
            f"flops_per_batch could not run loss_fn on the meta device: {error!r}. A loss_fn "
            "that reads values (.item(), a data-dependent shape) cannot; count on real tensors "
            "instead, on a copy of the model: count_flops(lambda: loss_fn(copy, batch)[0]"
            ".backward())."
        ) from error
    return int(counter.get_total_flops())


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple | list):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


class Throughput(Handler):
    """A log source of the speed since its last read.

    Args:
        samples_per_step: samples per optimizer update (e.g. ``batch_size * accumulation``,
            times the world size for a global rate), for ``samples_per_s``. A shorter window
            (an epoch's last, closed early) counts its share: per micro-batch, this over the
            step's ``accumulate`` k.
        tokens: ``tokens(output) -> count`` of one micro-batch, given each micro-batch's
            output (its ``aux`` is that micro-batch's; a tensor stays on the device) and
            summed, over the data-parallel ranks too (a DDP or FSDP2 model's) at each read;
            the default counts each window's ``num_targets`` (summed over those ranks by the
            step) on the call that closes it. Either way the rate is the global one. In a run
            of several steps, each step's count is its own
            (``D/tokens_per_s``, ``G/tokens_per_s``).
        unit: what one of those counts, to name the rate ``<unit>_per_s``; ``None``:
            ``tokens``, or ``batches`` when the default count gives one per micro-batch (a
            plain mean loss, whose ``num_targets`` counts micro-batches, not tokens; a
            pipeline step's are its ``n_microbatches`` per batch).
        flops_per_step: FLOPs of one update of one process (see :func:`flops_per_batch`), for
            ``flops_per_s``; a shorter window counts its share, as for ``samples_per_step``.
        peak_flops: the peak FLOP/s of one device, for ``mfu`` (needs ``flops_per_step``).
        clock: the time source (``time.perf_counter``); tests pass a fake one.

    Raises:
        ConfigError: a count that is not a positive number, ``tokens`` not callable,
            ``peak_flops`` without ``flops_per_step``.

    Example:
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: (m(b).pow(2).sum(), 4))
        >>> speed = Throughput(samples_per_step=4, flops_per_step=100, peak_flops=1e3)
        >>> state = run(step, state, [torch.ones(4, 2)] * 3, events=speed.attach(Events()))
        >>> sorted(speed.read(None))
        ['flops_per_s', 'mfu', 'samples_per_s', 'steps_per_s', 'tokens_per_s']
    """

    def __init__(
        self,
        *,
        samples_per_step: int | None = None,
        tokens: Callable[[Any], Any] | None = None,
        unit: str | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        errors.optional_positive_int("Throughput", "samples_per_step", samples_per_step)
        for label, value in (("flops_per_step", flops_per_step), ("peak_flops", peak_flops)):
            if value is not None and not errors.non_negative("Throughput", label, value) > 0:
                raise ConfigError(f"Throughput({label}=0) must be > 0 (or None).")
        if tokens is not None and not callable(tokens):
            raise ConfigError(
                f"Throughput(tokens=...) received {describe(tokens)}; pass a function of the "
                "StepOutput, e.g. tokens=lambda out: out.aux['tokens'], or None for num_targets."
            )
        if unit is not None and (not isinstance(unit, str) or not unit):
            raise ConfigError(
                f"Throughput(unit=...) received {describe(unit)}; pass what one count is, e.g. "
                "unit='tokens', or None to name it from the counts."
            )
        if peak_flops is not None and flops_per_step is None:
            raise ConfigError(
                "Throughput(peak_flops=...) needs flops_per_step to compute MFU. Count it: "
                "flops_per_step=flops_per_batch(model, batch, loss_fn=loss_fn) * accumulation."
            )
        self.samples_per_step = samples_per_step
        self.tokens = tokens if tokens is not None else _num_targets
        self.unit = unit or ("tokens" if tokens is not None else None)
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self._clock = clock
        self.stats: dict[str, float] = {}
        self._by_batch = tokens is not None  # a count per micro-batch, else per window
        # read() counts the event's own outputs if update() has not, so the order of
        # registration does not matter, and nothing is counted twice.
        self._unread = Unread()
        self._batched = False  # whether micro_step_end events reach it (attached to a run)
        self._micro_step: int | None = None
        self._device: torch.device | None = None
        self._data_parallel: bool | None = None  # the ranks share the data out (DDP, FSDP2)
        self._window: int | None = None  # micro-batches of a full window (None: not known)
        self._loss_batches = 1  # the micro-batches a step call's mean loss counts
        self._start()

    def _start(self) -> None:
        self._since = self._clock()
        self._steps = 0
        self._micro_steps = 0
        self._tokens: dict[str, Any] = {}  # per step ("" for a run of one step)

    def on_attach(self, events: Events) -> None:
        """Start the clock again after every other ``fit_start`` handler (:meth:`on_fit_start`
        starts the count)."""
        # A sanity evaluation (and a resume_from registered by hand, not first) run at
        # fit_start and train nothing: in the first interval they made each run's first rate
        # read low (60 s of them before 2 updates of 1 s: 0.03 updates/s for 1.0).
        events.on("fit_start", self._start_clock, last=True)

    def _start_clock(self, event: Event) -> None:
        self._since = self._clock()

    def on_fit_start(self, event: Event) -> None:
        """Start the count (and the clock, started again when the run's ``fit_start`` has run)."""
        # Where the micro-batches start is taken from the first update: a resume_from
        # attached after this handler swaps in the resumed state after this call.
        self._micro_step = None
        self._data_parallel = None
        self._window = full_window(event)
        self._loss_batches = loss_batches(event)
        self._start()

    def on_micro_step_end(self, event: Event) -> None:
        """Add this micro-batch's tokens (of each step) and the windows it closed."""
        self._batched = True
        self._add(event)

    def on_step_end(self, event: Event) -> None:
        """:meth:`update` on every update."""
        self.update(event)

    def update(self, event: Event) -> None:
        """Add the event's tokens (a device add, no host read); a ``step_end`` counts one
        update."""
        out = event.output
        if out is None:
            return
        self._add(event)
        if not self._unread.counts(event):
            return
        if self._micro_step is None:  # the first update covers event.batches micro-batches
            self._micro_step = event.micro_step - event.batches
        self._micro_steps += event.micro_step - self._micro_step
        self._micro_step = event.micro_step
        self._steps += 1

    def _add(self, event: Event) -> None:
        for name, out in self._unread.outputs(event):
            if self._by_batch:
                # A flush's output (seen at a micro_step_end marked flushed, or first at
                # step_end, in a run): no micro-batch ran, no tokens to count.
                if getattr(event, "flushed", False) or (event.name == "step_end" and self._batched):
                    continue
                count = self.tokens(out)
            else:  # a window's targets, on the call that closes it
                closed = closed_window(out).any()
                count = torch.where(closed, out.num_targets, 0)
            self._tokens[name] = self._tokens.get(name, 0) + count
            self._device = out.loss.device  # where the counts are summed (NCCL: the GPU)
        if self._data_parallel is None:
            model = getattr(event.state, "model", None)
            modules = model.modules() if isinstance(model, nn.Module) else ()
            self._data_parallel = world_size() > 1 and any(map(is_parallel_model, modules))

    def read(self, event: Event | None) -> dict[str, float]:
        """The rates since the last read (one host read of the token sum); restarts the clock.
        With ``tokens=`` and a DDP or FSDP2 model, one all-reduce of the counts: every rank
        must call it (a ``Log``'s sources are called on every rank).

        Returns:
            ``steps_per_s``, ``tokens_per_s`` (named by ``unit``: ``batches_per_s`` for a
            plain mean loss) and, when configured, ``samples_per_s``,
            ``flops_per_s`` and ``mfu`` (a fraction of ``peak_flops``). Empty before any update.
        """
        if event is not None:
            errors.reader_attached("Throughput", self, event, "speed")
            self.update(event)
        if self._steps == 0:
            return {}
        names = list(self._tokens)
        counts = [torch.as_tensor(self._tokens[n], device=self._device).double() for n in names]
        summed = torch.stack(counts) if counts else torch.zeros(0, device=self._device)
        if self._by_batch and self._data_parallel:
            # A tokens= count is of this rank's share of the batch (the default, each window's
            # num_targets, is summed over the ranks by ddp_wrap / fsdp_wrap already): the rate
            # is global. Ranks that all see the batch (tensor, pipeline parallel) share nothing.
            dist.all_reduce(summed)
        totals = summed.tolist()  # the one host read
        # Timed after the read: on a GPU the interval then covers work that has finished.
        elapsed = max(self._clock() - self._since, 1e-9)
        steps_per_s = self._steps / elapsed
        # A mean loss counts one target per micro-batch (a pipeline step's n_microbatches per
        # call), summed over the ranks that share the data out (DDP, FSDP2); ranks that each
        # see the whole batch (tensor, pipeline parallel) count each batch once.
        ranks = world_size() if self._data_parallel else 1
        batches = self._micro_steps * self._loss_batches * ranks
        # The per-update constants count what ran: a shorter window is part of an update.
        updates = self._steps if self._window is None else self._micro_steps / self._window
        stats = {"steps_per_s": steps_per_s}
        for name, tokens in zip(names, totals, strict=True):
            unit = self.unit or ("batches" if tokens == batches else "tokens")
            stats[f"{name}/{unit}_per_s" if name else f"{unit}_per_s"] = tokens / elapsed
        if self.samples_per_step is not None:
            stats["samples_per_s"] = self.samples_per_step * updates / elapsed
        if self.flops_per_step is not None:
            stats["flops_per_s"] = self.flops_per_step * updates / elapsed
            if self.peak_flops is not None:
                stats["mfu"] = stats["flops_per_s"] / self.peak_flops
        self._start()
        self.stats = stats
        return stats


def _num_targets(out: Any) -> Any:
    return out.num_targets

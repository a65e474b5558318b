"""``StepOutput``: what one call of a step reports, as tensors left where they were computed.
Imports nothing from steplib."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 when its dtype is narrower (bf16, fp16), else as it is (float64
    stays float64): the dtype of a loss that steplib reports or accumulates.

    Example:
        >>> at_least_float32(torch.ones((), dtype=torch.bfloat16)).dtype
        torch.float32
        >>> at_least_float32(torch.ones((), dtype=torch.float64)).dtype
        torch.float64
    """
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def closed_window(out: Any) -> torch.Tensor:
    """Whether the call that reported ``out`` closed its window, updating or skipping the update:
    the call whose ``loss`` and ``num_targets`` are the window's (a device bool, no host read)."""
    return out.did_update | out.skipped


def update_outputs(event: Any) -> dict[str, Any]:
    """The outputs of ``event`` that report an update, by step name (``""`` for one step).

    At a ``step_end`` of a run of several steps, each step's whose call closed its window
    (updating or skipping): another step's window may still be open there (D accumulating 2
    batches, G counted and updating on each), and its call then reported one micro-batch,
    whose loss and targets are no update's. At other events, the event's outputs as they are
    (``{}`` when it has none). Reads one bool per step at such a ``step_end`` (a host sync):
    for a log or a save, which read the values anyway.

    Example:
        >>> from types import SimpleNamespace as Out
        >>> closed = Out(did_update=torch.tensor(True), skipped=torch.tensor(False))
        >>> open_ = Out(did_update=torch.tensor(False), skipped=torch.tensor(False))
        >>> event = Out(name="step_end", output=closed, outputs={"D": open_, "G": closed})
        >>> list(update_outputs(event))
        ['G']
    """
    outputs = getattr(event, "outputs", None)
    if outputs is None:
        output = getattr(event, "output", None)
        return {} if output is None else {"": output}
    if getattr(event, "name", None) != "step_end":
        return dict(outputs)
    return {name: out for name, out in outputs.items() if bool(closed_window(out).any())}


class Unread:
    """Which outputs of an event a reader of a run has not added yet, and whether the event is
    an update it has not counted: one rule for every reader. A reader sees an output at its
    ``micro_step_end`` and again at ``step_end``; a ``Log``'s read at ``fit_end`` (a run
    stopped inside a window) sees the last update's event again, after later micro-batches,
    and after another step's windows; a ``read`` may add the event's outputs before
    ``update`` does. Outputs are told apart by identity, per step (``""`` for one step).

    Example:
        >>> from types import SimpleNamespace as Event
        >>> unread, out = Unread(), object()
        >>> event = Event(name="step_end", output=out, outputs=None)
        >>> unread.outputs(event), unread.counts(event), unread.outputs(event)
        ([('', <object object at ...>)], True, [])
    """

    def __init__(self) -> None:
        self._seen: dict[str, Any] = {}  # per step, the last output added
        self._updated: Mapping[str, Any] = {}  # per step, the outputs of the last update
        self._counted: Any = None  # the output of the last update counted

    def outputs(self, event: Any) -> list[tuple[str, Any]]:
        """The event's outputs not added yet, by step name; from now on added. Call it before
        :meth:`counts` at one event."""
        if event.output is None:
            return []
        found = (event.outputs or {"": event.output}).items()
        new = [
            (n, o) for n, o in found if o is not self._seen.get(n) and o is not self._updated.get(n)
        ]
        self._seen.update(new)
        return new

    def counts(self, event: Any) -> bool:
        """Whether ``event`` is a ``step_end`` not counted yet; from now on counted."""
        if event.name != "step_end" or event.output is None or event.output is self._counted:
            return False
        self._counted, self._updated = event.output, event.outputs or {"": event.output}
        return True


def window_sums(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What the window that this call applied adds to a token-weighted mean loss: its loss times
    its targets, and its targets (float32 at least, on the loss's device); zeros where the call
    closed no window or skipped the update (a skipped loss is often NaN, and ``NaN * 0`` is
    NaN: ``where()``, not a product). A window counts once, on the call that closes it: a call
    inside an open window reports one micro-batch, which the window's loss counts again.

    Example:
        >>> from types import SimpleNamespace as Out
        >>> out = Out(loss=torch.tensor(0.5), num_targets=torch.tensor(4.0),
        ...           did_update=torch.tensor(True), skipped=torch.tensor(False))
        >>> [float(t) for t in window_sums(out)]
        [2.0, 4.0]
    """
    loss = out.loss.detach().float()
    applied = out.did_update.to(loss.device) & ~out.skipped.to(loss.device)
    targets = out.num_targets.detach().float().to(loss.device)
    kept = torch.where(applied.expand_as(loss), targets, 0.0)
    return torch.where(kept > 0, loss * kept, 0.0), kept


class StepOutput:
    """What one call of a step reports. Every value is a tensor left where it was computed:
    reading one (``.item()``, ``float()``) is a host sync, so do it in a handler, not per step.

    The tensors are made when first read, from values the step already holds, so a step whose
    outputs are read every 100 updates does not pay for building them on the other 99.

    Attributes:
        loss: the normalised loss. On the call that closes a window it is the window's
            loss (sum of loss sums / sum of targets), i.e. the loss that the applied gradient is
            the gradient of; on other calls it is that micro-batch's own normalised loss. In
            the loss's own dtype, float32 at least: a bf16 or fp16 loss is reported (and
            summed over the window) in float32, a float64 loss in float64.
        num_targets: targets in that loss (the window's total on an update).
        has_targets: (property) whether ``num_targets`` > 0; a window without targets
            contributes no gradient (its gradients are zeroed, never divided by 0 or less).
        did_update: bool tensor, whether the optimizer applied an update on this call.
        skipped: bool tensor, whether an update was due but skipped (non-finite values).
        grad_norm: total gradient norm before clipping, when clipping or a finiteness check
            measured it on this call, else ``None``.
        lr: learning rate (float64) of the first parameter group used by this call.
        aux: the auxiliary tensors returned by ``loss_fn`` for this micro-batch, detached.
        aux_with_graph: the same tensors as ``loss_fn`` returned them, with their autograd
            graph: how a later step reuses a forward this one ran (a GAN's ``fake``; see
            ``run(..., feed=...)``). Keeping them keeps the graph's memory.
    """

    __slots__ = ("_aux", "_did_update", "_lr", "_skipped", "_sum", "_targets", "grad_norm")
    _sum: torch.Tensor
    _targets: torch.Tensor | float
    _did_update: torch.Tensor | bool
    _skipped: torch.Tensor | bool
    grad_norm: torch.Tensor | None
    _lr: torch.Tensor | float
    _aux: Mapping[str, torch.Tensor]

    def __init__(
        self,
        *,
        loss_sum: torch.Tensor,
        num_targets: torch.Tensor | float,
        did_update: torch.Tensor | bool,
        skipped: torch.Tensor | bool,
        grad_norm: torch.Tensor | None,
        lr: torch.Tensor | float,
        aux: Mapping[str, torch.Tensor],
    ) -> None:
        # The slot descriptors' setters: this runs on every micro-batch, and the class's own
        # __setattr__ refuses every assignment.
        set_sum, set_targets, set_did, set_skipped, set_norm, set_lr, set_aux = _OUTPUT_SETTERS
        set_sum(self, loss_sum)
        set_targets(self, num_targets)
        set_did(self, did_update)
        set_skipped(self, skipped)
        set_norm(self, grad_norm)
        set_lr(self, lr)  # the caller passes a copy when the LR is a tensor
        set_aux(self, aux)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepOutput is read-only; cannot set {name!r}")

    @property
    def loss(self) -> torch.Tensor:
        return at_least_float32(self._sum) / self._targets

    @property
    def num_targets(self) -> torch.Tensor:
        return torch.as_tensor(self._targets)

    @property
    def has_targets(self) -> torch.Tensor:
        """Bool tensor: whether the loss counted any target. A window whose count is 0 (or a
        tensor count <= 0) contributed no gradient: the update saw zero gradients."""
        return torch.as_tensor(self._targets) > 0

    @property
    def did_update(self) -> torch.Tensor:
        return torch.as_tensor(self._did_update)

    @property
    def skipped(self) -> torch.Tensor:
        return torch.as_tensor(self._skipped)

    @property
    def lr(self) -> torch.Tensor:
        return torch.as_tensor(self._lr, dtype=torch.float64)

    @property
    def aux(self) -> Mapping[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._aux.items()}

    @property
    def aux_with_graph(self) -> Mapping[str, torch.Tensor]:
        return dict(self._aux)

    def __repr__(self) -> str:
        names = ("loss", "num_targets", "did_update", "skipped", "grad_norm", "lr", "aux")
        return "StepOutput(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


_OUTPUT_SETTERS = tuple(
    vars(StepOutput)[name].__set__
    for name in ("_sum", "_targets", "_did_update", "_skipped", "grad_norm", "_lr", "_aux")
)

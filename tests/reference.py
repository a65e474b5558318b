"""The oracle: a plain PyTorch training loop, written the way the PyTorch docs write it.

Every law of DESIGN.md §3 is a test of steplib against these few lines. Nothing here imports
steplib, so a bug in steplib cannot hide in its own oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steplib.handlers import Logger

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x, y, mask (which targets count)


class Unsized:
    """Batches re-iterable without ``__len__`` (a stream): a loop flushes the open windows
    when a pass ends."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def tiny_model(seed: int = 0, *, dropout: float = 0.0) -> nn.Module:
    """A small MLP whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3), nn.Flatten(0)
    )


def make_batches(n: int, sizes: Sequence[int] | int = 6, *, seed: int = 1) -> list[Batch]:
    """``n`` batches of ``(x, y, mask)`` with sizes from ``sizes`` and random masks."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [sizes] * n if isinstance(sizes, int) else list(sizes)
    out = []
    for size in sizes:
        x = torch.randn(size, 8, generator=gen)
        y = torch.randn(size * 3, generator=gen)
        mask = torch.rand(size * 3, generator=gen) > 0.3
        mask[0] = True  # at least one target per micro-batch
        out.append((x, y, mask))
    return out


def mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A plain mean loss (every target counts the same)."""
    x, y, _ = batch
    return F.mse_loss(model(x), y)


def token_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A token-weighted loss: the sum over the masked targets and how many there were."""
    x, y, mask = batch
    err = (model(x) - y) ** 2
    return (err * mask).sum(), mask.sum()


def concat(batches: Sequence[Batch]) -> Batch:
    """One batch holding the given micro-batches, in order."""
    xs, ys, masks = zip(*batches, strict=True)
    return torch.cat(xs), torch.cat(ys), torch.cat(masks)


def reference_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    loss_fn: Callable[[nn.Module, Batch], Any],
    *,
    scheduler: Any = None,
    max_norm: float | None = None,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> list[dict[str, Any]]:
    """One optimizer update per batch; returns what happened at each update.

    A token-weighted ``loss_fn`` returning ``(loss_sum, count)`` is normalised as
    ``loss_sum / count`` before backward: the gradient of the batch's mean over its targets.
    """
    records = []
    for batch in batches:
        with torch.autocast(
            "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=bool(autocast_dtype)
        ):
            result = loss_fn(model, batch)
        loss = result[0] / result[1] if isinstance(result, tuple) else result
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        grad_norm = None
        if max_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            did_update = scaler.get_scale() >= scale_before  # a back-off means it was skipped
        else:
            optimizer.step()
            did_update = True
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None and did_update:
            scheduler.step()
        # At least float32, as steplib reports it: a float64 loss stays float64.
        reported = loss.detach().to(torch.promote_types(loss.dtype, torch.float32))
        records.append({"loss": reported, "grad_norm": grad_norm, "did_update": did_update})
    return records


def params_of(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters, for comparisons after more training."""
    return [p.detach().clone() for p in model.parameters()]


class RecordingSink(Logger):
    """A log sink that keeps its records in a list (``records``), for tests to read."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass

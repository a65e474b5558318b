"""``FlatState``: a sweep optimizer's buffers for some parameters of one dtype, laid end to end.

Why: a sweep of a small model has few elements and many tensors, so its update is bound by the
number of operations, not by the arithmetic. Holding each buffer (``exp_avg``, ...) of the
small parameters as one ``[N, D]`` tensor (``D``: the elements of one copy's parameters) makes
the update about 20 operations in all instead of 20 per parameter. A large parameter gets a
``FlatState`` of its own and is updated through a view of it (packing would copy its elements
more than the operations saved are worth: ``PACK_LIMIT`` in ``optim``). The optimizer's state
keeps the usual shape (per parameter: ``step`` ``[N]`` and each buffer shaped as the
parameter), as views of these tensors, so ``state_dict``, checkpoints and ``load_state_dict``
see what they always saw.

A ``load_state_dict`` (or any code) that replaces a state tensor leaves the views stale:
:meth:`FlatState.fits` notices it (identity of the tensors, no device read) and the optimizer
lays the state out again from the tensors it now holds.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch


class FlatState:
    """The state of ``params`` (one dtype and device, every one with a gradient this update)
    as one ``[N, D]`` tensor per buffer and one ``[P, N]`` tensor of step counts; the
    optimizer's per-parameter state entries are views of them.

    Attributes:
        params: the parameters, in the order of their columns.
        sizes: each parameter's elements per copy (its columns).
        buffers: ``{key: [N, D] tensor}``, one per buffer the optimizer declares.
        steps: ``[P, N]``: each parameter's update count per copy (its ``state["step"]``).
    """

    def __init__(
        self,
        state: dict[torch.Tensor, dict[str, Any]],
        params: Sequence[torch.Tensor],
        keys: Sequence[str],
        n: int,
    ) -> None:
        self.params = tuple(params)
        self.n = n
        # One contiguous parameter is updated through a view of it: no copy in or out.
        self.alone = len(params) == 1 and params[0].is_contiguous()
        self.keys = tuple(keys)
        self.sizes = [p.numel() // n for p in params]
        first = params[0]
        # Column j of the flat buffers belongs to parameter columns[j]; filled on the device
        # (no host-to-device copy, no sync on CUDA).
        self.columns = torch.cat(
            [torch.full((size,), i, device=first.device) for i, size in enumerate(self.sizes)]
        )
        entries = [state[p] for p in params]
        self.buffers: dict[str, torch.Tensor] = {}
        for key in self.keys:
            # What the state holds already (a loaded checkpoint, an earlier layout) is kept.
            flat = torch.cat(
                [
                    e[key].reshape(n, -1) if key in e else torch.zeros_like(p).reshape(n, -1)
                    for e, p in zip(entries, params, strict=True)
                ],
                dim=1,
            )
            for e, p, part in zip(entries, params, flat.split(self.sizes, 1), strict=True):
                e[key] = part.view(p.shape)
            self.buffers[key] = flat
        # The counts in at least float32, as torch.optim keeps them: a bfloat16 count stops at
        # 256 (float16 at 2048), and Adam's bias corrections would stop with it.
        counts = torch.promote_types(first.dtype, torch.float32)
        zero = torch.zeros(n, dtype=counts, device=first.device)
        self.steps = torch.stack([e.get("step", zero) for e in entries]).to(counts)
        for e, row in zip(entries, self.steps, strict=True):
            e["step"] = row
        self.views = self._entries(state)

    def fits(self, state: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor]) -> bool:
        """Whether this layout is still the state of ``params``: the same parameters, and
        every state entry still one of its views (not replaced by a load)."""
        return (
            len(params) == len(self.params)
            and all(map(operator.is_, params, self.params))
            and all(map(operator.is_, self._entries(state), self.views))
        )

    def spread(self, per_param: torch.Tensor) -> torch.Tensor:
        """``[N, P]`` (a value per copy and parameter) to ``[N, D]`` (per element); one
        parameter's ``[N, 1]`` broadcasts as it is."""
        return per_param if self.alone else per_param.index_select(1, self.columns)

    def gather(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameters (or their gradients) as one ``[N, D]`` tensor: a copy, or a view of
        a parameter that is alone."""
        flat = [t.reshape(self.n, -1) for t in tensors]
        return flat[0] if self.alone else torch.cat(flat, dim=1)

    def write(self, here: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
        """The parameters become ``new`` where ``here`` (``[N, 1]``) is True; ``old`` is what
        :meth:`gather` gave (written in place when it is a view of the one parameter)."""
        if self.alone:
            torch.where(here, new, old, out=old)
        else:
            torch._foreach_copy_(list(self.params), self.split(torch.where(here, new, old)))

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``[N, D]`` to one view per parameter, shaped as the parameter."""
        parts = flat.split(self.sizes, 1)
        return [part.view(p.shape) for part, p in zip(parts, self.params, strict=True)]

    def _entries(self, state: dict[torch.Tensor, dict[str, Any]]) -> list[Any]:
        return [state[p].get(key) for p in self.params for key in ("step", *self.keys)]

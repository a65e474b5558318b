"""Capture and restore every random number generator a training step may draw from.

Dropout, random data transforms and samplers draw from process-global generators: torch's CPU
generator, one generator per CUDA device, numpy's legacy global ``RandomState`` and Python's
``random``. A resume is exact only if all of them continue where they were, so a checkpoint
holds their states.

The captured value is plain data (tensors, ints, strings, lists and dicts), so that it loads
with ``torch.load(..., weights_only=True)``: numpy's key array becomes an int64 tensor and
Python's state tuple becomes lists.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # numpy is optional: its generator is captured only when it is installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the dev extra
    np = None  # type: ignore[assignment]

RngState = dict[str, Any]


def capture_rng() -> RngState:
    """The current state of every global generator, as plain data.

    Returns:
        ``{"torch": ByteTensor, "cuda": [ByteTensor per device] or None, "numpy": dict or None,
        "python": list}``. ``cuda`` is ``None`` when CUDA is not available; ``numpy`` when numpy
        is not installed.

    Example:
        >>> import torch
        >>> state = capture_rng()
        >>> a = torch.rand(2)
        >>> restore_rng(state)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    cuda = None
    if torch.cuda.is_available():
        # One state per device: a process may drive several GPUs (model parallel).
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        numpy_state = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy": numpy_state,
        "python": [version, list(internal), gauss_next],
    }


def restore_rng(state: RngState) -> None:
    """Set every global generator to a state returned by :func:`capture_rng`.

    A generator missing from ``state`` (numpy was not installed when it was captured) or from
    this process (no CUDA here) is left as it is.

    Args:
        state: a value returned by :func:`capture_rng` (possibly after a save and load).

    Raises:
        ValueError: ``state`` holds a different number of CUDA devices than this process sees
            (restoring part of them would not be an exact resume).
    """
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"restore_rng received CUDA generator states for {len(cuda)} device(s), but this "
                f"process sees {torch.cuda.device_count()}. Resume with the same number of "
                "visible devices (CUDA_VISIBLE_DEVICES) as the run that saved it."
            )
        torch.cuda.set_rng_state_all(cuda)
    numpy_state = state.get("numpy")
    if numpy_state is not None and np is not None:
        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))

"""A spy on host reads of tensors, for tests that check *when* a handler reads the device."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence

import torch

from steplib.step.device_skips import HostCopy
from steplib.testing import HOST_READS


@contextlib.contextmanager
def on_host_read(
    callback: Callable[[str], None], names: Sequence[str] = HOST_READS
) -> Iterator[None]:
    """Call ``callback(name)`` before every ``Tensor.<name>`` call in ``names`` inside the
    block (it may raise to refuse the read); the methods are restored afterwards. A read of a
    landed host copy (``HostCopy.read`` of a tensor in host memory) is no sync and is let
    through, as ``steplib.testing.assert_no_host_sync`` does."""
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def spy(name: str, original: Callable[..., object]) -> Callable[..., object]:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            landed = sys._getframe(1).f_code is HostCopy.read.__code__
            if not (landed and self.device.type == "cpu"):
                callback(name)
            return original(self, *args, **kwargs)

        return read

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, spy(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)

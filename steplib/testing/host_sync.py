"""``assert_no_host_sync``: run a step with every host read of a tensor made to raise (law 8),
and name the line of the user's code that read."""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import sys
import sysconfig
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import steplib
from steplib.step.device_skips import HostCopy

# Every way Python code reads a tensor's value on the host. On a GPU each waits for the device
# to finish the queued work; on a CPU they are free, which is why a CPU run never shows the cost.
# The comparisons that answer a Python bool are methods and torch functions both.
_COMPARISONS = ("equal", "allclose", "is_nonzero")
_VALUES = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")
HOST_READS = (*_VALUES, *_COMPARISONS)

_LIBRARIES = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, steplib))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_HARNESS = os.path.dirname(__file__) + os.sep  # steplib/testing
_MISSING = object()
# HostCopy.read reads a host copy of a device value only once the copy has landed (an event
# query, never a wait): host memory, so no sync. It is let through when its tensor is in host
# memory; on CUDA the sync debug mode below would still catch a real wait.
_LANDED_READ = HostCopy.read.__code__


class HostSyncError(AssertionError):
    """Raised by a patched host read inside :func:`assert_no_host_sync`."""


def assert_no_host_sync(step: Any, state: Any, batches: Iterable[Any]) -> Any:
    """Run ``step`` over ``batches`` with host reads made to raise; return the final state.

    While the step runs, ``Tensor.item``, ``__bool__``, ``__float__``, ``__int__``,
    ``__index__``, ``cpu``, ``tolist``, ``numpy`` and the comparisons that answer a Python bool
    (``equal``, ``allclose``, ``is_nonzero``, as methods and as ``torch.`` functions) raise
    (``.cpu()`` too on a CPU tensor: it is a device-to-host copy on a GPU), and on CUDA
    ``torch.cuda.set_sync_debug_mode("error")`` also catches syncs those miss (``torch.nonzero``,
    boolean-mask indexing, ``.to("cpu")``: on a CPU they read nothing on the host). Batches
    are fetched outside the patch (a sampler may read tensors); a step with ``flush`` is
    flushed at the end, so the update path runs even when the last window is open.
    Everything is restored afterwards, also on failure. A read that the step's own code
    catches and hides is still reported.

    The patch is on the ``torch.Tensor`` class, so another thread reading a tensor meanwhile
    (a background checkpoint) would fail too: run this with no such thread.

    Args:
        step: ``step(state, batch) -> (state, out)``: a steplib ``Step`` or your own.
        state: the state to start from.
        batches: the batches to feed, one call each.

    Returns:
        The state after the last call.

    Raises:
        AssertionError: the step read a tensor on the host. The message names the method, the
            first line outside torch and steplib that led to it (your ``loss_fn``, your
            wrapper), its source, the call (``batches[i]`` or the flush) and, when the read is
            inside torch, where in torch (e.g. Adam's CPU step counter).

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> assert_no_host_sync(step, state, [torch.ones(4, 2)] * 2).step
        2
    """
    found: list[str] = []
    batches = iter(batches)
    index = 0
    while True:
        batch = next(batches, _MISSING)
        if batch is _MISSING:
            break
        state = _checked(lambda s, b=batch: step(s, b), state, f"batches[{index}]", found)[0]
        index += 1
    flush = getattr(step, "flush", None)
    if callable(flush):
        state = _checked(flush, state, "the flush after the last batch", found)[0]
    return state


def _checked(call: Any, state: Any, where: str, found: list[str]) -> Any:
    """``call(state)`` under the patch; a host read becomes an AssertionError naming it."""
    cuda = getattr(state, "device", torch.device("cpu")).type == "cuda"
    try:
        with _host_reads_raise(found, where), _cuda_sync_errors(cuda):
            result = call(state)
    except HostSyncError as err:
        raise AssertionError(found[0] if found else str(err)) from err
    except RuntimeError as err:
        if not cuda or "synchroniz" not in str(err):
            raise
        raise AssertionError(
            f"assert_no_host_sync: the step synchronised with the GPU during the call on "
            f"{where}: {err}. {_describe_frames(_traceback_frames(err.__traceback__))}"
        ) from err
    if found:  # the step's own code caught the HostSyncError and went on
        raise AssertionError(found[0] + " (the step caught the error and went on)")
    return result


@contextlib.contextmanager
def _host_reads_raise(found: list[str], where: str) -> Iterator[None]:
    # Most of these are defined on torch's C base class, not on torch.Tensor itself: remember
    # which, so that restoring deletes our attribute instead of leaving a copy on the subclass.
    reads = [(torch.Tensor, name) for name in HOST_READS] + [(torch, n) for n in _COMPARISONS]
    saved = {(owner, name): vars(owner).get(name, _MISSING) for owner, name in reads}
    originals = {(owner, name): getattr(owner, name) for owner, name in reads}

    def raising(owner: Any, name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code is _LANDED_READ and self.device.type == "cpu":
                return originals[owner, name](self, *args, **kwargs)
            frames = _stack_frames(sys._getframe(1))
            message = (
                f"assert_no_host_sync: {owner.__name__}.{name}() read a tensor "
                f"on the host during the call on {where} (on a GPU it waits for every queued "
                "kernel). " + _describe_frames(frames)
            )
            if not found:
                found.append(message)
            raise HostSyncError(message)

        return read

    try:
        for owner, name in reads:
            setattr(owner, name, raising(owner, name))
        yield
    finally:
        for (owner, name), original in saved.items():
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def _cuda_sync_errors(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _stack_frames(frame: types.FrameType | None) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` from ``frame`` outwards (innermost first)."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def _traceback_frames(tb: types.TracebackType | None) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of a traceback, innermost first."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return frames[::-1]


def _describe_frames(frames: list[tuple[str, int, str]]) -> str:
    """Where the read happened, from the frames inside the step (innermost first): the first
    one outside torch, steplib and the standard library (your loss_fn or wrapper), and the
    exact place when the read itself is inside a library."""
    # Frames from this harness outwards are the caller of assert_no_host_sync, not the step.
    inside = list(itertools.takewhile(lambda f: not f[0].startswith(_HARNESS), frames))
    user = next((f for f in inside if not _internal(f[0])), None)
    if user is None:
        text = "No code of yours led to it."
    else:
        text = _frame(user, "At") + (
            " Keep the value a tensor (e.g. return num_targets as a 0-dim tensor, combine "
            "flags with torch.where), or read it in a handler every N steps, after the step."
        )
    if inside and _internal(inside[0][0]):
        text += f" The read itself is inside a library, {_frame(inside[0], 'at')}"
        text += _library_hint(inside[0][0])
    return text


def _library_hint(filename: str) -> str:
    if f"{os.sep}torch{os.sep}optim{os.sep}" in filename:
        return (
            " torch's Adam/AdamW (and others) read their CPU step counter with .item() unless "
            "built with capturable=True or fused=True: use one of those, or another optimizer, "
            "in this test."
        )
    if filename.startswith(_LIBRARIES[1]):
        return (
            " steplib reads the skip decision once per update, by design, when skip_nonfinite "
            "or a float16 GradScaler is used (a host-side LR scheduler must know whether to "
            "step): test the rest of your step without them."
        )
    return ""


def _internal(filename: str) -> bool:
    """torch, steplib (this harness included) or the standard library, not site-packages."""
    if filename.startswith(_LIBRARIES):
        return True
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def _frame(frame: tuple[str, int, str], prefix: str) -> str:
    filename, line, function = frame
    source = linecache.getline(filename, line).strip()
    shown = f": `{source}`" if source else ""
    return f"{prefix} {filename}:{line} in {function}{shown}."

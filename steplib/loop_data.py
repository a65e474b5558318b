"""Where the data goes on when a run ends inside a pass (a stop, a ``break``, an error): a
stateful loader's next pass continues this one, so that a next run on the state the run ended
with sees the batches of the uninterrupted run. Imports nothing from steplib; the loader is
used through its methods (``continue_pass``, or ``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

# A run that raised is told where its data goes on here: its error is the one raised.
_log = logging.getLogger("steplib.loop")

# What the loop holds as `pulled` while the loader is asked for the next batch, and once the
# step has trained the batch the loader yielded last.
PULLING = object()
TRAINED = object()


def keep_position(
    data: Any,
    passing: Iterator[Any],
    *,
    at: int,
    end: int | None,
    untrained: Sequence[Any] = (),
) -> None:
    """Make ``data``'s next pass go on with ``passing`` (what ``iter(data)`` returned for the
    pass the run left), after ``untrained`` (batches yielded, not trained); ``at``: the
    batches of the epoch yielded so far, of ``end`` (None: unsized)."""
    left = None if end is None else end - at
    # A run that ends inside a pass (a stop, a break, an error): a stateful loader's next pass
    # goes on with this one, so that a next run on the state it ended with sees the batches
    # of the uninterrupted run. A ResumableLoader continues the pass itself, after the batches
    # it yielded that were not trained; another stateful loader reloads its own position.
    if hasattr(data, "continue_pass"):
        data.continue_pass(passing, untrained, at=at, left=left)
    elif hasattr(data, "load_state_dict") and hasattr(data, "state_dict") and left != 0:
        # At a pass's end another loader starts the next epoch (its epoch_end comes late).
        data.load_state_dict(data.state_dict())


def after_error(
    data: Any,
    passing: Iterator[Any],
    *,
    error: BaseException,
    pulled: Any,
    at: int,
    end: int | None,
) -> None:
    """Where ``data`` goes on after the run raised ``error`` in the pass ``passing``
    (``iter(data)``): ``pulled`` is the batch the step was given, ``TRAINED`` once trained,
    ``PULLING`` while the loader was asked for one, None outside a pass; ``at`` and ``end``:
    as for :func:`keep_position`. Never raises: the run's error is the one raised."""
    # Where the run raised decides where the data goes on. A handler (or the loop) raised:
    # the batch was trained, as at a stop. The step raised: the batch it was given is
    # untrained, and the step leaves the state as it received it (lineage.backward_failed),
    # so the uninterrupted run's next batch is that one again. The loader raised: its
    # position is unknown, and its next pass begins a new one.
    stateful = hasattr(data, "load_state_dict") and hasattr(data, "state_dict")
    if pulled is None or not stateful:  # outside a pass, or data without a position
        return
    if pulled is PULLING:
        _log.warning(
            "the data loader raised while yielding a batch (%s), so its position is "
            "unknown: a next run over it begins a new pass. To go on exactly, load the "
            "last checkpoint (steplib.checkpoint.load(url, state, data=loader)).",
            type(error).__name__,
        )
        return
    untrained = [] if pulled is TRAINED else [pulled]
    try:
        keep_position(data, passing, at=at, end=end, untrained=untrained)
    except Exception as failed:  # logged: the run's own error is the one raised
        _log.error("keeping the data position after %r failed: %r", error, failed)
        return
    if untrained and not hasattr(data, "continue_pass"):
        _log.warning(
            "the step raised (%s) on a batch that %s yielded, so a next run over it goes on "
            "after that batch, which is never trained in this epoch. A loader that gives it "
            "back to the next run: steplib.data.resumable_loader(...).",
            type(error).__name__,
            type(data).__name__,
        )


def begin_pass(data: Any, epoch: int) -> int:
    """Where in its epoch ``data``'s next pass begins: a ``ResumableLoader`` that continues an
    epoch (loaded at a position, or going on with a pass a run left) says it; 0 otherwise. At 0
    (an epoch begins), what of it has ``set_epoch`` is set to ``epoch`` first: its sampler (a
    ``DistributedSampler``), batch sampler, dataset (a Hugging Face streaming dataset) or itself.
    PyTorch leaves that call to the loop, and forgotten, every epoch drew the first one's order,
    in silence (Lightning, Accelerate and the HF Trainer make it too)."""
    at = getattr(data, "resumed_at", 0)
    at = at if isinstance(at, int) else 0
    if at == 0:
        batch_sampler: Any = getattr(data, "batch_sampler", None)
        found: list[Any] = [data, getattr(data, "sampler", None), batch_sampler]
        found += [getattr(batch_sampler, "sampler", None), getattr(data, "dataset", None)]
        for sampler in {id(one): one for one in found}.values():  # each once
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)
    return at


class Partial:
    """While several steps run on one batch (``run({"D": ..., "G": ...})``): the state after
    those that have trained on it, and their names; ``state`` is None outside such a call."""

    __slots__ = ("done", "state")

    def __init__(self) -> None:
        self.state: Any = None
        self.done: list[str] = []

    def taken(self, error: BaseException, steps: Any) -> Any:
        """The newest state when a later step of several (``steps``: the run's, by name)
        raised after earlier ones trained on the batch (``None`` otherwise), with a warning
        that the others did not train on it. Training the batch again would train the earlier
        ones twice, so it counts as trained: an older state would be refused (their lineage
        moved on)."""
        if self.state is None:
            return None
        rest = [name for name in steps if name not in self.done]  # several steps, by name
        if not rest:  # raised after the last step (a KeyboardInterrupt): every one trained
            return self.state
        _log.warning(
            "the step %r raised (%s) after %s trained on the batch: the run's exception event "
            "holds their update, and a next run goes on after that batch, which %s did not "
            "train on. To train it exactly, load the last checkpoint instead.",
            rest[0],
            type(error).__name__,
            ", ".join(map(repr, self.done)),
            ", ".join(map(repr, rest)),
        )
        return self.state

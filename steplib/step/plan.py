"""What a step's parts add up to (:class:`Plan`, computed once when the step is built), and the
one rule on composition that every wrapper goes through (:func:`check_composition`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.device_skips import SkipMemory
from steplib.step.parts import (
    LOCAL,
    NORMALISE,
    UNSCALE,
    Gradients,
    GradSync,
    GradTransform,
    Hook,
    Part,
    Update,
)


def scaler_active(state: TrainState) -> bool:
    """Whether the state's ``GradScaler`` scales the loss (float16 mixed precision)."""
    scaler = state.scaler
    return scaler is not None and scaler.is_enabled()


# The core's own gradient transforms, in every step: they come from the state (its scaler) and
# from token weighting, not from a wrapper.
def _unscale(grads: Gradients) -> None:
    state = grads.state
    if scaler_active(state):
        scaler, optimizer = state.scaler, state.optimizer
        scaler.unscale_(optimizer)  # type: ignore[union-attr]
        found = scaler._found_inf_per_device(optimizer).values()  # type: ignore[union-attr]
        grads.flag_nonfinite(torch.stack([f.to(state.device) for f in found]).sum() > 0)


def _normalise(grads: Gradients) -> None:
    # Pending until a transform reads the gradients: clipping folds it into its multiply.
    grads.divide_by(grads.divisor)


CORE_TRANSFORMS = ((UNSCALE, _unscale), (NORMALISE, _normalise))


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What a step's parts add up to, computed once when the step is built (never per call).

    Attributes:
        window: micro-batches per update.
        micro_contexts: ``(fn, ...)`` entered around forward and backward, outermost first.
        forward_contexts: ``(fn, ...)`` entered around ``loss_fn``, outermost first.
        transforms: every gradient transform in the gradient order, the core's own included.
        updates: the parts' update functions, outermost first.
        hooks: ``{point: (fn, ...)}`` for the points some part hooks.
        sync: the step's :class:`GradSync`.
        max_consecutive_skips: the tightest limit, else ``None``.
        runner: how the phases run.
        skips: what the step remembers of skips decided on the device (its own, never the
            state's: see ``steplib.step.device_skips``).
    """

    window: int
    micro_contexts: tuple[Callable[[TrainState, bool], ContextManager[Any]], ...]
    forward_contexts: tuple[Callable[[TrainState], ContextManager[Any]], ...]
    transforms: tuple[GradTransform, ...]
    updates: tuple[Update, ...]
    hooks: Mapping[str, tuple[Hook, ...]]
    sync: GradSync
    max_consecutive_skips: int | None
    runner: Any  # steplib.step.core.Runner
    skips: SkipMemory

    @classmethod
    def of(
        cls,
        parts: tuple[Part, ...],
        *,
        default_runner: Any,
    ) -> Plan:
        """Add up ``parts``; the core's own transforms go first at a tie."""
        ordered: list[tuple[float, int, GradTransform]] = [
            (order, 0, fn) for order, fn in CORE_TRANSFORMS
        ]
        ordered += [(p.order, 1, p.grad_transform) for p in parts if p.grad_transform is not None]
        hooks: dict[str, tuple[Hook, ...]] = {}
        for part in parts:
            for point, hook in part.hooks.items():
                hooks[point] = (*hooks.get(point, ()), hook)
        limits = [p.max_consecutive_skips for p in parts if p.max_consecutive_skips is not None]
        return cls(
            window=max([p.window for p in parts if p.window is not None], default=1),
            micro_contexts=tuple(p.micro_context for p in parts if p.micro_context is not None),
            forward_contexts=tuple(
                p.forward_context for p in parts if p.forward_context is not None
            ),
            # sorted is stable: the core's own first at a tie, then the order of application
            transforms=tuple(fn for _, _, fn in sorted(ordered, key=lambda r: (r[0], r[1]))),
            updates=tuple(p.update for p in parts if p.update is not None),
            hooks=hooks,
            sync=next((p.sync for p in parts if p.sync is not None), LOCAL),
            max_consecutive_skips=min(limits, default=None),
            runner=next((p.runner for p in parts if p.runner is not None), default_runner),
            skips=SkipMemory(),
        )


def check_composition(parts: tuple[Part, ...]) -> None:
    """The declared rule, checked when the last of ``parts`` is added: each name once; at most
    one part shares gradients across processes and one replaces the runner; nothing after a
    part marked ``last``; and the runner accepts every part.

    Raises:
        ConfigError: which part breaks the rule, why, and the fix.
    """
    *earlier, part = parts
    name = part.name
    runner = next((p.runner for p in parts if p.runner is not None), None)
    for each in parts if runner is not None else ():
        problem = runner.refuse(each)  # type: ignore[union-attr]
        if problem is not None:
            raise ConfigError(problem)
    for done in earlier:
        if done.last:
            raise ConfigError(
                f"{name} was applied after {done.name}, which captured the step's parts when "
                f"it was applied, so {name} would be silently ignored. Apply {done.name} "
                f"last: {done.name}({name}(step, ...))."
            )
        if done.name == name:
            raise ConfigError(
                f"{name} was applied twice (first with {dict(done.settings)}, now with "
                f"{dict(part.settings)}); a second {name} cannot be combined with the first. "
                "Apply it once with the settings you want."
            )
        for field, what in (("sync", "is distributed"), ("runner", "has one runner")):
            if getattr(done, field) is not None and getattr(part, field) is not None:
                raise ConfigError(
                    f"{name} was given a step already wrapped by {done.name}; a step {what} "
                    f"once. Remove one of the two."
                )

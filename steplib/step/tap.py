"""``tap``: call user functions at the step's phase boundaries.

Classic trainers expose these as callbacks (``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, ``on_before_zero_grad``...). Here they are a wrapper whose part
hooks the step's phase points (``Part(hooks=...)``, which your own wrappers can use too); a step
built without hooks pays one dictionary lookup per point.
"""

from __future__ import annotations

from typing import Any

from steplib.errors import ConfigError, describe
from steplib.step.core import Step, add_part
from steplib.step.parts import HOOK_POINTS, Part


def tap(step: Step, **hooks: Any) -> Step:
    """Call ``hook(state)`` at phase boundaries, in this order within an update:

    ``before_backward`` / ``after_backward`` around every micro-batch's backward
    (``after_backward`` sees the window's gradients so far: summed, not yet divided by its
    targets and, with a float16 ``GradScaler``, still times the loss scale);
    ``before_update`` (gradients final: unscaled, normalised, clipped) and ``after_update``
    around the optimizer step, at every closed window, in every composition: also when the
    update is skipped (a non-finite window, a window with no targets), since a decision kept
    on the device cannot choose whether to call them (``out.did_update`` says which);
    ``after_zero_grad`` after the gradients are cleared, at every closed window. A hook's
    return value is ignored; it may read anything (e.g. gradient statistics) but should not
    replace parameters.

    Args:
        step: the step to wrap.
        **hooks: any of ``before_backward``, ``after_backward``, ``before_update``,
            ``after_update``, ``after_zero_grad``, each a callable of the state.

    Returns:
        The wrapped step.

    Raises:
        ConfigError: no hook, an unknown hook name, a hook that is not callable, or a step
            already tapped.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> seen = []
        >>> step = tap(make_train_step(lambda m, b: m(b).sum()),
        ...            before_update=lambda s: seen.append("update"))
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> _ = step(TrainState.create(model=model, optimizer=opt), torch.ones(1, 2))
        >>> seen
        ['update']
    """
    if not hooks:
        raise ConfigError(
            f"tap(step) received no hook. Pass one or more of {', '.join(HOOK_POINTS)}, e.g. "
            "tap(step, after_backward=lambda state: ...)."
        )
    unknown = sorted(set(hooks) - set(HOOK_POINTS))
    if unknown:
        raise ConfigError(
            f"tap received the unknown hook name(s) {unknown}. The hooks are: "
            f"{', '.join(HOOK_POINTS)}."
        )
    for name, hook in hooks.items():
        if not callable(hook):
            raise ConfigError(
                f"tap({name}=...) received {describe(hook)}, which is not callable. Pass a "
                f"function of the state: tap(step, {name}=lambda state: ...)."
            )
    settings = {
        name: getattr(hook, "__name__", type(hook).__name__) for name, hook in hooks.items()
    }
    return add_part(step, Part(name="tap", settings=settings, hooks=hooks))

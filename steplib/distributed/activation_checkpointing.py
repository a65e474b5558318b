"""Activation checkpointing of chosen submodules: keep less in memory, recompute in backward.

:func:`checkpoint_activations` replaces each chosen submodule (e.g. every transformer block) by
torch's ``CheckpointWrapper`` (non-reentrant ``torch.utils.checkpoint``): the block's inner
activations are not kept after forward but recomputed during backward, trading about one more
forward of those blocks for their activation memory. The RNG state is saved and restored around
the recomputation, so dropout draws the same mask twice and the gradients equal those of the
unwrapped model.

The parameters stay the same objects (an optimizer built before still holds them) and the
``state_dict`` keys stay the same (torch's wrapper strips its own prefix), so checkpoints load
into a wrapped or an unwrapped model alike. Apply it before ``ddp_wrap``/``fsdp_wrap``'s
``apply_ddp``/``apply_fsdp``.

Imports ``errors`` only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from steplib.errors import ConfigError, describe

Selector = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]


def checkpoint_activations(
    model: nn.Module, *, modules: Selector, preserve_rng_state: bool = True
) -> list[str]:
    """Wrap the submodules of ``model`` chosen by ``modules`` with activation checkpointing,
    in place. A chosen module's own submodules are not wrapped again; the root is never wrapped.

    Args:
        model: the module to change.
        modules: a module class, a tuple of classes, or a predicate ``fn(module) -> bool``.
        preserve_rng_state: restore the RNG state for the recomputation (dropout draws the same
            mask); ``False`` is a little faster but changes results with dropout.

    Returns:
        The names of the wrapped submodules.

    Raises:
        ConfigError: ``model`` not a module, ``modules`` not a class/tuple/callable, nothing
            matched (the message lists the submodule classes there are), or ``model`` already
            has checkpointed submodules.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> checkpoint_activations(model, modules=nn.Linear)
        ['0', '2']
        >>> import torch
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> list(model.state_dict())
        ['0.weight', '0.bias', '2.weight', '2.bias']
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"checkpoint_activations(model) received {describe(model)}; pass an nn.Module."
        )
    match = _matcher(modules)
    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        raise ConfigError(
            "checkpoint_activations: the model already has checkpointed submodules; applying "
            "it again would checkpoint inside a checkpoint. Apply it once, choosing all the "
            "modules at once: modules=(BlockA, BlockB)."
        )
    wrapped: list[str] = []
    _wrap_children(model, "", match, preserve_rng_state, wrapped)
    if not wrapped:
        kinds = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(
            f"checkpoint_activations(modules={describe(modules)}) matched no submodule of "
            f"{type(model).__name__}; its submodule classes are: {', '.join(kinds) or '(none)'}."
            " Pass one of those classes, e.g. modules=Block, or a predicate."
        )
    return wrapped


def _matcher(modules: object) -> Callable[[nn.Module], bool]:
    if isinstance(modules, type) and issubclass(modules, nn.Module):
        return lambda m: isinstance(m, modules)
    if (
        isinstance(modules, tuple)
        and modules
        and all(isinstance(t, type) and issubclass(t, nn.Module) for t in modules)
    ):
        return lambda m: isinstance(m, modules)
    if callable(modules) and not isinstance(modules, type):
        return modules
    raise ConfigError(
        f"checkpoint_activations(modules=...) received {describe(modules)}; pass an nn.Module "
        "subclass (modules=Block), a tuple of them, or a predicate "
        "(modules=lambda m: isinstance(m, Block) and m.index % 2 == 0)."
    )


def _wrap_children(
    parent: nn.Module,
    prefix: str,
    match: Callable[[nn.Module], bool],
    preserve_rng_state: bool,
    wrapped: list[str],
) -> None:
    for name, child in parent.named_children():
        path = f"{prefix}{name}"
        if match(child):
            wrapper = checkpoint_wrapper(
                child,
                checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                preserve_rng_state=preserve_rng_state,
            )
            parent.register_module(name, wrapper)
            wrapped.append(path)
        else:
            _wrap_children(child, f"{path}.", match, preserve_rng_state, wrapped)

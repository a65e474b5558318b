"""Split an ``nn.Sequential`` into pipeline stages by the names of its children.

A pure function of the model: every rank may call it and keep its own stage (pass the list to
:func:`steplib.step.pipeline.make_pipeline_step`, which picks this rank's entry, or entries
``rank, rank + size, ...`` for the interleaved schedules, and checks that the stages fit the
processes). A model whose forward is not a chain of its children
(a transformer with an embedding, blocks in a ``ModuleList`` and a head) is split by hand:
build each stage's module yourself, as torchtitan does, and pass the list.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from steplib.errors import ConfigError, describe


def split_model(model: nn.Module, *, split_points: Sequence[str]) -> list[nn.Sequential]:
    """Cut ``model`` before each named child: ``len(split_points) + 1`` stages.

    Each stage is an ``nn.Sequential`` of consecutive children that *shares* the model's
    modules and keeps their names, so a stage's ``state_dict`` keys are the model's own
    (``"4.weight"``): the stages' checkpoints together hold the model's keys once each.

    Args:
        model: an ``nn.Sequential`` (its forward is the chain of its children).
        split_points: names of children that each begin a new stage, in order, e.g.
            ``["3"]`` cuts ``Sequential(l0, l1, l2, l3, l4)`` into ``[l0..l2]`` and ``[l3, l4]``.

    Returns:
        The stages, in pipeline order.

    Raises:
        ConfigError: ``model`` is not an ``nn.Sequential``; a split point that is not the name
            of one of its children (the error lists them), the first child, repeated or out
            of order; ``split_points`` empty or a bare string.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 2))
        >>> first, second = split_model(model, split_points=["2"])
        >>> [name for name, _ in first.named_children()], list(second.state_dict())
        (['0', '1'], ['2.weight', '2.bias'])
        >>> x = torch.randn(3, 4)
        >>> torch.equal(second(first(x)), model(x))
        True
    """
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"split_model received a {type(model).__name__}, not an nn.Sequential, so the "
            "order of its children says nothing about its forward. Build each stage's module "
            "yourself (the layers of stage i, in order) and pass the list to "
            "make_pipeline_step(loss_fn, [stage0, stage1, ...], ...)."
        )
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise ConfigError(
            f"split_model(split_points=...) received {describe(split_points)}; pass a list of "
            "child names, e.g. split_points=['3'] for two stages."
        )
    names = [name for name, _ in model.named_children()]
    if not split_points:
        raise ConfigError(
            "split_model(split_points=[]) would make a single stage; pass one name per cut, "
            f"from the model's children {names}, e.g. split_points=[{names[len(names) // 2]!r}]."
        )
    positions = []
    for point in split_points:
        if point not in names:
            nested = (
                " (nested names are not split: flatten the model first)"
                if "." in str(point)
                else ""
            )
            raise ConfigError(
                f"split_model: split point {point!r} is not a child of the model{nested}. Its "
                f"children are {names}; pass some of these names, e.g. split_points="
                f"[{names[len(names) // 2]!r}]."
            )
        positions.append(names.index(point))
    if positions[0] == 0 or any(b <= a for a, b in itertools.pairwise(positions)):
        raise ConfigError(
            f"split_model: split points {list(split_points)} are at child positions "
            f"{positions}; they must be increasing and after the first child, else a stage "
            f"would be empty. Order them as the children are: {names}."
        )
    bounds = [0, *positions, len(names)]
    return [model[a:b] for a, b in itertools.pairwise(bounds)]  # type: ignore[misc]

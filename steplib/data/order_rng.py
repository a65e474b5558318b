"""``check_order_rng``: a :class:`~steplib.data.loader.ResumableLoader`'s position holds its
own generator alone, so its order must be drawn from that generator: not from torch's global
one, nor from a sampler's own. ``epoch_samplers``: the samplers whose epoch it holds.
``check_torchdata_order``: the orders a plain torchdata ``StatefulDataLoader`` does not resume
exactly."""

from __future__ import annotations

from typing import Any

import torch
from torchdata.stateful_dataloader.sampler import RandomSampler

from steplib.errors import ConfigError, describe


def check_order_rng(generator: Any, sampler: Any, batch_sampler: Any) -> torch.Generator:
    """The loader's ``generator``, once it and its samplers are checked to draw the order from
    it alone.

    A ``WeightedRandomSampler``, ``RandomSampler`` or ``SubsetRandomSampler`` draws from its
    ``generator``, or from torch's global generator when that is ``None``; resumed inside an
    epoch, or at an epoch's end from its own seed again, it would draw another order than the
    one the saved position counts in. A sampler with no ``generator`` (sequential, a
    ``DistributedSampler`` with ``set_epoch``, a list of indices) is left alone.

    Args:
        generator: the loader's ``generator``.
        sampler, batch_sampler: the loader's.

    Returns:
        ``generator``.

    Raises:
        ConfigError: no ``generator``, or a sampler's ``generator`` is another; the message
            gives the fix.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> check_order_rng(g, torch.utils.data.RandomSampler(range(4), generator=g), None) is g
        True
        >>> check_order_rng(g, torch.utils.data.RandomSampler(range(4)), None)
        ...     # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steplib.errors.ConfigError: ResumableLoader received a RandomSampler that draws ...
    """
    if generator is None:
        raise ConfigError(
            "ResumableLoader needs a torch.Generator (generator=...): without one, the "
            "DataLoader draws seeds from the global torch generator at every epoch and a "
            "resume would shift dropout. Build it with resumable_loader(dataset, seed=0)."
        )
    for one in _samplers(sampler, batch_sampler):
        if hasattr(one, "generator") and one.generator is not generator:
            kind = type(one).__name__
            source = "torch's global generator" if one.generator is None else "its own generator"
            raise ConfigError(
                f"ResumableLoader received a {kind} that draws its order from {source}, which "
                "the loader's position does not hold: a resumed run would draw another order, "
                "and see some samples twice and others never. Give it the loader's generator: "
                "g = torch.Generator().manual_seed(0); ResumableLoader(dataset, "
                f"sampler={kind}(..., generator=g), generator=g, ...)."
            )
    return generator


def check_torchdata_order(caller: str, loader: Any) -> None:
    """Refuse a torchdata ``StatefulDataLoader`` (not a ``ResumableLoader``) whose order is drawn
    from a generator that torchdata 0.11 does not resume from where the epoch began.

    Its position replays a sampler from the generator as it is at the save, not as it was when
    the epoch began, and seeds the later epochs from another state: resumed, a shuffled epoch or
    the ones after it come in another order (``shuffle=True`` with ``generator=g``; any
    ``WeightedRandomSampler``). torchdata's own ``RandomSampler`` with a generator of its own
    (``shuffle=True`` without ``generator=``) and a sampler without one resume exactly.

    Args:
        caller: the call, for the message (``"save"``).
        loader: a plain ``StatefulDataLoader``.

    Raises:
        ConfigError: such a loader; the message gives the fix, a ``ResumableLoader``.

    Example:
        >>> import warnings
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # torchdata's own deprecation warning
        ...     plain = StatefulDataLoader(range(4), shuffle=True)
        ...     seeded = StatefulDataLoader(range(4), shuffle=True, generator=torch.Generator())
        >>> check_torchdata_order("save", plain)
        >>> check_torchdata_order("save", seeded)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steplib.errors.ConfigError: save(data=...) received a StatefulDataLoader whose order ...
    """
    for one in _samplers(loader.sampler, loader.batch_sampler):
        own = isinstance(one, RandomSampler) and one.generator is not loader.generator
        if hasattr(one, "generator") and not own:
            raise ConfigError(
                f"{caller}(data=...) received a StatefulDataLoader whose order is drawn from a "
                f"generator (its {type(one).__name__}'s), which torchdata does not resume from "
                "where the epoch began: a resumed run would see another order, inside the epoch "
                "or in the later ones. Build it as a steplib.data.ResumableLoader with the same "
                "arguments and g = torch.Generator().manual_seed(0) as its generator (and a "
                "sampler's), or with steplib.data.resumable_loader(dataset, batch_size=..., "
                "seed=0)."
            )


def epoch_samplers(sampler: Any, batch_sampler: Any) -> list[Any]:
    """The samplers of a loader whose order follows ``set_epoch`` (a ``DistributedSampler``),
    once each: a :class:`~steplib.data.loader.ResumableLoader`'s position holds their epochs.

    Resumed inside an epoch, ``run`` emits no ``epoch_start`` (the uninterrupted run had it
    before the epoch's first batch), so a handler calling ``set_epoch`` there does not run: the
    loader itself sets the saved epoch back, which it must be able to read.

    Args:
        sampler, batch_sampler: the loader's.

    Returns:
        Those with a ``set_epoch`` method, in the order of ``sampler``, ``batch_sampler``, the
        latter's sampler.

    Raises:
        ConfigError: such a sampler without an int ``epoch`` attribute; the message gives the
            fix.

    Example:
        >>> from torch.utils.data import DistributedSampler
        >>> shares = DistributedSampler(range(8), num_replicas=2, rank=0)
        >>> epoch_samplers(shares, None) == [shares]
        True
    """
    found: list[Any] = []
    for one in _samplers(sampler, batch_sampler):
        if not callable(getattr(one, "set_epoch", None)) or any(one is f for f in found):
            continue
        epoch = getattr(one, "epoch", None)
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            kind = type(one).__name__
            raise ConfigError(
                f"ResumableLoader received a {kind} whose order follows set_epoch() but that "
                f"has no int 'epoch' attribute ({describe(epoch)}), so a position inside an "
                "epoch could not hold which epoch's order it counts in: resumed, it would "
                "continue another epoch's order. Store the epoch in set_epoch (self.epoch = "
                "epoch), or use steplib.data.resumable_loader(dataset, ..., shard=True)."
            )
        found.append(one)
    return found


def _samplers(sampler: Any, batch_sampler: Any) -> list[Any]:
    """What a loader draws its order from: its sampler, batch sampler and the latter's sampler."""
    return [sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]

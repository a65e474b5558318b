"""``Zipped``: several loaders' batches side by side, one position for all of them, resumed
exactly where a plain ``zip`` of loaders would not be."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.stateful_dataloader import Stateful

from steplib.errors import ConfigError, describe


class Zipped:
    """The batches of several loaders side by side, one tuple per step as ``zip`` gives them:
    a run over two datasets at once (two tasks, labelled and unlabelled data). Its position
    holds every loader's, so ``checkpoint_every`` and ``resume_from`` resume them all.

    ``zip`` stops at the shortest loader and leaves the others part-way. Their next pass
    starts their next epoch, as a ``DataLoader``'s always does, but their saved positions are
    part-way: resumed from a checkpoint taken then, they went on with the rest of that epoch
    where the uninterrupted run started a new one (measured: 2 batches in the resumed epoch
    instead of 6, 14 updates in the run instead of 18). So each pass ends the others' passes
    too, their last batches drawn and left unused: give them samplers as long as the
    shortest's if that costs too much.

    Args:
        *loaders: two or more loaders with ``state_dict()`` / ``load_state_dict()``
            (:func:`~steplib.data.resumable_loader`), sized or not.

    Raises:
        ConfigError: fewer than two loaders, or one without a position to save.

    Example:
        >>> import torch
        >>> from steplib.data import resumable_loader
        >>> labelled = resumable_loader(torch.arange(6), batch_size=2)
        >>> unlabelled = resumable_loader(torch.arange(10, 18), batch_size=2)
        >>> data = Zipped(labelled, unlabelled)
        >>> len(data), [len(pair) for pair in data]
        (3, [2, 2, 2])
    """

    def __init__(self, *loaders: Any) -> None:
        stateless = [describe(one) for one in loaders if not isinstance(one, Stateful)]
        if len(loaders) < 2 or stateless:
            found = f"{', '.join(stateless)}, without state_dict()" if stateless else "one loader"
            raise ConfigError(
                f"Zipped received {found}: it zips two or more loaders whose positions a "
                "checkpoint holds. Pass loaders of steplib.data.resumable_loader(dataset, "
                "batch_size=...)."
            )
        self.loaders = loaders

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        passes = [iter(loader) for loader in self.loaders]
        yield from zip(*passes, strict=False)  # to the shortest
        for rest in passes:  # ended, so that a position saved now is the next pass's
            for _ in rest:
                pass

    def __len__(self) -> int:
        return min(len(loader) for loader in self.loaders)

    @property
    def resumed_at(self) -> int:
        """The batches of the epoch its next pass follows (``run`` counts from there)."""
        return min(getattr(loader, "resumed_at", 0) for loader in self.loaders)

    @property
    def epoch_completed_on_load(self) -> bool:
        """Whether the position loaded last was the end of a pass (the shortest loader's)."""
        return any(getattr(loader, "epoch_completed_on_load", False) for loader in self.loaders)

    def state_dict(self) -> dict[str, Any]:
        return {"loaders": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        positions = state_dict["loaders"]
        if len(positions) != len(self.loaders):
            raise ConfigError(
                f"Zipped.load_state_dict received the positions of {len(positions)} loaders; "
                f"this one zips {len(self.loaders)}. Zip the loaders the saving run zipped."
            )
        for loader, position in zip(self.loaders, positions, strict=True):
            loader.load_state_dict(position)
        if self.epoch_completed_on_load:  # saved after the pass's last batch: end it here too
            for loader in self.loaders:
                if not getattr(loader, "epoch_completed_on_load", False):
                    for _ in loader:
                        pass

"""``checkpoint_every``: build the checkpoint handler (a :class:`Checkpointer`), checking its
settings, among them how often it saves: every N updates (``every``) and/or every N epochs
(``epochs``; ``at_epoch_end=True`` is ``epochs=1``).

Imports ``errors``, ``events`` and the checkpoint package only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steplib import errors
from steplib.cadence import Batches, check_every
from steplib.checkpoint.handlers import Checkpointer
from steplib.checkpoint.listing import StorageOptions
from steplib.checkpoint.metrics import Metrics
from steplib.checkpoint.retention import check_retention
from steplib.checkpoint.saving import check_durable
from steplib.errors import ConfigError, describe


def checkpoint_every(
    directory: str,
    *,
    every: int | Batches | None = None,
    epochs: int | None = None,
    at_epoch_end: bool = False,
    keep_last: int | None = None,
    keep_best: int | None = None,
    metric: Any = None,
    mode: str | None = None,
    data: Any = None,
    extras: Mapping[str, Any] | None = None,
    step: Any = None,
    metrics: Metrics | None = None,
    background: bool = False,
    at_end: bool = True,
    storage_options: StorageOptions = None,
    durable: bool = True,
) -> Checkpointer:
    """A handler that saves a checkpoint every ``every`` optimizer updates and/or at the end of
    every ``epochs``-th epoch.

    Each committed checkpoint is reported to the handlers of ``checkpoint_end``, with its
    ``CheckpointInfo`` in ``event.checkpoint`` (see :class:`Checkpointer` for when).

    Args:
        directory: a local path or fsspec URL of the directory of checkpoints.
        every: save when ``state.step`` is a multiple of this (an int >= 1), every n batches
            with ``Batches(n)`` (at the update holding the n-th batch), or ``None``.
        epochs: save at the end of an epoch when ``state.epoch`` (completed epochs) is a
            multiple of this (an int >= 1), or ``None``. With ``every`` too, both cadences
            save (an update saved by one is not saved again by the other).
        at_epoch_end: ``True`` is ``epochs=1``: save at the end of every epoch.
        keep_last: after each save keep the newest this many (``None``: keep all).
        keep_best: also keep the best this many by ``metric``.
        metric: the metric ``keep_best`` ranks by (one of those ``metrics`` returns), or the
            ``Evaluator`` that monitors it (its name and mode); every save checks that it is
            there, before anything is written or pruned.
        mode: ``"min"`` (default) or ``"max"``: whether lower or higher ``metric`` is better.
        data: the loader whose position to save (see ``steplib.data.resumable_loader``).
        extras: more objects with ``state_dict()`` to save by name.
        step: the Step; its composition is saved and checked on resume.
        metrics: ``event -> {name: number}`` recorded with each checkpoint; by default the
            update's ``loss`` and the numbers in ``state.extras`` (:func:`default_metrics`).
        background: write in a background thread (:class:`AsyncSaver`); training waits only
            for the copy of buffers and small states to CPU memory (the parameters and
            optimizer state are copied while the next forward and backward run). Errors
            surface at the next save or at ``fit_end``.
        at_end: also save at ``fit_end`` if the state changed since the last save.
        storage_options: passed to fsspec.
        durable: fsync each checkpoint before it counts as saved (see ``save``); ``False`` is
            faster, and a power loss soon after a save may lose that newest checkpoint.

    When the run starts (``fit_start``), the handler checks that ``directory`` can be
    written and removes what a killed save left there (``.tmp-*`` staging directories,
    uncommitted checkpoints; rank 0 alone on several ranks); each save removes them too.

    Returns:
        A :class:`Checkpointer`; call ``.attach(events)``.

    Raises:
        ConfigError: ``every`` is not an int >= 1, ``durable`` not a bool, or invalid
            retention settings; at a scheduled save (the first at the latest, before anything
            is written or pruned), a ``metric`` that the checkpoint's metrics do not hold (the
            message lists those they hold).
        CheckpointError: at ``fit_start``, ``directory`` cannot be created or written.

    Example:
        >>> import torch
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> from steplib.checkpoint import list_checkpoints
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> step = make_train_step(lambda m, b: m(b).pow(2).mean())
        >>> events = checkpoint_every("memory://doctest-every/ckpt", every=2, keep_last=2,
        ...                           step=step).attach(Events())
        >>> state = run(step, state, [torch.ones(4, 2)] * 5, events=events)
        >>> [c.step for c in list_checkpoints("memory://doctest-every/ckpt")]
        [4, 5]
    """
    epochs = check_cadence(every, epochs, at_epoch_end)
    # A name typed by hand may be misspelt: a scheduled save refuses it when it is missing. An
    # evaluator's own name is not, and is missing only before its first evaluation.
    typed = isinstance(metric, str)
    if metric is not None:
        metric, mode = errors.monitor_and_mode("checkpoint_every", metric, mode)
    mode = mode or "min"
    check_retention(
        "checkpoint_every", keep_last=keep_last, keep_best=keep_best, metric=metric, mode=mode
    )
    check_durable(durable, "checkpoint_every")
    return Checkpointer(
        directory,
        every=every,
        epochs=epochs,
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        mode=mode,
        data=data,
        extras=extras,
        step=step,
        metrics=metrics,
        background=background,
        at_end=at_end,
        storage_options=storage_options,
        durable=durable,
        check_metric=typed,
    )


def check_cadence(every: Any, epochs: Any, at_epoch_end: Any) -> int | None:
    """The epoch cadence of ``checkpoint_every``: ``epochs``, or 1 for ``at_epoch_end=True``.

    Args:
        every: the update cadence (``None`` or an int >= 1).
        epochs: the epoch cadence (``None`` or an int >= 1).
        at_epoch_end: ``True`` is ``epochs=1``.

    Returns:
        The epoch cadence, or ``None`` for none.

    Raises:
        ConfigError: no cadence, a cadence that is not an int >= 1, ``at_epoch_end`` not a
            bool, or both ``at_epoch_end=True`` and ``epochs``.

    Example:
        >>> check_cadence(None, None, True), check_cadence(500, 2, False)
        (1, 2)
    """
    if at_epoch_end is not False and at_epoch_end is not True:
        raise ConfigError(
            f"checkpoint_every(at_epoch_end=...) received {describe(at_epoch_end)}; pass True "
            "(save at every epoch end) or False, or epochs=N for every N epochs."
        )
    if at_epoch_end and epochs is not None:
        raise ConfigError(
            f"checkpoint_every received at_epoch_end=True (every epoch) and epochs={epochs!r} "
            "(every that many epochs), which contradict each other. Pass one: epochs=1 is "
            "at_epoch_end=True."
        )
    if at_epoch_end:
        epochs = 1
    if every is None and epochs is None:
        raise ConfigError(
            "checkpoint_every received no cadence (every=None), so it would never save. Pass "
            "every=500 (optimizer updates between checkpoints), epochs=1 (every epoch end; "
            "at_epoch_end=True is the same), or both."
        )
    check_every("checkpoint_every(every=...)", every)
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        raise ConfigError(
            f"checkpoint_every(epochs=...) received {describe(epochs)}; it is the number of "
            "epochs between checkpoints and must be an int >= 1, e.g. epochs=2."
        )
    return epochs

"""Model export: the weights only, in one file, loadable without steplib.

A checkpoint (``steplib.checkpoint``) is for resuming: optimizer, counters, RNG and data
position, possibly sharded. An export is for using the model: one file holding
``model.state_dict()`` with the names of the plain module (no DDP ``module.`` or
``torch.compile`` ``_orig_mod.`` prefixes), gathered from every FSDP2 shard, on CPU::

    export_model(state, "runs/exp/model.safetensors", format="safetensors")

    # anywhere, with torch (and safetensors) only:
    model.load_state_dict(torch.load("model.pt", weights_only=True))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

:func:`export_best` is the handler that exports only when a monitored value improves, next to
(and independent of) ``checkpoint_every``'s own retention.

Imports ``state``, ``events``, ``handlers.watched_value``, ``handlers.evaluation``, ``distributed``
and the checkpoint package's storage (never ``loop`` or ``step``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steplib import errors
from steplib.checkpoint.storage import Location, resolve
from steplib.distributed import rank, world_size
from steplib.distributed.collectives import every_rank
from steplib.distributed.parallelize import inner_module
from steplib.errors import ConfigError, ExportError, describe
from steplib.events import Event
from steplib.handlers.evaluation import Evaluator
from steplib.handlers.full_weights import exported_module, full_state_dict
from steplib.handlers.watched_value import BestValue, monitored_value
from steplib.state import TrainState

FORMATS = ("torch", "safetensors")


def export_model(
    state: TrainState | nn.Module,
    url: str,
    *,
    format: str = "torch",
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write the model's weights (``state_dict``: parameters and buffers) to one file.

    With several ranks every rank must call it (FSDP2 shards and pipeline stages are
    gathered onto rank 0 with a collective: see :func:`full_state_dict`); rank 0 writes, and
    every rank returns once the file is complete. A local file is written under a temporary
    name and renamed, so a reader never sees half a file; on object stores
    the upload is committed when it completes.

    Args:
        state: a ``TrainState`` (its model is exported) or a module; DDP, FSDP2 and
            ``torch.compile`` wrappers are looked through.
        url: the file: a local path or an fsspec URL (``s3://bucket/model.safetensors``).
        format: ``"torch"`` (``torch.save`` of a dict of tensors; load it with
            ``torch.load(path, weights_only=True)``) or ``"safetensors"`` (load with
            ``safetensors.torch.load_file``; needs ``pip install 'steplib[safetensors]'``).
            Tensors that share memory (tied weights) are written once each in safetensors.
        storage_options: passed to fsspec.

    Returns:
        The URL written.

    Raises:
        ConfigError: an unknown ``format``, safetensors not installed, a bad ``url`` or
            ``state``.
        ExportError: the write failed (raised on every rank).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> url = export_model(model, "memory://doctest-export/model.pt")
        >>> import fsspec
        >>> with fsspec.open(url, "rb") as f:
        ...     weights = torch.load(f, weights_only=True)
        >>> sorted(weights), torch.equal(weights["weight"], model.weight)
        (['bias', 'weight'], True)
    """
    _check_format("export_model", format)
    location = resolve(url, storage_options, caller="export_model")
    model = exported_module(state)
    tensors = full_state_dict(model)  # a collective: every rank is here
    error: BaseException | None = None
    if rank() == 0:
        try:
            _write(location, tensors, format)
        except Exception as err:  # reported to every rank below, raised here after
            error = err
    if not every_rank(error is None, device=_device_of(model)):
        if error is not None:
            raise ExportError(
                f"export_model could not write {location.url}: {error}. Check that the "
                "location is writable (permissions, credentials, free space)."
            ) from error
        raise ExportError(
            f"export_model: rank 0 could not write {location.url} (its error says why)."
        )
    return location.url


def _check_format(owner: str, format: Any) -> None:
    if format not in FORMATS:
        raise ConfigError(
            f"{owner}(format=...) received {describe(format)}; the formats are 'torch' "
            "(torch.load(path, weights_only=True)) and 'safetensors' "
            "(safetensors.torch.load_file). Pass e.g. format='safetensors'."
        )
    if format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as err:
            raise ConfigError(
                f"{owner}(format='safetensors') needs the safetensors package, which is not "
                f"installed ({err}). Install the extra: pip install 'steplib[safetensors]', "
                "or export with format='torch'."
            ) from None


def _write(location: Location, tensors: dict[str, torch.Tensor], format: str) -> None:
    parent = location.path.rsplit("/", 1)[0] if "/" in location.path else ""
    if parent:
        location.fs.makedirs(parent, exist_ok=True)
    if not location.is_local:  # object stores: the object appears when the upload completes
        with location.fs.open(location.path, "wb") as file:
            if format == "safetensors":
                import safetensors.torch

                file.write(safetensors.torch.save(_independent(tensors), {"format": "pt"}))
            else:
                torch.save(tensors, file)
        return
    # Local: a temporary name in the same directory, fsync'ed, then renamed over the target.
    temporary = f"{parent or '.'}/.tmp-{location.name}-{uuid.uuid4().hex[:8]}"
    try:
        if format == "safetensors":
            import safetensors.torch

            safetensors.torch.save_file(_independent(tensors), temporary, {"format": "pt"})
        else:
            with open(temporary, "wb") as file:
                torch.save(tensors, file)
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, location.path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(parent or ".", os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _independent(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory: safetensors refuses shared storage (tied
    weights), and a copy of each is what a reader of the file gets anyway."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        out[name] = tensor
    return out


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


class ExportBest:
    """Export the model whenever ``state.extras[monitor]`` improves. Build it with
    :func:`export_best`; register it after the evaluation handler, on the same event and
    interval (like ``EarlyStopping``), so each call sees a fresh value.

    Args:
        url: the file to (over)write: a local path or an fsspec URL.
        monitor: the name in ``state.extras`` of the value to watch.
        mode: ``"min"`` or ``"max"``: which direction is better.
        min_delta: an improvement must beat the best by more than this.
        format: ``"torch"`` or ``"safetensors"`` (see :func:`export_model`).
        storage_options: passed to fsspec, or ``None``.
        model: the module to export (``None``: ``state.model``).

    Attributes:
        best: a ``BestValue``: the best value so far (``.value``) and the step it was seen at
            (``.step``); saved and restored by :meth:`state_dict` / :meth:`load_state_dict`.

    Example:
        >>> exporter = export_best("memory://doctest-export-best/model.pt", monitor="val_loss")
        >>> exporter
        export_best('memory://doctest-export-best/model.pt', monitor='val_loss', mode='min')
        >>> exporter.best.value is None
        True
    """

    def __init__(
        self,
        url: str,
        *,
        monitor: str,
        mode: str,
        min_delta: float,
        format: str,
        storage_options: Mapping[str, Any] | None,
        model: nn.Module | None = None,
    ) -> None:
        self.url, self.monitor, self.format = url, monitor, format
        self.storage_options, self.model = storage_options, model
        self.best = BestValue(mode=mode, min_delta=min_delta)

    def __call__(self, event: Event) -> None:
        """Export ``event.state`` if the monitored value improved on the best so far."""
        value = monitored_value("export_best", self.monitor, event)
        if value is None:  # another update's score: this model was not evaluated
            return
        fix = f"Pass the evaluator's: export_best(..., mode={_other(self.best.mode)!r})."
        errors.same_mode("export_best", self.monitor, self.best.mode, event.events, fix=fix)
        # Rank 0's value decides on every rank: under FSDP2 the export is a collective, and
        # a rank that decided otherwise would leave the others waiting in it.
        value = _from_rank0(value, getattr(event.state, "device", torch.device("cpu")))
        exported = self.model if self.model is not None else event.state
        self._check_evaluated(event, exported_module(exported))
        if self.best.update(value, step=event.step):
            export_model(
                exported, self.url, format=self.format, storage_options=self.storage_options
            )

    def _check_evaluated(self, event: Event, exported: nn.Module) -> None:
        # The score must be the exported module's: an Evaluator(model=ema.module) scores the
        # average, and state.model exported under its score would be silently wrong.
        attached = event.events.attached() if event.events is not None else []
        for ev in (h for h in attached if isinstance(h, Evaluator) and h.history):
            step, values = ev.history[-1]
            evaluated = inner_module(
                exported_module(ev.model if ev.model is not None else event.state)
            )
            if step == event.step and self.monitor in values and evaluated is not exported:
                raise ConfigError(
                    f"export_best(monitor={self.monitor!r}) exports "
                    f"{'state.model' if self.model is None else 'its model='}, but the Evaluator "
                    f"recording it evaluates {'state.model' if ev.model is None else 'its model='}"
                    ": one model's file under the other's score. Export the evaluated module: "
                    "export_best(..., model=ema.module) for Evaluator(..., model=ema.module)."
                )

    def state_dict(self) -> dict[str, Any]:
        """The best value and its step, and what it watches (checked at load)."""
        return {**self._built(), "best": self.best.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ConfigError``: another value's)."""
        errors.same_handler("export_best", self._built(), state)
        self.best.load_state_dict(state["best"])

    def _built(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.best.mode}

    def __repr__(self) -> str:
        return f"export_best({self.url!r}, monitor={self.monitor!r}, mode={self.best.mode!r})"


def _other(mode: str) -> str:
    return "max" if mode == "min" else "min"


def _from_rank0(value: float, device: torch.device) -> float:
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=0)
    return float(tensor.item())


def export_best(
    url: str,
    *,
    monitor: str,
    mode: str = "min",
    min_delta: float = 0.0,
    format: str = "torch",
    storage_options: Mapping[str, Any] | None = None,
    model: nn.Module | None = None,
) -> ExportBest:
    """A handler that exports the model (:func:`export_model`) each time ``monitor`` improves.

    The file at ``url`` always holds the best model so far. Register it after the handler that
    puts ``monitor`` in ``state.extras``, on the same event and interval::

        evaluator = Evaluator(..., every=500, monitor="val_loss")
        evaluator.attach(events)
        events.on("step_end", export_best("runs/exp/best.safetensors", monitor="val_loss",
                                          format="safetensors"), every=500)

    Args:
        url: the file to (over)write: a local path or an fsspec URL.
        monitor: the name in ``state.extras`` (e.g. ``"val_loss"``, ``"ood_acc"``).
        mode: ``"min"`` or ``"max"``: which direction is better.
        min_delta: an improvement must beat the best by more than this.
        format: ``"torch"`` or ``"safetensors"`` (see :func:`export_model`).
        storage_options: passed to fsspec.
        model: the module to export, the one whose score ``monitor`` is: ``ema.module`` for an
            ``Evaluator(..., model=ema.module)``; ``None``: ``state.model``.

    Returns:
        An :class:`ExportBest` handler (``.best`` holds the best value and its step).

    Raises:
        ConfigError: a bad argument, or safetensors missing (at build time); at a call,
            ``monitor`` missing from ``state.extras`` (the message lists what is there), or
            recorded by an attached ``Evaluator`` of another module than the one exported.

    Example:
        >>> from steplib import Events, TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
        >>> def fake_eval(event):  # an evaluator would put a real value here
        ...     from steplib import NewState
        ...     extras = {"val_loss": [3.0, 1.0, 2.0][event.step - 1]}
        ...     return NewState(event.state.replace(extras=extras))
        >>> exporter = export_best("memory://doctest-best/model.pt", monitor="val_loss")
        >>> events = Events()
        >>> _ = events.on("step_end", fake_eval).on("step_end", exporter)
        >>> state = run(make_train_step(lambda m, b: m(b).sum()), state, [torch.ones(1, 2)] * 3,
        ...             events=events)
        >>> exporter.best.value, exporter.best.step
        (1.0, 2)
    """
    if not isinstance(monitor, str) or not monitor:
        raise ConfigError(
            f"export_best(monitor=...) received {describe(monitor)}; pass the name of a value "
            "in state.extras, e.g. export_best(url, monitor='val_loss')."
        )
    errors.mode("export_best", mode)
    _check_format("export_best", format)
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(
            f"export_best(model=...) received {describe(model)}; pass the module to export "
            "(e.g. ema.module, the one the evaluator evaluates) or None for state.model."
        )
    resolve(url, storage_options, caller="export_best")  # a bad URL fails now, not at a best
    return ExportBest(
        url,
        monitor=monitor,
        mode=mode,
        min_delta=min_delta,
        format=format,
        storage_options=storage_options,
        model=model,
    )

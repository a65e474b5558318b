"""``load_weights``: a model's weights only, from a checkpoint or an exported file, to start a
new run from them (fine-tuning)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from steplib import errors
from steplib.checkpoint import storage
from steplib.checkpoint.contents import MODEL
from steplib.checkpoint.manifest import SHARDED, Manifest, committed_manifest, newest_valid
from steplib.checkpoint.pipeline import read_trees
from steplib.checkpoint.restore import differences, shapes
from steplib.checkpoint.storage import Location, StorageOptions
from steplib.distributed.parallelize import holds_dtensor_parameters, inner_module
from steplib.errors import CheckpointError, CheckpointWarning, ConfigError, describe
from steplib.errors import CorruptCheckpointError as Corrupt
from steplib.state import TrainState

# What DDP and torch.compile put before the names of the module they wrap.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_ZIP = b"PK\x03\x04"  # torch.save's format is a zip archive


class LoadedWeights(_IncompatibleKeys):
    """torch's ``(missing_keys, unexpected_keys)``, with ``mismatched_keys`` (skipped shapes)."""

    mismatched_keys: list[str]

    def __new__(
        cls, missing: list[str], unexpected: list[str], mismatched: list[str]
    ) -> LoadedWeights:
        report = super().__new__(cls, missing, unexpected)
        report.mismatched_keys = mismatched
        return report

    def __repr__(self) -> str:
        # torch's says "<All keys matched successfully>" when no name differs: not when
        # weights of other shapes were skipped (a new head kept its own initialisation).
        if not self.mismatched_keys:
            return super().__repr__()
        return (
            f"LoadedWeights(missing_keys={self.missing_keys}, unexpected_keys="
            f"{self.unexpected_keys}, mismatched_keys={self.mismatched_keys})"
        )

    __str__ = __repr__


def load_weights(
    model: nn.Module | TrainState,
    source: str,
    *,
    strict: bool = True,
    ignore_mismatched_sizes: bool = False,
    storage_options: StorageOptions = None,
) -> LoadedWeights:
    """Load the weights saved at ``source`` into ``model``; the optimizer, counters, RNG and data
    stay fresh. Names saved from a DDP or ``torch.compile`` wrapper load into a plain module and
    back. FSDP2 / tensor parallel: every rank calls it.

    Args:
        model: the module, or a TrainState (its model).
        source: a checkpoint (verified first; sharded ones of any world size too), a directory
            of them (the newest valid), or a file of ``export_model``, ``torch.save`` or
            safetensors: a local path or fsspec URL.
        strict: ``False`` loads the names both have and warns with the rest.
        ignore_mismatched_sizes: ``True`` skips a weight of another shape (a new head), warns.
        storage_options: passed to fsspec.

    Returns:
        torch's ``(missing_keys, unexpected_keys)``, with ``mismatched_keys``.

    Raises:
        ConfigError: names or shapes that differ as above, or no ``state_dict`` (nothing
            changed). CorruptCheckpointError: a damaged file. CheckpointError: nothing there.

    Example:
        >>> from steplib.checkpoint import save
        >>> pretrained = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 10))
        >>> opt = torch.optim.SGD(pretrained.parameters())
        >>> url = save(TrainState.create(model=pretrained, optimizer=opt), "memory://doc-w/ckpt")
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))  # a new head comes next
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # it warns with the lists below
        ...     load_weights(model, url, strict=False)
        LoadedWeights(missing_keys=[], unexpected_keys=['1.weight', '1.bias'])
    """
    if isinstance(model, TrainState):
        model.fence.wait()  # an async save may still be copying the parameters we overwrite
        model = model.model
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"load_weights received model={describe(model)}, which is neither an nn.Module "
            "nor a TrainState. Pass the model to load into: load_weights(model, url)."
        )
    module = inner_module(model)  # DDP(compile(m)), compile(DDP(m)), ...
    choices = "True (the names must match) or False (load the names both have, report the rest)"
    errors.boolean("load_weights", "strict", strict, choices)
    choices = "False (other shapes are refused) or True (skipped, kept as the model has them)"
    errors.boolean("load_weights", "ignore_mismatched_sizes", ignore_mismatched_sizes, choices)
    location = storage.resolve(source, storage_options, caller="load_weights")
    url, weights = _read(location, storage_options)
    expected = module.state_dict()
    weights = _without_prefixes(weights, expected)
    missing, unexpected, reshaped, found = differences(
        shapes(weights), shapes(expected), "the weights"
    )
    if len(unexpected) == len(weights) and expected:
        # strict=False would load nothing: another model, or a prefix only the user can map.
        raise ConfigError(
            f"load_weights: {url} has no weight whose name this {type(module).__name__} has "
            f"({found}). Pass this model's weights, or rename them yourself: load_state_dict."
        )
    fixes = []
    if strict and (missing or unexpected):
        fixes.append("strict=False to load the names both have (a new head keeps its own)")
    if reshaped and not ignore_mismatched_sizes:
        fixes.append(
            "ignore_mismatched_sizes=True to skip those of other shapes (or load, then set "
            "model.head = nn.Linear(...))"
        )
    if fixes:
        raise ConfigError(
            f"load_weights: {url} holds weights for another {type(module).__name__}: {found}. "
            f"Pass {', or '.join(fixes)}; or build the saved model."
        )
    shared = {k: v for k, v in weights.items() if k in expected and k not in reshaped}
    if holds_dtensor_parameters(module):  # FSDP2 / tensor parallel: each rank keeps its shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(module, shared, options=options)
    else:
        module.load_state_dict(shared, strict=False)
    if found:
        warnings.warn(
            f"load_weights from {url}: {found}; kept as the model has them.",
            CheckpointWarning,
            stacklevel=2,
        )
    return LoadedWeights(missing, unexpected, reshaped)


def _read(location: Location, storage_options: StorageOptions) -> tuple[str, dict[str, Any]]:
    if location.fs.isfile(location.path):
        return location.url, _read_file(location)
    manifest = committed_manifest(location)
    if manifest is not None:
        return location.url, _read_checkpoint(location, manifest, storage_options)
    found = newest_valid(location, lambda c, m: _read_checkpoint(c, m, storage_options))
    if isinstance(found, tuple):
        return found
    if found:
        raise Corrupt(
            f"load_weights: every checkpoint in {location.url} is corrupt ({', '.join(found)}; "
            "the warnings say why). Restore one from a copy, or pass another checkpoint or file."
        )
    raise CheckpointError(
        f"load_weights received {location.url!r}: no checkpoint, directory of checkpoints or file "
        "there. Pass a checkpoint (latest(dir)), a directory of them, or an export_model file."
    )


def _read_checkpoint(
    location: Location, manifest: Manifest, storage_options: StorageOptions
) -> dict[str, Any]:
    if manifest.layout == SHARDED:
        from steplib.checkpoint import dcp  # imported on use: ~0.8 s

        return dcp.read_model(location, manifest, storage_options)
    # Mapped from a local disk: the file is never held twice in memory.
    return _state_dict(read_trees(location, manifest, only=MODEL, mmap=True)[MODEL], location.url)


def _read_file(location: Location) -> dict[str, Any]:
    with location.fs.open(location.path, "rb") as file:
        head = file.read(len(_ZIP))
    local = location.is_local
    try:
        if head != _ZIP:
            import safetensors.torch  # an export of format="safetensors"

            tree = safetensors.torch.load(storage.read_bytes(location))
        else:
            source = location.path if local else io.BytesIO(storage.read_bytes(location))
            tree = torch.load(source, map_location="cpu", weights_only=True, mmap=local)
    except ImportError as err:
        raise ConfigError(
            f"load_weights: {location.url} is not a torch.save file; as a safetensors file it "
            f"needs that package ({err}): pip install 'steplib[safetensors]'."
        ) from None
    except Exception as err:  # UnpicklingError, RuntimeError, SafetensorError...
        raise ConfigError(
            f"load_weights: {location.url} cannot be read as a torch.save file (weights_only) or "
            f"a safetensors file ({type(err).__name__}: {err}). Pass an export_model file."
        ) from None
    return _state_dict(tree, location.url)


def _state_dict(tree: Any, url: str) -> dict[str, Any]:
    named = isinstance(tree, Mapping) and all(isinstance(k, str) for k in tree) and bool(tree)
    weights = named and all(
        torch.is_tensor(v) or k.endswith("_extra_state") for k, v in tree.items()
    )
    if not weights:
        keys = sorted(map(str, tree))[:20] if isinstance(tree, Mapping) else None
        raise ConfigError(
            f"load_weights: {url} holds {describe(tree)}{f' with the keys {keys}' if keys else ''},"
            " not a state_dict (names -> tensors). Save one with export_model(state, path), or "
            "call model.load_state_dict with what it holds (a Lightning checkpoint's 'state_dict')."
        )
    return dict(tree)


def _without_prefixes(weights: dict[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    while weights:
        prefix = next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in weights)), None)
        # A model whose own first submodule is named "module" keeps its names.
        if prefix is None or all(k.startswith(prefix) for k in expected):
            break
        weights = {k[len(prefix) :]: v for k, v in weights.items()}
    return weights

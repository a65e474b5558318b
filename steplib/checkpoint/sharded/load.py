"""Loading a sharded checkpoint (see ``steplib.checkpoint.sharded`` for what it holds):
verified by all ranks together, checked against the state before anything changes, resharded
by DCP into any world size or a plain module.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from steplib.checkpoint import checksummed, storage
from steplib.checkpoint.contents import read_tree
from steplib.checkpoint.manifest import Manifest
from steplib.checkpoint.restore import (
    check_fingerprint,
    check_model,
    check_optimizer,
    check_train_state,
    lane_trees,
    restore_train_state,
)
from steplib.checkpoint.sharded.dcp_io import (
    MetadataReader,
    dcp_errors,
    merge,
    no_dist_warning_silenced,
    split,
)
from steplib.checkpoint.sharded.layout import (
    DCP_DIR,
    DISTRIBUTION_WRAPPERS,
    is_sharded,
    keeps_window_grads,
    rank_file,
)
from steplib.checkpoint.sharded.optimizers import (
    by_name,
    check_names,
    keyed,
    load_hyperparameters,
    unkeyed,
)
from steplib.checkpoint.storage import Location
from steplib.data.shards import check_new_world
from steplib.errors import ConfigError, CorruptCheckpointError
from steplib.state import TrainState


def load_sharded(
    location: Location,
    manifest: Manifest,
    state: TrainState,
    *,
    data: Any,
    extras: Mapping[str, Any],
    step: Any,
    storage_options: Mapping[str, Any] | None,
) -> TrainState:
    """Load a verified sharded checkpoint into ``state`` (see ``steplib.checkpoint.load``).

    For a DDP, FSDP2 or DTensor state every rank must call it (it is a collective); a plain module
    loads in this process alone.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or altered (named; every rank
            raises it).
        ConfigError: the checkpoint does not fit ``state``, or per-rank state (a data
            position without ``shard=True``, an open window) is asked for on another world
            size, or a sharded data position this loader cannot continue exactly.
    """
    url = location.url
    check_fingerprint(manifest.fingerprint, step, checkpoint=url, ignore=DISTRIBUTION_WRAPPERS)
    # Collectives only for a DDP/FSDP2/DTensor state, whose ranks all load together; a plain module
    # loads alone (e.g. on rank 0 only, for evaluation), even inside a distributed job.
    distributed = is_sharded(state)
    me = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    _verify(location, manifest, me=me, world=world)

    same_world = world == manifest.world_size
    own = rank_file(me if same_world else 0)
    if own not in manifest.files:
        raise CorruptCheckpointError(
            f"checkpoint {url}: its manifest lists no {own} although it was written by "
            f"{manifest.world_size} ranks; it was not written by steplib's save. Use another "
            "checkpoint."
        )
    rank_tree = _read_rank_file(location.child(own), url)
    train_state = rank_tree["train_state"]
    infos = unkeyed(rank_tree)
    check_names(infos, state, checkpoint=url)
    optimizers = by_name(state)
    trees = lane_trees(train_state, state)
    for name, info in infos.items():
        check_optimizer(
            trees[name]["optimizer_type"], info["group_sizes"], optimizers[name], checkpoint=url
        )
    check_train_state(train_state, state, data=data, extras=extras, checkpoint=url)
    opened = any(tree["counters"]["window_size"] > 0 for tree in trees.values())
    _check_placement(
        manifest,
        state,
        data=data,
        position=train_state["data"],
        world=world,
        opened=opened,
        checkpoint=url,
    )
    if not same_world and _holds_dtensor(train_state["objects"]):
        raise ConfigError(
            f"load(extras=...): checkpoint {url} was written by {manifest.world_size} ranks "
            f"and is loaded on {world}; its extra objects hold sharded tensors (DTensor, e.g. "
            "an EMA of an FSDP2 model), saved per rank, which steplib cannot reshard. Resume "
            f"on {manifest.world_size} ranks."
        )

    model = state.model
    with_state = {name for name, info in infos.items() if info["has_state"]}
    target = {
        "model": get_model_state_dict(model),
        **keyed(
            {
                name: get_optimizer_state_dict(model, optimizer) if name in with_state else {}
                for name, optimizer in optimizers.items()
            }
        ),
    }
    tensors, _ = split(target)
    reader_url = location.child(DCP_DIR).url
    _check_keys(
        MetadataReader(reader_url, **dict(storage_options or {})), tensors, state, checkpoint=url
    )
    with dcp_errors("read", url), no_dist_warning_silenced():
        dcp.load(
            tensors,
            storage_reader=MetadataReader(reader_url, **dict(storage_options or {})),
            no_dist=not distributed,
        )
    loaded = merge(tensors, rank_tree["plain"])
    set_model_state_dict(model, loaded["model"])
    for name, saved in unkeyed(loaded).items():
        if name in with_state:
            set_optimizer_state_dict(model, optimizers[name], saved)
        else:
            load_hyperparameters(optimizers[name], infos[name]["groups"])
    return restore_train_state(
        train_state,
        state,
        data=data,
        extras=extras,
        grads=rank_tree["window_grads"] or {},
        restore_rng_states=same_world,
    )


def _verify(location: Location, manifest: Manifest, *, me: int, world: int) -> None:
    """Check every file against the manifest, each rank a share of them; every rank raises
    the same ``CorruptCheckpointError`` (naming the file) when any rank found one."""
    names = sorted(manifest.files)
    error = None
    for name in names[me::world]:
        try:
            checksummed.verify(location.child(name), manifest.files[name], checkpoint=location.url)
        except CorruptCheckpointError as err:
            error = str(err)
            break
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    found = [e for e in errors if e is not None]
    if found:
        raise CorruptCheckpointError(found[0])


def _holds_dtensor(tree: Any) -> bool:
    if isinstance(tree, DTensor):
        return True
    if isinstance(tree, Mapping):
        return any(_holds_dtensor(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return any(_holds_dtensor(v) for v in tree)
    return False


def _read_rank_file(location: Location, checkpoint: str) -> dict[str, Any]:
    source: Any = location.path if location.is_local else io.BytesIO(storage.read_bytes(location))
    tree: dict[str, Any] = read_tree(source, checkpoint, location.name)
    return tree


def _check_placement(
    manifest: Manifest,
    state: TrainState,
    *,
    data: Any,
    position: Any,
    world: int,
    opened: bool,
    checkpoint: str,
) -> None:
    """Refuse what cannot move to another world size or distribution (before any change);
    ``opened``: some optimizer's accumulation window was open at the save."""
    saved = manifest.world_size
    if world != saved and data is not None:
        # Only a sharded loader's position (samples consumed by all ranks) means the same on
        # every world size; rank 0's file holds it, as every rank's does.
        check_new_world(
            data, position, saved_world_size=saved, world_size=world, checkpoint=checkpoint
        )
    if opened and (world != saved or not keeps_window_grads(state.model)):
        raise ConfigError(
            f"load: checkpoint {checkpoint} was taken inside an open accumulation window by "
            f"{saved} DDP ranks, whose unsynchronised gradients only fit {saved} DDP ranks "
            f"(here {world} rank(s), a {type(state.model).__name__}). Resume it as it was "
            "saved, or use a checkpoint taken between windows."
        )


def _check_keys(
    reader: Any, tensors: Mapping[str, Any], state: TrainState, *, checkpoint: str
) -> None:
    """Compare the tensors the state needs with those DCP's metadata lists, before loading
    (DCP itself would fail half-way, on the first missing one)."""
    try:
        metadata = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise CorruptCheckpointError(
            f"checkpoint {checkpoint}: its file {DCP_DIR}/.metadata cannot be read ({err}), "
            "although its checksum passes. Use another checkpoint."
        ) from None
    saved = {
        key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
    }
    needed = _flatten(tensors)
    check_model(
        {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")},
        {k[len("model.") :]: v for k, v in needed.items() if k.startswith("model.")},
        model_type=type(state.model).__name__,
        checkpoint=checkpoint,
        hint=(
            "use load_weights(state, url, strict=False) (the weights only, with a fresh "
            "optimizer, as to fine-tune)"
        ),
    )
    missing = sorted(
        k for k in needed if k.startswith(("optimizer.", "optimizers.")) and k not in saved
    )
    if missing:
        raise ConfigError(
            f"load: checkpoint {checkpoint} holds no optimizer state for "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Build the "
            "optimizer with the settings of the run that saved it (e.g. the same momentum)."
        )


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, tuple[int, ...]]:
    # The dotted names DCP gives nested dicts, with global shapes (a DTensor's .shape).
    out: dict[str, tuple[int, ...]] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value.shape)
    return out

"""The DCP back-end for a sharded state: ``dcp/`` holds the model and optimizer tensors (DCP
reshards them on load), ``rank-0000N.pt`` each rank's train state and the non-tensor rest (DCP
would pickle them). Its ``.metadata`` is read by an unpickler that builds DCP's records only."""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import state_dict as sd
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from steplib.checkpoint import contents, restore, storage
from steplib.checkpoint.contents import DCP_DIR, holds_only_ddp, is_sharded, lanes, rank_file
from steplib.checkpoint.pipeline import Checkpoints, Plan, read_trees
from steplib.checkpoint.storage import FileRecord, Location
from steplib.data.shards import check_new_world
from steplib.distributed.parallelize import is_parallel_model
from steplib.errors import CheckpointError, ConfigError, CorruptCheckpointError, listed
from steplib.seeding import warn_rng_not_restored
from steplib.state import TrainState

try:  # re-exported by torch.distributed.checkpoint up to torch 2.12, private module since
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the torch version
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

Tree = dict[str, Any]


class _ChecksumFileSystem:
    """An ``FsspecWriter``'s filesystem recording each file written by name (a rename too)."""

    def __init__(self, inner: Any, records: MutableMapping[str, FileRecord]) -> None:
        self.inner, self.records = inner, records

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = storage.ChecksumFile(raw)
            yield stream
        self.records[os.path.basename(os.fspath(path))] = stream.record()

    def rename(self, path: Any, new_path: Any) -> None:
        self.inner.rename(path, new_path)
        if record := self.records.pop(os.path.basename(os.fspath(path)), None):
            self.records[os.path.basename(os.fspath(new_path))] = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class MetadataReader(FsspecReader):
    """DCP's ``FsspecReader`` whose ``.metadata`` unpickler refuses anything but DCP's records."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # The body of FileSystemReader.read_metadata, with pickle.load replaced.
        this: Any = self
        path = this._get_metadata_path(kwargs.get("rank"))
        with this.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = this.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        found = getattr(dcp_metadata, name, None)  # the records and enums defined there
        record = isinstance(found, type) and found.__module__ == module == dcp_metadata.__name__
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        kind = module == "torch" and isinstance(getattr(torch, name, None), kinds)
        if not (record or kind or (module, name) in self._ALLOWED):
            raise pickle.UnpicklingError(
                f"DCP's .metadata names {module}.{name}, which is none of DCP's records; steplib "
                "runs no code from a checkpoint. Use a checkpoint written by steplib's save."
            )
        return super().find_class(module, name)


def leaves(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """The leaves of nested dicts by their path of keys (an empty dict and a list are leaves)."""
    out = {}
    for key, value in tree.items():
        here = (*path, key)
        if isinstance(value, dict) and value:
            out.update(leaves(value, here))
        else:
            out[here] = value
    return out


def nest(flat: Mapping[tuple[str, ...], Any]) -> Tree:
    """The inverse of :func:`leaves`."""
    out: Tree = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _saved_plain(rank_tree: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    # The non-tensor leaves of a rank file, stored as [path, value] pairs (no tuple keys there).
    return {tuple(path): value for path, value in rank_tree["plain"]}


def tensors_of(flat: Mapping[tuple[str, ...], Any]) -> Tree:
    """The tensor leaves by the dotted names DCP gives them; only they go through DCP."""
    return {".".join(path): v for path, v in flat.items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def dcp_errors(action: str, url: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (the same on every rank) as a ``CheckpointError``."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", "torch.distributed is disabled, unavailable or uninitialized"
            )
            yield
    except CheckpointException as err:
        failures = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}"
            for rank, error in sorted(getattr(err, "failures", {}).items())
        )
        raise CheckpointError(
            f"torch.distributed.checkpoint could not {action} {url} ({failures or err}). Check "
            "that every rank reaches it (one shared filesystem or object store), its permissions "
            "and free space."
        ) from None


def gather(
    state: TrainState, *, data: Any, extras: Mapping[str, Any], caller: str
) -> tuple[Tree, Tree]:
    """``(files, tensors)``: this rank's file and DCP's tensors, live."""
    model, every = state.model, lanes(state)
    open_window = max(lane.window.size for lane in every)
    if open_window > 0 and not holds_only_ddp(model):
        # FSDP2 keeps them in its parameter groups; tensor parallel's are bound to the mesh.
        fsdp = any(is_parallel_model(m) for m in model.modules())
        kind = "an FSDP2" if fsdp else "a tensor-parallel (DTensor)"
        raise ConfigError(
            f"{caller}: the state is inside an open accumulation window ({open_window} "
            f"micro-batches done) of {kind} model, whose unsynchronised gradients cannot be "
            "saved. Save between windows (checkpoint_every and preemption() do)."
        )
    # get_optimizer_state_dict steps an empty optimizer once with lr=0 (Adam's step count
    # changes): before its first update only its settings are saved. One DCP state holds every
    # optimizer that has state (their parameters are disjoint).
    stateful = [lane.optimizer for lane in every if lane.optimizer.state]
    optim_sd = sd.get_optimizer_state_dict(model, stateful) if stateful else {}
    flat = leaves({"model": sd.get_model_state_dict(model), "optimizer": optim_sd})
    rank_tree = contents.train_state_tree(state, data=data, extras=extras)
    rank_tree.update(
        plain=[[list(p), v] for p, v in flat.items() if not isinstance(v, torch.Tensor)],
        # The dotted DCP key of a model tensor inside a value (a dict extra state) cannot be
        # split back into its path: read_model reads the path here.
        nested=[
            list(p)
            for p, v in flat.items()
            if isinstance(v, torch.Tensor) and p[0] == "model" and len(p) > 2
        ],
        fresh_groups=[_settings(lane.optimizer) for lane in every],
    )
    name = rank_file(dist.get_rank())
    contents.check_plain(rank_tree, name)
    return {name: rank_tree}, tensors_of(flat)


def _settings(optimizer: Any) -> list[dict[str, Any]] | None:
    # What an optimizer before its first update is (DCP saves only those with state).
    if optimizer.state:
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def write(plan: Plan, staging: Location, *, group: Any) -> dict[str, FileRecord]:
    """DCP writes this rank's shard of ``plan.tensors``; the records of its files."""
    if dist.get_rank(group) == 0 and not staging.is_local:  # an older save's, in place
        with contextlib.suppress(FileNotFoundError):
            staging.fs.rm(staging.child(DCP_DIR).path, recursive=True)
    writer: Any = FsspecWriter(  # its attributes are untyped (torch's mypy: ignore-errors)
        staging.child(DCP_DIR).url,
        overwrite=False,  # an old .metadata means two saves
        # An object store's files have no fsync; DCP would call os.sync() for each instead.
        sync_files=plan.given.durable and staging.is_local,
        **dict(plan.given.storage_options or {}),
    )
    written: dict[str, FileRecord] = {}
    writer.fs = _ChecksumFileSystem(writer.fs, written)
    with dcp_errors("write", plan.url):
        # Replicated tensors from rank 0: DDP's buffers (BatchNorm's statistics) differ by rank
        # and rank 0's are those DDP broadcasts at the next forward; DCP's default writes the
        # copy of whichever rank has written least.
        planner = torch_dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        torch_dcp.save(plan.tensors, storage_writer=writer, process_group=group, planner=planner)
    return {f"{DCP_DIR}/{name}": record for name, record in written.items()}


def load(
    location: Location, manifest: Any, state: TrainState, given: Checkpoints, extras: Any
) -> TrainState:
    """Load a sharded checkpoint into ``state``, verified and checked first (see ``load``): a
    collective for a sharded state."""
    url, data, options = location.url, given.data, dict(given.storage_options or {})
    distributed = is_sharded(state)
    me = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    storage.verify_all(location, manifest.files, me=me, world=world)
    same_world = world == manifest.world_size
    name = rank_file(me if same_world else 0)
    train_state = read_trees(location, manifest, only=name)[name]
    restore.check_fits(train_state, state, data=data, extras=extras, checkpoint=url)
    saved = manifest.world_size
    if not same_world and data is not None:  # only a shard=True loader's position moves
        check_new_world(
            data, train_state["data"], saved_world_size=saved, world_size=world, checkpoint=url
        )
    windows = [
        t["counters"]["window_size"] for t in restore.lane_trees(train_state, state).values()
    ]
    if any(windows) and (not same_world or not holds_only_ddp(state.model)):  # any optimizer's
        raise ConfigError(
            f"load: checkpoint {url} was taken inside an accumulation window by {saved} DDP "
            f"ranks, whose unsynchronised gradients fit only those (here {world} rank(s), a "
            f"{type(state.model).__name__}). Resume it so, or use one taken between windows."
        )
    if not same_world and _holds_dtensor(train_state["objects"]):
        raise ConfigError(
            f"load(extras=...): checkpoint {url} of {saved} ranks, loaded on {world}, holds "
            "extra objects with DTensors (an EMA of an FSDP2 model), saved per rank, which "
            f"steplib cannot reshard. Resume on {saved} ranks."
        )
    model, pairs = state.model, list(zip(lanes(state), train_state["fresh_groups"], strict=True))
    stateful = [lane.optimizer for lane, groups in pairs if groups is None]
    optim_sd = sd.get_optimizer_state_dict(model, stateful) if stateful else {}
    flat = leaves({"model": sd.get_model_state_dict(model), "optimizer": optim_sd})
    tensors = tensors_of(flat)
    _check_keys(read_metadata(location, options), tensors, state, url)
    with dcp_errors("read", url):  # into the state's own tensors
        torch_dcp.load(tensors, storage_reader=reader(location, options), no_dist=not distributed)
    tensors_by_path = {p: v for p, v in flat.items() if isinstance(v, torch.Tensor)}
    loaded = nest({**_saved_plain(train_state), **tensors_by_path})
    sd.set_model_state_dict(model, loaded["model"])
    if stateful:
        sd.set_optimizer_state_dict(model, stateful, loaded["optimizer"])
    for lane, groups in pairs:
        if groups is not None:  # saved before its first update: the groups' settings alone
            now = lane.optimizer.state_dict()["param_groups"]  # the parameters' indices
            named = [dict(g, params=n["params"]) for g, n in zip(groups, now, strict=True)]
            lane.optimizer.load_state_dict({"state": {}, "param_groups": named})
    if not same_world:  # each saving rank's generators: none maps onto a rank here
        warn_rng_not_restored(saved_world_size=saved, world_size=world, checkpoint=url)
    return restore.restore_train_state(train_state, state, data=data, extras=extras, rng=same_world)


def _holds_dtensor(tree: Any) -> bool:
    values = tree.values() if isinstance(tree, Mapping) else tree
    if isinstance(tree, Mapping | list | tuple):
        return any(_holds_dtensor(v) for v in values)
    return isinstance(tree, DTensor)


def _check_keys(
    metadata: Any, tensors: Mapping[str, Any], state: TrainState, checkpoint: str
) -> None:
    """Compare the tensors needed with DCP's metadata first (DCP would fail half-way)."""
    saved = {
        key: tuple(entry.size) if isinstance(entry, dcp_metadata.TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
    }
    needed = {key: tuple(value.shape) for key, value in tensors.items()}
    restore.check_model(
        {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")},
        {k[len("model.") :]: v for k, v in needed.items() if k.startswith("model.")},
        model_type=type(state.model).__name__,
        checkpoint=checkpoint,
    )
    missing = sorted(k for k in needed if k.startswith("optimizer.") and k not in saved)
    if missing:
        raise ConfigError(
            f"load: checkpoint {checkpoint} holds no optimizer state for "
            f"{listed(missing)}. Build the optimizer as the saving run did (same momentum)."
        )


def read_model(location: Location, manifest: Any, storage_options: Any) -> Tree:
    """``model.state_dict()`` as saved, whole, on the CPU, verified; no collective."""
    storage.verify_all(location, manifest.files)
    metadata = read_metadata(location, storage_options)
    # Whole tensors to read into: DCP assembles them from the shards of every rank.
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }
    with dcp_errors("read", location.url):
        torch_dcp.load(tensors, storage_reader=reader(location, storage_options), no_dist=True)
    name = rank_file(0)
    saved = read_trees(location, manifest, only=name)[name]
    paths = {".".join(path): tuple(path) for path in saved.get("nested", ())}
    by_path = {paths.get(key, tuple(key.split(".", 1))): v for key, v in tensors.items()}
    return nest({**_saved_plain(saved), **by_path}).get("model", {})


def reader(location: Location, storage_options: Any) -> MetadataReader:
    return MetadataReader(location.child(DCP_DIR).url, **dict(storage_options or {}))


def read_metadata(location: Location, storage_options: Any) -> Any:
    try:
        return reader(location, storage_options).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, RuntimeError) as err:
        raise CorruptCheckpointError(
            f"checkpoint {location.url}: its file {DCP_DIR}/.metadata cannot be read ({err}), "
            "although its checksum passes. Use another checkpoint."
        ) from None

"""The DCP back-end of the pipeline: the model and optimizer tensors of a DDP, FSDP2 or
tensor-parallel state through torch.distributed.checkpoint and fsspec. Imported on use (DCP
costs ~0.8 s to import, which single-process users should not pay).

A sharded checkpoint is a directory like any other (same names, listing, retention)::

    step-00000120/
      dcp/.metadata, dcp/__0_0.distcp, ...  DCP: model and optimizer tensors; each rank writes
                                            its shard, replicated tensors are written once
      rank-00000.pt, rank-00001.pt, ...     torch.save, one per rank: that rank's train state
                                            (as ``contents`` gathers it) and the non-tensor
                                            part of the model and optimizer state dicts
      manifest.json                         written last, by rank 0 (``pipeline.write``)

Only tensors go through DCP: it stores other values as pickles and reads them back with
``torch.load(weights_only=False)``; steplib never loads pickled code, so the rest goes into the
rank files, read with ``weights_only=True``, and DCP's own ``.metadata`` is read by an
unpickler that builds DCP's metadata records and nothing else (:class:`MetadataReader`).

Loading goes through ``get_state_dict`` / ``set_state_dict``, whose names are the same for
DDP, FSDP2 and a plain module, and DCP reshards: a checkpoint of 2 ranks loads into 1, 4, or a
plain module without a process group. On another world size the RNG states are not restored,
an open accumulation window is refused, and so is a data position unless it is a sharded
loader's (``resumable_loader(..., shard=True)``, ``steplib.data.shards``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from steplib.checkpoint import storage
from steplib.checkpoint.contents import (
    check_plain,
    lanes,
    read_tree,
    train_state_tree,
    window_grads,
)
from steplib.checkpoint.manifest import Manifest
from steplib.checkpoint.pipeline import (
    DCP_DIR,
    Checkpoints,
    Plan,
    holds_only_ddp,
    is_sharded,
    rank_file,
)
from steplib.checkpoint.restore import (
    check_model,
    check_optimizer,
    check_optimizer_names,
    check_train_state,
    lane_trees,
    restore_train_state,
)
from steplib.checkpoint.storage import FileRecord, Location
from steplib.data.shards import check_new_world
from steplib.distributed.parallelize import is_parallel_model
from steplib.errors import CheckpointError, ConfigError, CorruptCheckpointError
from steplib.state import TrainState

try:  # re-exported by torch.distributed.checkpoint up to torch 2.12, private module since
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the torch version
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

Tree = dict[str, Any]


class _ChecksumStream(storage.ChecksumFile):
    """A :class:`~steplib.checkpoint.storage.ChecksumFile` that passes what else DCP asks
    for (``tell()``, the offset of each tensor; ``fileno()``, for fsync) to the file."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _ChecksumFileSystem:
    """Wraps the filesystem object of an ``FsspecWriter``: each file written is recorded with
    its size and checksum, by name, in ``records``; a rename (DCP writes ``.metadata.tmp`` and
    renames it) moves the record."""

    def __init__(self, inner: Any, records: MutableMapping[str, FileRecord]) -> None:
        self.inner = inner
        self.records = records

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksumStream(raw)
            yield stream
        # Recorded only once the file is complete and closed (not when the write failed).
        self.records[_name(path)] = stream.record()

    def rename(self, path: Any, new_path: Any) -> None:
        self.inner.rename(path, new_path)
        record = self.records.pop(_name(path), None)
        if record is not None:
            self.records[_name(new_path)] = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ChecksumWriter(FsspecWriter):
    """DCP's ``FsspecWriter`` that records the size and checksum of every file this rank writes
    (computed on the way out: nothing is read back), in ``records`` (file name -> record)."""

    def __init__(self, path: str, *, records: MutableMapping[str, FileRecord], **kwargs: Any):
        # overwrite=False: a staging directory is always fresh; an old .metadata there means
        # two saves are writing into one directory, which must fail rather than mix.
        super().__init__(path, overwrite=False, **kwargs)
        this: Any = self  # FsspecWriter's attributes are untyped (torch's mypy: ignore-errors)
        this.fs = _ChecksumFileSystem(this.fs, records)


class MetadataReader(FsspecReader):
    """DCP's ``FsspecReader``, reading the ``.metadata`` file with an unpickler that only
    builds DCP's metadata records, ``torch.Size`` and dtypes: a file that names anything else
    (code to run) is refused instead of executed."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # The body of FileSystemReader.read_metadata, with pickle.load replaced.
        this: Any = self
        path = this._get_metadata_path(kwargs.get("rank"))
        with this.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = this.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED = frozenset(
        {
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("collections", "OrderedDict"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(
                f"DCP's .metadata names {module}.{name}, which is not part of DCP's metadata; "
                "steplib does not run code from a checkpoint. Use a checkpoint written by "
                "steplib's save."
            )
        return found

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._ALLOWED:
            return True
        if module == "torch.distributed.checkpoint.metadata":
            found = getattr(dcp_metadata, name, None)  # the records and enums defined there
            return isinstance(found, type) and found.__module__ == module
        if module == "torch":
            kinds = (torch.dtype, torch.layout, torch.memory_format)
            return isinstance(getattr(torch, name, None), kinds)
        return False


def _name(path: Any) -> str:
    return os.path.basename(os.fspath(path))


def split(tree: Any) -> tuple[Tree, Tree]:
    """``(tensors, plain)``: the tensor leaves of nested dicts for DCP, the rest for
    ``torch.save``. Lists (e.g. the optimizer's ``param_groups``) go whole to ``plain``."""
    tensors: Tree = {}
    plain: Tree = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict) and value:
            sub_tensors, sub_plain = split(value)
            if sub_tensors:
                tensors[key] = sub_tensors
            if sub_plain or not sub_tensors:
                plain[key] = sub_plain
        else:
            plain[key] = value
    return tensors, plain


def merge(tensors: Tree, plain: Tree) -> Tree:
    """The inverse of :func:`split`: one nested dict (plain dicts, new at every level)."""
    out: Tree = {}
    for key in [*plain, *(k for k in tensors if k not in plain)]:
        a, b = tensors.get(key), plain.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out[key] = merge(a, b)
        else:
            out[key] = a if key in tensors else b
    return out


@contextlib.contextmanager
def dcp_errors(action: str, url: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a ``CheckpointError`` naming ``url``.

    DCP gathers the failures of every rank and raises the same ``CheckpointException`` on all
    of them. It derives from ``BaseException``, not ``Exception``: a plain ``except
    Exception`` would let it through, so it is caught by name here.
    """
    try:
        yield
    except CheckpointException as err:
        failures = "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}"
            for rank, error in sorted(getattr(err, "failures", {}).items())
        )
        raise CheckpointError(
            f"torch.distributed.checkpoint could not {action} {url} ({failures or err}). "
            "Check that every rank can reach the directory (one shared filesystem or object "
            "store for all nodes), its permissions and free space; nothing was committed and "
            "older checkpoints are intact."
        ) from None


@contextlib.contextmanager
def no_dist_warning_silenced() -> Iterator[None]:
    """DCP warns "torch.distributed is disabled ..." on every load without a process group,
    even when ``no_dist=True`` says that this is meant (a resharded load into one process
    is). Silenced for that one message only; the load runs in the caller's thread."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized",
            category=UserWarning,
        )
        yield


def gather(
    state: TrainState, *, data: Any, extras: Mapping[str, Any], caller: str
) -> tuple[Tree, Tree]:
    """``(files, tensors)``: this rank's file (its train state, the non-tensor part of the
    state dicts) and DCP's tensors (``{"model": ..., "optimizer": ...}``), live.

    Raises:
        ConfigError: an FSDP2 or tensor-parallel state inside an open accumulation window.
    """
    model, every = state.model, lanes(state)
    grads = None
    open_window = max(lane.window_size for lane in every)
    if open_window > 0:
        if not holds_only_ddp(model):
            # FSDP2 keeps the window's gradients unsharded inside its parameter groups, with
            # no public way to read them back; a tensor-parallel model's are DTensors bound to
            # this run's mesh. Saving without them would resume wrongly.
            fsdp = any(is_parallel_model(m) for m in model.modules())
            kind = "an FSDP2" if fsdp else "a tensor-parallel (DTensor)"
            raise ConfigError(
                f"{caller}: the state is inside an open accumulation window "
                f"({open_window} micro-batches done) of {kind} model, whose "
                "unsynchronised gradients cannot be saved. Save between windows: "
                "checkpoint_every and preemption() do; or save when out.did_update is True."
            )
        grads = window_grads(model)
    # get_optimizer_state_dict initialises an empty optimizer state by stepping it once with
    # lr=0, which changes what the next real step computes (Adam's step count). Before an
    # optimizer's first update there is no state to save anyway: only its hyperparameters.
    # One DCP state holds every optimizer that has state (their parameters are disjoint).
    stateful = [lane.optimizer for lane in every if lane.optimizer.state]
    optim_sd = get_optimizer_state_dict(model, stateful) if stateful else {}
    tensors, plain = split({"model": get_model_state_dict(model), "optimizer": optim_sd})
    infos = [optimizer_info(lane.optimizer) for lane in every]
    rank_tree = {
        "plain": plain,
        "optimizer": infos[0],
        "optimizer_names": list(state.names),
        "lane_optimizers": dict(zip(state.names[1:], infos[1:], strict=True)),
        "train_state": train_state_tree(state, data=data, extras=extras),
        "window_grads": grads,
    }
    name = rank_file(dist.get_rank())
    check_plain(rank_tree, name)
    return {name: rank_tree}, tensors


def optimizer_info(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a sharded checkpoint records of an optimizer beside its DCP tensors: whether it
    had state, and its parameter groups' settings and sizes."""
    return {
        "has_state": bool(optimizer.state),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
    }


def write(plan: Plan, staging: Location, *, group: Any) -> dict[str, FileRecord]:
    """DCP writes every rank's shard of ``plan.tensors`` (rank 0 also the ``.metadata``) into
    ``staging``; this rank's files' records, by path. DCP agrees on failures itself.

    Raises:
        CheckpointError: any rank failed (the same error on every rank).
    """
    if dist.get_rank(group) == 0 and not staging.is_local:  # an older save's, in place
        with contextlib.suppress(FileNotFoundError):
            staging.fs.rm(staging.child(DCP_DIR).path, recursive=True)
    written: dict[str, FileRecord] = {}
    writer = ChecksumWriter(
        staging.child(DCP_DIR).url,
        records=written,
        # An object store's files have no fsync; DCP would call os.sync() for each instead.
        sync_files=plan.fsync and staging.is_local,
        **plan.storage_options,
    )
    with dcp_errors("write", plan.url):
        torch_dcp.save(plan.tensors, storage_writer=writer, process_group=group)
    return {f"{DCP_DIR}/{name}": record for name, record in written.items()}


def load(
    location: Location,
    manifest: Manifest,
    state: TrainState,
    given: Checkpoints,
    extras: Mapping[str, Any],
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
    url, data, options = location.url, given.data, dict(given.storage_options or {})
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
    check_optimizer_names(rank_tree.get("optimizer_names", []), state, checkpoint=url)
    check_train_state(train_state, state, data=data, extras=extras, checkpoint=url)
    # Each optimizer's record, the first's under "optimizer" (as before several were saved).
    infos = [rank_tree["optimizer"], *rank_tree.get("lane_optimizers", {}).values()]
    trees = lane_trees(train_state, state)
    for lane, info, tree in zip(lanes(state), infos, trees.values(), strict=True):
        check_optimizer(tree["optimizer_type"], info["group_sizes"], lane.optimizer, checkpoint=url)
    _check_placement(
        manifest, state, data=data, position=train_state["data"], world=world, checkpoint=url
    )
    if not same_world and _holds_dtensor(train_state["objects"]):
        raise ConfigError(
            f"load(extras=...): checkpoint {url} was written by {manifest.world_size} ranks "
            f"and is loaded on {world}; its extra objects hold sharded tensors (DTensor, e.g. "
            "an EMA of an FSDP2 model), saved per rank, which steplib cannot reshard. Resume "
            f"on {manifest.world_size} ranks."
        )

    model = state.model
    pairs = list(zip(lanes(state), infos, strict=True))
    stateful = [lane.optimizer for lane, info in pairs if info["has_state"]]
    target = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, stateful) if stateful else {},
    }
    tensors, _ = split(target)
    reader_url = location.child(DCP_DIR).url
    _check_keys(MetadataReader(reader_url, **options), tensors, state, checkpoint=url)
    with dcp_errors("read", url), no_dist_warning_silenced():
        torch_dcp.load(
            tensors,
            storage_reader=MetadataReader(reader_url, **options),
            no_dist=not distributed,
        )
    loaded = merge(tensors, rank_tree["plain"])
    set_model_state_dict(model, loaded["model"])
    if stateful:
        set_optimizer_state_dict(model, stateful, loaded["optimizer"])
    for lane, info in pairs:
        if not info["has_state"]:
            _load_hyperparameters(lane.optimizer, info["groups"])
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
            storage.verify(location.child(name), manifest.files[name], checkpoint=location.url)
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
    checkpoint: str,
) -> None:
    """Refuse what cannot move to another world size or distribution (before any change)."""
    saved = manifest.world_size
    if world != saved and data is not None:
        # Only a sharded loader's position (samples consumed by all ranks) means the same on
        # every world size; rank 0's file holds it, as every rank's does.
        check_new_world(
            data, position, saved_world_size=saved, world_size=world, checkpoint=checkpoint
        )
    if manifest.window_size > 0 and (world != saved or not holds_only_ddp(state.model)):
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
    missing = sorted(k for k in needed if k.startswith("optimizer.") and k not in saved)
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


def _load_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    # Saved before the first update: no per-parameter state, only the groups' settings. The
    # optimizer's own load_state_dict takes them (and empties its state, as it was).
    params: list[list[int]] = []
    start = 0
    for group in optimizer.param_groups:
        params.append(list(range(start, start + len(group["params"]))))
        start += len(group["params"])
    optimizer.load_state_dict(
        {
            "state": {},
            "param_groups": [dict(g, params=p) for g, p in zip(groups, params, strict=True)],
        }
    )


_MODEL = "model."  # DCP's names of the model's tensors: "model." + the state_dict name


def read_weights(location: Location, manifest: Manifest, storage_options: Any) -> dict[str, Any]:
    """``model.state_dict()`` as saved, whole, with CPU tensors; every file it comes from
    verified first.

    Each caller reads alone (no collective), so every rank of a job may call it.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or altered (named), or DCP's
            metadata cannot be read.
    """
    url = location.url
    # The model's tensors share DCP's files with the optimizer's: all of them are verified.
    names = [n for n in manifest.files if n.startswith(f"{DCP_DIR}/") or n == rank_file(0)]
    if rank_file(0) not in names:
        raise CorruptCheckpointError(
            f"checkpoint {url}: its manifest lists no {rank_file(0)}; it was not written by "
            "steplib's save. Use another checkpoint."
        )
    for name in names:
        if name != rank_file(0):
            storage.verify(location.child(name), manifest.files[name], checkpoint=url)
    data = storage.read_verified(
        location.child(rank_file(0)), manifest.files[rank_file(0)], checkpoint=url
    )
    try:
        rank_tree = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        metadata = _reader(location, storage_options).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, RuntimeError) as err:
        raise CorruptCheckpointError(
            f"checkpoint {url}: it cannot be read ({err}), although its checksums pass; it "
            "was written by another program. Use another checkpoint."
        ) from None
    # Whole tensors to read into: DCP assembles them from the shards of every rank.
    tensors = {
        key[len(_MODEL) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(entry, TensorStorageMetadata)
    }
    with dcp_errors("read", url), no_dist_warning_silenced():
        torch_dcp.load(
            {"model": tensors}, storage_reader=_reader(location, storage_options), no_dist=True
        )
    plain = rank_tree["plain"].get("model", {})  # the model's non-tensor entries, if any
    return merge(tensors, plain)


def _reader(location: Location, storage_options: Any) -> MetadataReader:
    return MetadataReader(location.child(DCP_DIR).url, **dict(storage_options or {}))

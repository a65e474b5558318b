"""Writing a sharded checkpoint (see ``steplib.checkpoint.sharded`` for what it holds): each
rank gathers its part, optionally snapshots it to CPU, and writes it; rank 0 commits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
from typing import Any

import torch
import torch.distributed as dist

from steplib.checkpoint import checksummed, storage
from steplib.checkpoint.checksummed import FileRecord
from steplib.checkpoint.contents import (
    check_arguments,
    check_metrics,
    check_plain,
    lanes,
    train_state_tree,
    window_grads,
)
from steplib.checkpoint.copying import snapshot_tree
from steplib.checkpoint.manifest import (
    MANIFEST,
    SHARDED,
    Manifest,
    library_versions,
)
from steplib.checkpoint.sharded.layout import DCP_DIR, holds_only_ddp, rank_file
from steplib.checkpoint.storage import Location
from steplib.distributed.parallelize import is_parallel_model
from steplib.errors import CheckpointError, ConfigError
from steplib.state import TrainState


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedPlan:
    """What one rank writes for a sharded save, gathered at one moment (live tensors until
    :func:`snapshot_plan` copies them)."""

    directory: Location
    name: str
    tensors: dict[str, Any]  # for DCP: {"model": ..., "optimizer": {"state": ...}}
    rank_tree: dict[str, Any]  # this rank's torch.save file
    manifest: Manifest  # rank 0's; ``files`` and ``versions`` are filled in by ``write_sharded``
    storage_options: Mapping[str, Any]

    @property
    def url(self) -> str:
        return self.directory.child(self.name).url


def prepare_sharded(
    state: TrainState,
    directory: str,
    *,
    data: Any,
    extras: Mapping[str, Any] | None,
    step: Any,
    metrics: Mapping[str, Any] | None,
    storage_options: Mapping[str, Any] | None,
    caller: str,
) -> ShardedPlan:
    """Check the arguments and gather this rank's part of a sharded save.

    Raises:
        ConfigError: a bad argument, or an FSDP2 state inside an open accumulation window.
    """
    # DCP is imported where it is used: it costs ~0.8 s, which single-process users of
    # steplib (every `import steplib`) should not pay.
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from steplib.checkpoint.sharded.dcp_io import split

    extras = check_arguments(caller, state, data=data, extras=extras, step=step)
    location = storage.resolve(directory, storage_options, caller=caller)
    numbers = check_metrics(metrics, caller)
    model, every = state.model, lanes(state)
    grads = None
    open_window = max(lane.window.size for lane in every)
    if open_window > 0:
        if not holds_only_ddp(model):
            # FSDP2 keeps the window's gradients unsharded inside its parameter groups, with
            # no public way to read them back; saving without them would resume wrongly.
            # A tensor-parallel model's are DTensors, bound to this run's mesh: not saved either.
            fsdp = any(is_parallel_model(m) for m in model.modules())
            kind = "an FSDP2" if fsdp else "a tensor-parallel (DTensor)"
            raise ConfigError(
                f"{caller}: the state is inside an open accumulation window "
                f"({open_window} micro-batches done) of {kind} model, whose "
                "unsynchronised gradients cannot be saved. Save between windows: "
                "checkpoint_every and preemption() do; or save when out.did_update is True."
            )
        grads = window_grads(model)
    model_sd = get_model_state_dict(model)
    # get_optimizer_state_dict initialises an empty optimizer state by stepping it once with
    # lr=0, which changes what the next real step computes (Adam's step count). Before an
    # optimizer's first update there is no state to save anyway: only its hyperparameters.
    # One DCP state holds every optimizer that has state (a GAN's two: their parameters are
    # disjoint); each optimizer's settings go in the rank file, the first's as before.
    stateful = [lane.optimizer for lane in every if lane.optimizer.state]
    optim_sd = get_optimizer_state_dict(model, stateful) if stateful else {}
    tensors, plain = split({"model": model_sd, "optimizer": optim_sd})
    infos = [optimizer_info(lane.optimizer) for lane in every]
    rank_tree = {
        "plain": plain,
        "optimizer": infos[0],
        "optimizer_names": list(state.names),
        "lane_optimizers": dict(zip(state.names[1:], infos[1:], strict=True)),
        "train_state": train_state_tree(state, data=data, extras=extras),
        "window_grads": grads,
    }
    check_plain(rank_tree, rank_file(dist.get_rank()))
    manifest = Manifest.of(
        state, metrics=numbers, step=step, layout=SHARDED, world_size=dist.get_world_size()
    )
    name = manifest.name
    return ShardedPlan(location, name, tensors, rank_tree, manifest, dict(storage_options or {}))


def optimizer_info(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a sharded checkpoint records of an optimizer beside its DCP tensors: whether it
    had state, and its parameter groups' settings and sizes."""
    return {
        "has_state": bool(optimizer.state),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
    }


def snapshot_plan(
    plan: ShardedPlan, buffers: dict[Any, torch.Tensor], *, deferred: Container[int] = ()
) -> tuple[ShardedPlan, list[Any]]:
    """``plan`` with every tensor copied to CPU (into ``buffers``, reused by the next call),
    so that training may go on while it is written, and the copies to wait for before writing
    it (see :func:`~steplib.checkpoint.copying.snapshot_tree`, and its ``deferred``)."""
    copied, events = snapshot_tree(
        {"tensors": plan.tensors, "rank": plan.rank_tree}, buffers, deferred=deferred
    )
    return dataclasses.replace(plan, tensors=copied["tensors"], rank_tree=copied["rank"]), events


def write_sharded(plan: ShardedPlan, *, group: Any = None, fsync: bool = True) -> str:
    """Write this rank's part of ``plan`` and commit the checkpoint together with every other
    rank of ``group`` (the default group when ``None``); return its URL on every rank.
    ``fsync=False``: no fsync of files or directories (not durable; still atomic, checksummed).

    Raises:
        CheckpointError: any rank failed (the same error on every rank; nothing committed).
    """
    import torch.distributed.checkpoint as dcp  # imported on use, see prepare_sharded

    from steplib.checkpoint.sharded.dcp_io import ChecksumWriter, dcp_errors

    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    src = 0 if group is None else dist.get_global_rank(group, 0)

    # 1. Rank 0 opens the staging directory; every rank learns its path (or the failure).
    opened: list[Any] = [None, None]
    if me == 0:
        try:
            staging = storage.begin(plan.directory, plan.name)
            if not staging.is_local and storage.exists(staging.child(DCP_DIR)):
                staging.fs.rm(staging.child(DCP_DIR).path, recursive=True)  # an older save's
            opened[0] = staging.path
        except Exception as err:  # reported to every rank below, raised on every rank
            opened[1] = f"rank 0: {type(err).__name__}: {err}"
    dist.broadcast_object_list(opened, src=src, group=group)
    if opened[1] is not None:
        raise _failed(plan, [opened[1]])
    staging = Location(
        plan.directory.child(opened[0].rstrip("/").rsplit("/", 1)[-1]).url,
        plan.directory.fs,
        opened[0],
    )

    try:
        # 2. DCP: every rank writes its shard, rank 0 also the .metadata. DCP gathers the
        # failures itself and raises on every rank.
        written: dict[str, FileRecord] = {}
        writer = ChecksumWriter(
            staging.child(DCP_DIR).url,
            records=written,
            # An object store's files have no fsync; DCP would call os.sync() for each instead.
            sync_files=fsync and staging.is_local,
            **plan.storage_options,
        )
        with dcp_errors("write", plan.url):
            dcp.save(plan.tensors, storage_writer=writer, process_group=group)

        # 3. This rank's train-state file.
        mine = {f"{DCP_DIR}/{name}": record for name, record in written.items()}
        failure = None
        try:
            name = rank_file(me)
            mine[name] = checksummed.write_tensors(staging.child(name), plan.rank_tree, fsync=fsync)
        except Exception as err:  # reported to every rank below, raised on every rank
            failure = f"rank {me}: {type(err).__name__}: {err}"
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, (mine, failure), group=group)
        failures = [f for _, f in reports if f is not None]
        if failures:
            raise _failed(plan, failures)

        # 4. Rank 0 writes the manifest (the commit) and tells every rank how it went.
        outcome: list[Any] = [None]
        if me == 0:
            try:
                files = {k: v for records, _ in reports for k, v in records.items()}
                manifest = dataclasses.replace(
                    plan.manifest, files=dict(sorted(files.items())), versions=library_versions()
                )
                checksummed.write_bytes(staging.child(MANIFEST), manifest.to_json(), fsync=fsync)
                committed = storage.commit(plan.directory, staging, plan.name, fsync=fsync)
                outcome[0] = ("ok", committed.url)
            except Exception as err:  # reported to every rank below, raised on every rank
                outcome[0] = ("error", f"rank 0: {type(err).__name__}: {err}")
        dist.broadcast_object_list(outcome, src=src, group=group)
        status, detail = outcome[0]
        if status != "ok":
            raise _failed(plan, [detail])
        return str(detail)
    except CheckpointError:
        # Every rank is here (the failures above are agreed on by all of them); the barrier
        # makes "save raised" mean "the staging directory is gone" on every rank.
        if me == 0 and staging.is_local:
            storage.remove(staging)
        dist.barrier(group=group)
        raise


def _failed(plan: ShardedPlan, failures: list[str]) -> CheckpointError:
    return CheckpointError(
        f"save could not write the sharded checkpoint {plan.url} ({'; '.join(failures)}). Pass "
        "a directory that every rank can write to (one shared filesystem or object store for "
        "all nodes; check the path, permissions, free space and credentials); nothing was "
        "committed and older checkpoints are intact."
    )

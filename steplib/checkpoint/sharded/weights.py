"""The model's weights of a sharded (DCP) checkpoint, whole, on the CPU of this process
(``steplib.checkpoint.load_weights``): any number of ranks wrote it, one process reads it."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from steplib.checkpoint import checksummed
from steplib.checkpoint.manifest import Manifest
from steplib.checkpoint.sharded.dcp_io import (
    MetadataReader,
    dcp_errors,
    merge,
    no_dist_warning_silenced,
)
from steplib.checkpoint.sharded.layout import DCP_DIR, rank_file
from steplib.checkpoint.storage import Location
from steplib.errors import CorruptCheckpointError

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
            checksummed.verify(location.child(name), manifest.files[name], checkpoint=url)
    data = checksummed.read_verified(
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
        dcp.load(
            {"model": tensors}, storage_reader=_reader(location, storage_options), no_dist=True
        )
    plain = rank_tree["plain"].get("model", {})  # the model's non-tensor entries, if any
    return merge(tensors, plain)


def _reader(location: Location, storage_options: Any) -> MetadataReader:
    return MetadataReader(location.child(DCP_DIR).url, **dict(storage_options or {}))

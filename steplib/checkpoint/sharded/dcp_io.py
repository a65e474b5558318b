"""The torch.distributed.checkpoint (DCP) side of sharded checkpoints: a checksumming
``FsspecWriter``, the split of a state dict into DCP's tensors and steplib's plain file, and DCP's
errors turned into steplib's (the CPU snapshot an asynchronous save writes from is
``copying.snapshot_tree``, shared with plain checkpoints).

Why the split: DCP stores every non-tensor value as a pickle and reads it back with
``torch.load(weights_only=False)``, which runs whatever code the file names. steplib's
checkpoints never load pickled code, so only tensors go through DCP; the rest (optimizer
hyperparameters, counters, scheduler...) goes into a ``torch.save`` file read with
``weights_only=True``. DCP's own ``.metadata`` is a pickle too: :class:`MetadataReader`
reads it with an unpickler that builds DCP's metadata records and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from steplib.checkpoint.checksum import hasher
from steplib.checkpoint.checksummed import FileRecord
from steplib.errors import CheckpointError

try:  # re-exported by torch.distributed.checkpoint up to torch 2.12, private module since
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the torch version
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = [
    "ChecksumWriter",
    "MetadataReader",
    "dcp_errors",
    "merge",
    "no_dist_warning_silenced",
    "split",
]

Tree = dict[str, Any]


class _ChecksumStream:
    """A write stream that checksums and counts the bytes on their way to ``raw``.

    DCP asks the stream for ``tell()`` (the offset of each tensor) and ``fileno()`` (fsync);
    everything else it calls is passed through.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.hasher = hasher()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hasher.update(view)  # releases the GIL on large buffers
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

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
        self.records[_name(path)] = FileRecord(stream.size, stream.hasher.hexdigest())

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

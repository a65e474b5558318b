"""The manifest: the last file of a checkpoint, what makes it exist, and its table of contents.

``manifest.json`` (orjson) holds the counters, time, metrics, versions, the step's fingerprint
and the size and checksum of every other file (``"xxh3_64"``; ``"crc32"`` in checkpoints written
before steplib 0.2.0, still verified). It carries its own CRC32 too (of its body, keys sorted),
so that an altered manifest is detected like any other file; it stays CRC32 (a few KiB: speed
does not matter) so that an older steplib gets past it and says "upgrade steplib".

Checkpoint names sort in training order: ``step-00000120`` for a checkpoint taken between
windows, ``step-00000120-micro-00000483`` for one taken inside an open accumulation window
(later than ``step-00000120``, earlier than ``step-00000121``).
"""

from __future__ import annotations

import dataclasses
import math
import platform
import re
import time
import zlib
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import orjson
import torch

from steplib.checkpoint.checksum import ALGORITHMS
from steplib.checkpoint.checksummed import FileRecord
from steplib.errors import ConfigError, CorruptCheckpointError, describe

FORMAT = "steplib-checkpoint"
# Format versions: 1 single-process, 2 sharded (DCP), both with CRC32 file checksums; 3 either
# layout with XXH3 file checksums (what this steplib writes). An older steplib reading a format
# 3 checkpoint says "upgrade steplib" instead of taking its files for corrupt.
VERSION = 3  # the newest format this steplib reads, and the one it writes
MANIFEST = "manifest.json"
SINGLE = "single"  # layouts (``steplib.checkpoint.sharded`` writes the second)
SHARDED = "sharded"
LAYOUTS = (SINGLE, SHARDED)

_NAME = re.compile(r"^step-(\d{8,})(?:-micro-(\d{8,}))?$")


def checkpoint_name(step: int, micro_step: int, window_size: int) -> str:
    """The directory name of a checkpoint taken at these counters."""
    if window_size == 0:
        return f"step-{step:08d}"
    return f"step-{step:08d}-micro-{micro_step:08d}"


def sort_key(name: str) -> tuple[int, int] | None:
    """``(step, micro_step or -1)`` of a checkpoint name, or ``None`` if it is not one."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)) if match.group(2) else -1


def library_versions() -> dict[str, str]:
    """The versions a checkpoint was written with (for the reader of a manifest)."""
    try:
        steplib_version = metadata.version("steplib")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        steplib_version = "unknown"
    return {
        "steplib": steplib_version,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def fingerprint(step: Any, *, caller: str = "save") -> list[dict[str, Any]] | None:
    """The composition of ``step`` as JSON values (as ``load`` compares it), or ``None``.

    ``step`` is a Step (its ``describe()``), or several steps by name as ``run`` takes them
    (``{"D": d_step, "G": g_step}``): then a ``{"wrapper": "steps", "names": [...]}`` entry,
    and each step's wrappers named ``"D:clip"``, ``"G:clip"``, ...

    Raises:
        ConfigError: ``step`` is neither (says what was received).

    Example:
        >>> from steplib import clip, make_train_step
        >>> d = clip(make_train_step(lambda m, b: m(b).sum(), optimizer="D"), max_norm=1.0)
        >>> [e["wrapper"] for e in fingerprint({"D": d, "G": make_train_step(print)})]
        ['steps', 'D:clip']
    """
    if step is None:
        return None
    several = isinstance(step, Mapping)
    for one in step.values() if several else (step,):
        if not callable(getattr(one, "describe", None)):
            raise ConfigError(
                f"{caller}(step=...) received {describe(step)}, which is not a Step. Pass the "
                "step you train with (make_train_step(...) and its wrappers), the steps by name "
                'as run takes them ({"D": d_step, "G": g_step}), or leave step=None.'
            )
    if several:
        described = [{"wrapper": "steps", "names": list(step)}] + [
            {**d, "wrapper": f"{name}:{d['wrapper']}"}
            for name, one in step.items()
            for d in one.describe()
        ]
    else:
        described = step.describe()
    return list(orjson.loads(orjson.dumps(described, default=str)))


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """The contents of ``manifest.json``.

    Attributes:
        name: the checkpoint's directory name.
        step, micro_step, epoch, window_size: the TrainState counters when it was taken.
        time: when it was taken (unix seconds).
        metrics: numbers recorded with it (what ``keep_best`` ranks by).
        fingerprint: ``step.describe()`` of the step that trained it, or ``None``.
        versions: steplib, torch and Python versions of the writer.
        files: size and checksum of each data file (by path inside the checkpoint).
        layout: ``"single"`` (one process, ``torch.save`` files) or ``"sharded"`` (DCP).
        world_size: the number of processes that wrote it.
    """

    name: str
    step: int
    micro_step: int
    epoch: int
    window_size: int
    time: float
    metrics: Mapping[str, float]
    fingerprint: list[dict[str, Any]] | None
    versions: Mapping[str, str]
    files: Mapping[str, FileRecord]
    layout: str = SINGLE
    world_size: int = 1

    @classmethod
    def of(
        cls,
        state: Any,
        *,
        metrics: Mapping[str, float],
        step: Any,
        layout: str = SINGLE,
        world_size: int = 1,
    ) -> Manifest:
        """The manifest of a checkpoint of ``state`` now; ``versions`` and ``files`` are
        filled in by the write, off an async save's critical path."""
        # As JSON values (tuples become lists, odd settings strings), as load will compare them.
        return cls(
            name=checkpoint_name(state.step, state.micro_step, state.window.size),
            step=state.step,
            micro_step=state.micro_step,
            epoch=state.epoch,
            window_size=state.window.size,
            time=time.time(),
            metrics=metrics,
            fingerprint=fingerprint(step),
            versions={},
            files={},
            layout=layout,
            world_size=world_size,
        )

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "step": self.step,
            "micro_step": self.micro_step,
            "epoch": self.epoch,
            "window_size": self.window_size,
            "time": self.time,
            # NaN/inf are not JSON; a metric that diverged ranks last anyway.
            "metrics": {k: (v if math.isfinite(v) else None) for k, v in self.metrics.items()},
            "fingerprint": self.fingerprint,
            "versions": dict(self.versions),
            "files": {k: {"bytes": r.size, r.algorithm: r.checksum} for k, r in self.files.items()},
        }
        if self.layout != SINGLE:  # absent: single, one process (as format 1 wrote it)
            body["layout"] = self.layout
            body["world_size"] = self.world_size
        body["manifest_crc32"] = _body_crc(body)
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes, *, checkpoint: str) -> Manifest:
        """Parse and check a manifest.

        Raises:
            CorruptCheckpointError: not JSON, not a steplib manifest, or its own CRC differs.
        """
        try:
            body = orjson.loads(data)
            if not isinstance(body, dict) or body.get("format") != FORMAT:
                raise ValueError("not a steplib checkpoint manifest")
            stored = body.pop("manifest_crc32", None)
            if stored != _body_crc(body):
                raise ValueError(
                    f"its CRC32 is {_body_crc(body)}, it says {stored}: it was altered"
                )
            if body.get("layout", SINGLE) not in LAYOUTS:
                raise ValueError(f"unknown layout {body['layout']!r}; upgrade steplib")
            if body["version"] > VERSION:
                raise ValueError(
                    f"format version {body['version']} is newer than this steplib reads "
                    f"({VERSION}); upgrade steplib"
                )
            return cls(
                name=str(body["name"]),
                step=int(body["step"]),
                micro_step=int(body["micro_step"]),
                epoch=int(body["epoch"]),
                window_size=int(body["window_size"]),
                time=float(body["time"]),
                metrics={
                    k: (math.nan if v is None else float(v)) for k, v in body["metrics"].items()
                },
                fingerprint=body["fingerprint"],
                versions=dict(body["versions"]),
                files={k: _record(k, v) for k, v in body["files"].items()},
                layout=str(body.get("layout", SINGLE)),
                world_size=int(body.get("world_size", 1)),
            )
        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint}: its file {MANIFEST} cannot be read ({err}). Use an "
                "older checkpoint (latest() and resume_from() skip this one)."
            ) from None


def _body_crc(body: Mapping[str, Any]) -> str:
    return f"{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"


def _record(name: str, entry: Mapping[str, Any]) -> FileRecord:
    # {"bytes": ..., "xxh3_64": ...}, or "crc32" in a checkpoint written before steplib 0.2.0.
    for algorithm in ALGORITHMS:
        if algorithm in entry:
            return FileRecord(int(entry["bytes"]), str(entry[algorithm]), algorithm)
    raise ValueError(
        f"the entry of {name} has no checksum this steplib knows ({', '.join(ALGORITHMS)}); "
        "upgrade steplib"
    )

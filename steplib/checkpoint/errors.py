"""The errors and the warning of the checkpoint package.

They live here until ``steplib/errors.py`` takes them over; import them from
``steplib.checkpoint``, which will keep exporting them from wherever they live.
"""

from __future__ import annotations

from steplib.errors import StepLibError


class CheckpointError(StepLibError):
    """A checkpoint could not be written, found or read (I/O, a missing filesystem package)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match its manifest (truncated or altered)."""


class CheckpointWarning(UserWarning):
    """Part of a checkpoint was skipped: a corrupt checkpoint, for an older one (``latest``,
    ``resume_from``), or weights whose names the model lacks (``load_weights(strict=False)``)."""

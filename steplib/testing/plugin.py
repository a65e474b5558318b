"""pytest plugin: fixtures for testing your own steps. Registered through the ``pytest11`` entry
point ``steplib = "steplib.testing.plugin"`` (or ``pytest -p steplib.testing.plugin``).

Only this module of ``steplib.testing`` imports pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from steplib.testing.ranks import run_ranks


@pytest.fixture
def tmp_checkpoint_dir(tmp_path: Path) -> str:
    """A fresh directory for checkpoints, as the string ``steplib.checkpoint.save`` takes.

    It does not exist yet (``save`` creates it), and is removed with pytest's ``tmp_path``.
    """
    return str(tmp_path / "checkpoints")


@pytest.fixture
def gloo_ranks() -> Callable[..., list[Any]]:
    """A runner of ``fn(rank, world)`` on 2 forked CPU processes over gloo:
    ``gloo_ranks(fn, world=2, timeout=120.0) -> [result of rank 0, result of rank 1]``.

    See :func:`steplib.testing.run_ranks` for what ``fn`` may return and how failures read.
    """
    return run_ranks

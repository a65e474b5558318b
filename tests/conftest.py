"""Shared markers: GPU tests are skipped on CPU-only machines (the CPU path is always tested)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; the same law is tested on CPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""examples/fine_tune.py: a frozen body under a new head, unfrozen at update 4. A run stopped
past the unfreeze and resumed trains the same parameters as the uninterrupted one: which
parameters are frozen is saved with each checkpoint (the handler that unfroze the body does
not run again in the resumed run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fine_tune", ROOT / "examples" / "fine_tune.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_resumed_past_the_unfreeze_trains_the_body_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    example = _example()
    whole = example.main(str(tmp_path / "whole"), max_steps=12)
    first = example.main(str(tmp_path / "resumed"), max_steps=6)  # stops at 6, saved there
    assert first.model[0][0].weight.requires_grad  # unfrozen at 4
    resumed = example.main(str(tmp_path / "resumed"), max_steps=12)  # a new process would too
    assert resumed.step == whole.step == 12
    body_before = example.pretrained_body()[0].weight
    assert not torch.equal(whole.model[0][0].weight, body_before)  # the body was trained
    for a, b in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(a, b)

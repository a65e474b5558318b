"""``examples/gan.py`` (issue 17) runs: two named optimizers, a step for each, a checkpoint that
holds both; the generator's samples move from around 0 to the target N(3, 0.5)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gan_example_learns_the_target_mean(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gan", ROOT / "examples" / "gan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mean, std = module.main(root=str(tmp_path), micro_batches=300)
    assert abs(mean - 3.0) < 1.0 and 0.1 < std < 1.5  # the untrained generator's mean is 0.04
    assert len(list(tmp_path.iterdir())) == 1  # the checkpoint it saved and loaded back

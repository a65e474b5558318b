"""``import steplib`` costs almost nothing beyond torch: the heavy optional layers (torchmetrics
and what it pulls in, tqdm's notebook front ends, transformers) are imported at first use.

Each check runs in a fresh interpreter: this test process has imported them all already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import bench_import

# A module here, or any module under it, must not be loaded by importing steplib's packages.
NOT_AT_IMPORT = (
    "torchmetrics",  # ~0.4 s with its functional tree (and matplotlib through its plots)
    "matplotlib",
    "transformers",  # pulled in by torchmetrics' text metrics where it is installed
    "tqdm.auto",  # prints "IProgress not found" in a kernel without ipywidgets
    "tqdm.notebook",
    "tqdm.autonotebook",
)


def modules_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_AT_IMPORT)]


def test_importing_steplib_and_its_handler_packages_loads_no_optional_layer() -> None:
    loaded = modules_after("import steplib, steplib.checkpoint, steplib.handlers")
    assert "steplib.handlers.evaluation" in loaded  # the Evaluator's module itself is there
    assert heavy(loaded) == []


def test_torchmetrics_is_imported_at_the_first_evaluation() -> None:
    loaded = modules_after(
        "import torch, steplib\n"
        "import sys\n"
        "assert 'torchmetrics' not in sys.modules\n"
        "from torchmetrics import MeanMetric\n"
        "eval_step = steplib.make_eval_step(lambda m, b: m(b).mean())\n"
        "print(steplib.evaluate(eval_step, torch.nn.Linear(2, 1), [torch.ones(2, 2)],"
        " metrics={'m': MeanMetric()}))"
    )
    assert "torchmetrics" in loaded


def test_the_import_benchmark_prints_both_figures_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = bench_import.main(["--runs", "1", "--top", "3"])
    printed = capsys.readouterr().out
    assert set(figures) == {"torch_s", "steplib_s", "ratio"}
    assert figures["steplib_s"] > 0 and figures["torch_s"] > 0
    assert "import torch" in printed and "import steplib" in printed and "ratio" in printed

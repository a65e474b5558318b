"""The notebooks run top to bottom on CPU, every cell can be run twice, and git stores them clean.

Each notebook is executed in a fresh Jupyter kernel that runs *this* interpreter (a kernel spec
written to a temporary ``JUPYTER_PATH``), so a fresh ``make test`` venv needs only ``nbclient``,
``nbformat``, ``ipykernel`` and ``matplotlib`` (the ``dev`` extra), and a user's own global
``python3`` kernel cannot be picked by mistake. The working directory is a temporary one:
whatever a notebook writes (``runs/...``) lands there.

Every code cell is executed twice in a row: the second run is the user pressing Shift-Enter
again, which must be safe (DESIGN.md §4: no global state). Warnings printed by a cell fail the
test: they are what a user would see first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# Some jupyter_core 5.x releases warn (DeprecationWarning, an error here) about their directory
# convention unless told; platformdirs is the future default, and no user directory is read.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "steplib-test-python"
TIME_LIMIT_S = 120  # the budget per notebook is one minute on CPU; twice for the re-runs


def test_the_seven_notebooks_are_there() -> None:
    names = [path.stem for path in NOTEBOOKS]
    assert names == [
        "01_quickstart",
        "02_composing",
        "03_testing_step_pieces",
        "04_checkpoints_and_resume",
        "05_evaluation_and_logging",
        "06_distributed",
        "07_sweeps",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    dirty = [
        index
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; strip them before committing"


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kernel spec for this interpreter, found through JUPYTER_PATH; returns the work dir."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "steplib tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # The kernel and every process it starts (torchrun ranks) share 2 CPU cores with other
    # test processes: one thread each, and OpenMP threads sleep instead of spinning.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    return work


# Warnings a user sees today that are not the notebooks' doing; each names what removes it.
KNOWN_WARNINGS: tuple[str, ...] = (
    # tqdm's "IProgress not found", printed in a kernel without ipywidgets when tqdm.auto is
    # imported: not by steplib (it uses tqdm.std there, steplib.handlers.terminal, and
    # tests/test_progress.py and tests/test_import_cost.py check it never imports tqdm.auto),
    # but by transformers (a test dependency since issue 28), which the notebook's own
    # `import torchmetrics` imports when it is installed. A user's kernel prints it too.
    "TqdmWarning: IProgress not found",
)


def _printed_warnings(outputs: list[Any]) -> list[str]:
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    return [
        line
        for line in text.splitlines()
        if "Warning" in line and not any(known in line for known in KNOWN_WARNINGS)
    ]


@pytest.mark.slow
@pytest.mark.timeout(TIME_LIMIT_S + 60)  # the check below says which limit; this one is a net
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_every_cell_can_be_rerun(path: Path, kernel_env: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=TIME_LIMIT_S,
        resources={"metadata": {"path": str(kernel_env)}},
    )
    started = time.monotonic()
    first_pass = 0.0
    images = 0
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            for attempt in ("first run", "re-run"):
                begun = time.monotonic()
                client.execute_cell(cell, index)  # raises CellExecutionError on an error
                if attempt == "first run":
                    first_pass += time.monotonic() - begun
                    images += sum("image/png" in out.get("data", {}) for out in cell.outputs)
                if "live-plot" in cell.metadata.get("tags", ()):
                    # LivePlot redraws one figure in place: one image, however many redraws.
                    shown = [o for o in cell.outputs if "image/png" in o.get("data", {})]
                    assert len(shown) == 1, f"{path.name} cell {index}: {len(shown)} images"
                warned = _printed_warnings(cell.outputs)
                assert not warned, f"{path.name} cell {index} ({attempt}) printed: {warned}"
    elapsed = time.monotonic() - started
    assert elapsed < TIME_LIMIT_S, f"{path.name} took {elapsed:.0f} s with re-runs"
    assert first_pass < TIME_LIMIT_S / 2, f"{path.name}: one pass took {first_pass:.0f} s"
    if path.stem in ("01_quickstart", "02_composing", "05_evaluation_and_logging", "07_sweeps"):
        assert images, f"{path.name} should show a plot"

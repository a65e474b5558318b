"""The migration guides' scripts (docs/migration/) train on tiny data and their loss falls.

Each ``examples/migrate_from_<x>.py`` is imported by path and its ``main(argv)`` called in this
process (torch is imported once for all of them); everything it writes goes to ``tmp_path``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = {
    "lightning": ["--max-steps", "60"],
    "accelerate": [],
    "ignite": ["--max-epochs", "4"],
    "hf_trainer": [],
    "base_trainer": ["--epochs", "6"],
}


def _load(name: str) -> ModuleType:
    path = ROOT / "examples" / f"migrate_from_{name}.py"
    spec = importlib.util.spec_from_file_location(f"migrate_from_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_migration_script_trains_and_its_loss_falls(name: str, tmp_path: Path) -> None:
    out_flag = "--output-dir" if name == "hf_trainer" else "--out"  # TrainingArguments' name
    result = _load(name).main([out_flag, str(tmp_path), *GUIDES[name]])
    first, last = result["first_loss"], result["last_loss"]
    assert result["steps"] > 0 and math.isfinite(first) and math.isfinite(last), result
    assert last < 0.5 * first, result


def test_every_guide_has_a_page_a_script_and_a_row_in_the_index() -> None:
    index = (ROOT / "docs" / "migration" / "README.md").read_text()
    for name in GUIDES:
        page = ROOT / "docs" / "migration" / f"{name}.md"
        assert page.exists(), page
        assert f"examples/migrate_from_{name}.py" in page.read_text(), page
        assert f"({name}.md)" in index, f"docs/migration/README.md does not link {name}.md"
    scripts = {p.stem for p in (ROOT / "examples").glob("migrate_from_*.py")}
    assert scripts == {f"migrate_from_{name}" for name in GUIDES}


def test_index_names_only_steplib_names_that_exist() -> None:
    """Every `steplib.X` / `from steplib... import X` name in the index table resolves."""
    import steplib

    index = (ROOT / "docs" / "migration" / "README.md").read_text()
    for dotted in sorted(set(re.findall(r"`(steplib(?:\.\w+)+)", index))):
        module_name, _, attribute = dotted.rpartition(".")
        module = importlib.import_module(module_name)
        assert hasattr(module, attribute), f"{dotted} in docs/migration/README.md does not exist"
    rows = [line for line in index.splitlines() if line.startswith("| ") and "steplib" not in line]
    calls = {
        name
        for row in rows
        for name in re.findall(r"`((?:\w+\.)*\w+)\(", row.rstrip(" |").rsplit(" | ", 1)[-1])
    }  # calls that open a code span in the last (steplib) column
    assert {"accumulate", "clip", "amp_wrap", "checkpoint_every", "EarlyStopping"} <= calls
    users = {"loss_fn", "eval_fn", "step", "events", "state"}  # the user's own values
    for name in sorted(calls):
        first, *rest = name.split(".")
        if first in users:
            continue
        # An everyday name, or one of a subpackage written with it (handlers.Log).
        assert first in steplib.__all__ or isinstance(getattr(steplib, first, None), ModuleType), (
            f"{name}( in the steplib column is neither in steplib.__all__ nor in a subpackage"
        )
        target: object = steplib
        for part in (first, *rest):
            assert hasattr(target, part), f"steplib.{name} in the index does not exist"
            target = getattr(target, part)


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_guide_quotes_its_script_verbatim(name: str) -> None:
    page = (ROOT / "docs" / "migration" / f"{name}.md").read_text()
    quoted = re.findall(r"<!-- from (\S+) -->\n```python\n(.*?)```", page, re.DOTALL)
    assert quoted, f"{name}.md quotes none of its script"
    for source, code in quoted:
        assert source == f"examples/migrate_from_{name}.py"
        assert code in (ROOT / source).read_text(), f"{name}.md's copy of {source} is out of date"


def test_accelerate_script_on_two_ranks_resumes_inside_an_epoch_where_it_stopped(
    tmp_path: Path,
) -> None:
    """Under torchrun the script's data position is saved too: resumed from update 20 (inside
    the third epoch), its updates 21 to 30 equal those of the run that did not stop. (With a
    DistributedSampler it trained that epoch's first batches again, with a warning.)"""
    script = ROOT / "examples" / "migrate_from_accelerate.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"], env["OMP_NUM_THREADS"] = str(ROOT), "1"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    launch += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(script)]
    launch += ["--out", str(tmp_path), "--max-steps", "30"]

    def result() -> dict[str, Any]:
        # Each rank's stdout to a file of its own: torchrun runs them unbuffered (-u), so the
        # two ranks' result lines could interleave on one stream.
        logs = tmp_path / f"logs-{len(list(tmp_path.glob('logs-*')))}"
        started = [*launch[:5], f"--log-dir={logs}", "--redirects=1", *launch[5:]]
        done = subprocess.run(started, env=env, capture_output=True, text=True, timeout=240)
        outputs = sorted(logs.rglob("stdout.log"))
        printed = [line for out in outputs for line in out.read_text().splitlines()]
        assert done.returncode == 0, "\n".join([*printed, done.stdout, done.stderr])
        assert "CheckpointWarning" not in done.stderr, done.stderr
        printed = [line for line in printed if line.startswith("{")]
        assert len(printed) == 2 and printed[0] == printed[1], printed  # both ranks
        return dict(ast.literal_eval(printed[0]))

    whole = result()  # saves at updates 20 and 30 (its end)
    assert (whole["steps"], whole["world_size"]) == (30, 2)
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000030")
    resumed = result()  # from update 20: 20 updates of 4 micro-batches, 32 batches an epoch
    assert resumed["last_loss"] == whole["last_loss"]  # the mean of updates 26 to 30


def test_hf_trainer_script_reports_the_updates_it_trained_not_the_best_checkpoints(
    tmp_path: Path,
) -> None:
    """Stopped early after its best evaluation, the script loads the best checkpoint (whose
    counters are older): ``steps`` is still the number of updates trained, as HF's
    ``TrainOutput.global_step`` is, and ``best_step`` the best's. It reported the best's."""
    argv = ["--output-dir", str(tmp_path), "--learning-rate", "0.2", "--max-steps", "100"]
    result = _load("hf_trainer").main([*argv, "--early-stopping-patience", "1"])
    lines = (tmp_path / "trainer_state.jsonl").read_text().splitlines()
    logged = max(json.loads(line)["step"] for line in lines)
    assert result["best_step"] < logged < 100, result  # stopped early, after its best
    assert result["steps"] == logged, result


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_script_accuracy_is_correct_over_total_as_in_the_code_it_replaces(name: str) -> None:
    """Every "before" loop computes accuracy as correct / total (ignite's ``Accuracy()``,
    Lightning's and BaseTrainer's ``(argmax == y).float().mean()``, HF's ``compute_metrics``).
    torchmetrics' ``MulticlassAccuracy`` defaults to ``average="macro"``, the mean of the
    per-class accuracies: another number on unbalanced classes (0.456 instead of 0.740 below).
    Each script's metric, built with its own keywords, must give the replaced number."""
    import torch
    import torchmetrics

    tree = ast.parse((ROOT / "examples" / f"migrate_from_{name}.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "MulticlassAccuracy"
    ]
    if name == "accelerate":
        assert not calls  # a regression: it evaluates no accuracy
        return
    assert calls, f"migrate_from_{name}.py builds no MulticlassAccuracy"
    generator = torch.Generator().manual_seed(0)
    target = torch.cat([torch.zeros(90, dtype=torch.long), torch.ones(10, dtype=torch.long)])
    logits = torch.randn(100, 2, generator=generator)
    logits[:, 0] += 1.0  # favours the common class: its accuracy is high, the rare one's low
    correct_over_total = (logits.argmax(1) == target).float().mean()
    for call in calls:
        settings: dict[str, Any] = {
            str(k.arg): ast.literal_eval(k.value)
            for k in call.keywords
            if k.arg not in (None, "num_classes")
        }
        metric = torchmetrics.classification.MulticlassAccuracy(num_classes=2, **settings)
        metric.update(logits, target)
        assert torch.allclose(metric.compute(), correct_over_total), (
            f"migrate_from_{name}.py's MulticlassAccuracy({settings}) gives "
            f"{float(metric.compute()):.3f}, the replaced code {float(correct_over_total):.3f}: "
            'pass average="micro"'
        )

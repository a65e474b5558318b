"""examples/demo.py runs end to end with tiny settings: log written, loss printed, text sampled."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from types import ModuleType

import orjson
import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def _load_demo(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # The demo sets OMP_WAIT_POLICY when imported; keep it from leaking into later tests'
    # subprocesses. setenv first so that monkeypatch records the original (set or not) and puts
    # it back; delenv then gives the demo the environment of a fresh process.
    monkeypatch.setenv("OMP_WAIT_POLICY", "unset-by-test")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    spec = importlib.util.spec_from_file_location("steplib_examples_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_trains_logs_and_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = _load_demo(monkeypatch)
    out_dir = tmp_path / "run"
    argv = ["--steps", "6", "--d-model", "32", "--layers", "1", "--seq-len", "32"]
    argv += ["--batch-size", "4", "--accumulate", "2", "--log-every", "2"]
    argv += ["--corpus-chars", "40000", "--out", str(out_dir), "--seed", "1"]
    state = demo.main(argv)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"

    assert state.step == 6
    printed = capsys.readouterr().out
    assert "held-out loss before training" in printed
    assert "held-out loss after 6 updates" in printed
    assert printed.count("step ") >= 3  # the lines at steps 2, 4 and 6
    sample = printed.split("sample:\n", 1)[1]
    assert sample.startswith("Return the ") and len(sample) > len("Return the ") + 100

    lines = [orjson.loads(line) for line in (out_dir / "metrics.jsonl").read_bytes().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [2, 4, 6]  # logged on the bar's read interval
    for line in steps:
        assert math.isfinite(line["loss"]) and line["num_targets"] == 2 * 4 * 32
        assert {"lr", "grad_norm", "accuracy", "time", "epoch", "micro_step"} <= set(line)
    assert math.isfinite(lines[-1]["val_loss"]) and lines[-1]["step"] == 6


def test_demo_corpus_is_deterministic_printable_text(monkeypatch: pytest.MonkeyPatch) -> None:
    demo = _load_demo(monkeypatch)
    text = demo.stdlib_docstrings(20_000)
    assert len(text) == 20_000
    assert text == demo.stdlib_docstrings(20_000)
    assert set(text) <= {chr(c) for c in range(32, 127)} | {"\n"}
    tokenizer = demo.CharTokenizer(text)
    assert tokenizer.decode(tokenizer.encode(text).tolist()) == text

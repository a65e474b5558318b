"""examples/demo.py runs end to end with tiny settings: log written, loss printed, text sampled."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
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


def test_demo_trains_evaluates_logs_plots_and_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = _load_demo(monkeypatch)
    out_dir = tmp_path / "run"
    argv = ["--steps", "6", "--d-model", "32", "--layers", "1", "--seq-len", "32"]
    argv += ["--batch-size", "4", "--accumulate", "2", "--log-every", "2", "--eval-every", "4"]
    argv += ["--eval-rows", "96", "--corpus-chars", "40000", "--out", str(out_dir), "--seed", "1"]
    state = demo.main(argv)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"

    assert state.step == 6
    printed = capsys.readouterr().out
    assert "model FLOPs per update" in printed
    assert "held-out loss after 6 updates" in printed and "(before: " in printed
    assert printed.count("step ") >= 3  # the lines at steps 2, 4 and 6
    sample = printed.split("sample:\n", 1)[1]
    assert sample.startswith("Return the ") and len(sample) > len("Return the ") + 100

    lines = [orjson.loads(line) for line in (out_dir / "metrics.jsonl").read_bytes().splitlines()]
    train = [line for line in lines if "loss" in line]
    assert [line["step"] for line in train] == [2, 4, 6]  # logged on the bar's read interval
    for line in train:
        # Running means over the 2 updates of each interval.
        assert math.isfinite(line["loss"]) and line["num_targets"] == 2 * 2 * 4 * 32
        assert line["updates"] == 2 and 0 <= line["accuracy"] <= 1
        assert {"lr", "time", "epoch", "tokens_per_s", "samples_per_s", "flops_per_s"} <= set(line)
    held_out = [line for line in lines if "val_loss" in line]
    # Before training (step 0), every 4 updates, and at the end (6 is not a multiple of 4).
    assert [line["step"] for line in held_out] == [0, 4, 6]
    assert all(math.isfinite(line["val_loss"]) for line in held_out)
    assert held_out[-1]["val_loss"] == pytest.approx(state.extras["val_loss"])
    assert held_out[-1]["val_loss"] < held_out[0]["val_loss"]  # it learned something

    plot = out_dir / "loss.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {plot}" in printed
    else:
        assert not plot.exists() and "matplotlib is not installed" in printed


def test_demo_skips_the_plot_with_a_note_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = _load_demo(monkeypatch)
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"step": 2, "loss": 3.0}\n{"step": 2, "val_loss": 3.5}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert demo.plot_losses(str(log), str(tmp_path / "loss.png")) is False
    assert "matplotlib is not installed (pip install 'steplib[plot]')" in capsys.readouterr().out
    assert not (tmp_path / "loss.png").exists()


def test_demo_corpus_is_deterministic_printable_text(monkeypatch: pytest.MonkeyPatch) -> None:
    demo = _load_demo(monkeypatch)
    text = demo.stdlib_docstrings(20_000)
    assert len(text) == 20_000
    assert text == demo.stdlib_docstrings(20_000)
    assert set(text) <= {chr(c) for c in range(32, 127)} | {"\n"}
    tokenizer = demo.CharTokenizer(text)
    assert tokenizer.decode(tokenizer.encode(text).tolist()) == text


def test_demo_preempted_then_resumed_equals_uninterrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    demo = _load_demo(monkeypatch)
    argv = ["--steps", "8", "--d-model", "32", "--layers", "1", "--seq-len", "32"]
    argv += ["--batch-size", "4", "--accumulate", "2", "--log-every", "2", "--seed", "1"]
    argv += ["--corpus-chars", "40000", "--checkpoint-every", "2"]
    whole = demo.main([*argv, "--out", str(tmp_path / "whole")])
    capsys.readouterr()

    real_loss_fn = demo.loss_fn
    calls = []

    def loss_fn(model, batch):  # SIGTERM in the middle of the 4th update, as a scheduler would
        calls.append(1)
        if len(calls) == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_loss_fn(model, batch)

    monkeypatch.setattr(demo, "loss_fn", loss_fn)
    with pytest.raises(SystemExit) as stopped:
        demo.main([*argv, "--out", str(tmp_path / "split")])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert "preempted: saved" in capsys.readouterr().out
    monkeypatch.setattr(demo, "loss_fn", real_loss_fn)
    resumed = demo.main([*argv, "--out", str(tmp_path / "split"), "--resume"])
    for a, b in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert a.equal(b)

"""``examples/gan.py`` runs a GAN through ``run`` (issue 28): two steps over one state with
every handler. It learns the target; killed with SIGKILL mid-epoch, or preempted with SIGTERM,
and run again, it resumes from its periodic checkpoint and ends bit for bit where the
uninterrupted run ends: every later loss of both steps, both models, both Adam states, the
evaluator's history and the epoch count."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from steplib import Event, Events

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3  # 50 updates of each step per epoch


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gan", ROOT / "examples" / "gan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder:
    """Each update's losses of both steps, by ``state.step`` (G's updates)."""

    def __init__(self) -> None:
        self.losses: dict[int, tuple[float, float]] = {}

    def attach(self, events: Events) -> Events:
        return events.on("step_end", self.record)

    def record(self, event: Event) -> None:
        assert event.outputs is not None
        self.losses[event.step] = (
            event.outputs["D"].loss.item(),
            event.outputs["G"].loss.item(),
        )


def _final(state: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "G": state.optimizer.state_dict(),
        "D": state["D"].optimizer.state_dict(),
        "counters": (state.step, state["D"].step, state.micro_step, state.epoch),
        "extras": dict(state.extras),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Recorder]:
    recorder = Recorder()
    root = tmp_path_factory.mktemp("reference")
    mean, std, state = _example().main(str(root), epochs=EPOCHS, handlers=[recorder])
    assert 2.0 < mean < 4.0 and 0.1 < std < 1.5  # the untrained generator's mean is 0.04
    assert (state.step, state["D"].step, state.epoch) == (150, 150, EPOCHS)
    assert sorted(recorder.losses) == list(range(1, 151))
    return _final(state), recorder


def _assert_same(resumed: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, tensor in expected["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    for lane in ("G", "D"):
        saved, now = expected[lane]["state"], resumed[lane]["state"]
        for index, buffers in saved.items():
            for key, value in buffers.items():
                assert torch.equal(now[index][key], value), (lane, index, key)
    assert resumed["counters"] == expected["counters"]
    assert resumed["extras"] == expected["extras"]  # the evaluation's values and the best


def test_the_gan_example_resumes_bit_for_bit_after_sigkill_mid_epoch(
    tmp_path: Path, reference: tuple[dict[str, Any], Recorder]
) -> None:
    script = textwrap.dedent(f"""
        import importlib.util, os, signal
        spec = importlib.util.spec_from_file_location("gan", {str(ROOT / "examples" / "gan.py")!r})
        gan = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gan)

        class Kill:  # update 40 of 50 in the first epoch; the last checkpoint is at 25
            def attach(self, events):
                return events.on("step_end", self.kill)

            def kill(self, event):
                if event.step == 40:
                    os.kill(os.getpid(), signal.SIGKILL)

        gan.main({str(tmp_path)!r}, epochs={EPOCHS}, handlers=[Kill()])
    """)
    killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]

    recorder = Recorder()
    _, _, state = _example().main(str(tmp_path), epochs=EPOCHS, handlers=[recorder])
    expected, full = reference
    assert min(recorder.losses) == 26  # resumed mid-epoch from the checkpoint at update 25
    assert recorder.losses == {s: full.losses[s] for s in range(26, 151)}
    _assert_same(_final(state), expected)


def test_the_gan_example_preempted_by_sigterm_saves_stops_and_resumes_bit_for_bit(
    tmp_path: Path, reference: tuple[dict[str, Any], Recorder]
) -> None:
    class Preempt:  # as a cluster scheduler would, at update 30
        def attach(self, events: Events) -> Events:
            return events.on("step_end", self.signal, once=30)

        def signal(self, event: Event) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    gan = _example()
    _, _, stopped = gan.main(str(tmp_path), epochs=EPOCHS, handlers=[Preempt()])
    assert (stopped.step, stopped["D"].step, stopped.epoch) == (30, 30, 0)  # saved there
    recorder = Recorder()
    _, _, state = gan.main(str(tmp_path), epochs=EPOCHS, handlers=[recorder])
    expected, full = reference
    assert recorder.losses == {s: full.losses[s] for s in range(31, 151)}
    _assert_same(_final(state), expected)

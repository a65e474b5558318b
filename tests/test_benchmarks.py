"""Smoke tests of the overhead benchmark harness (benchmarks/bench_overhead.py).

They run the harness for a handful of updates and check what it writes and what it refuses;
they never assert a timing (this machine's speed is not the harness's business). Without the
``bench`` extra installed the peers are reported unavailable and raw + steplib still run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import bench_overhead as bench
from benchmarks.contenders import Contender, registry
from benchmarks.contenders.raw import RawContender
from benchmarks.contenders.steplib_loop import SteplibContender
from benchmarks.workloads import WORKLOADS

TINY_PLAN = bench.Plan(
    warmup_steps=2, steps_per_round=1, discard_rounds=1, rounds=2, memory_steps=1
)
PEERS = ("fabric", "ignite", "accelerate", "trainer")


class PerturbedRaw(RawContender):
    """The raw loop from weights that differ by 1e-6 in one element: must fail the gate."""

    name = "perturbed"
    label = "perturbed raw"

    def build(self) -> None:
        super().build()
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] += 1e-6


class Exploding(RawContender):
    """A contender that raises while being timed: reported as an error, the run goes on."""

    name = "exploding"
    label = "exploding"

    def advance(self, steps: int) -> None:
        if getattr(self, "_warm", False):
            raise RuntimeError("boom")
        super().advance(steps)
        self._warm = True


def run_tiny(classes: list[type[Contender]], **kwargs: Any) -> dict[str, Any]:
    return bench.run_workload(
        WORKLOADS["tiny"],
        classes=classes,
        plan=TINY_PLAN,
        device=torch.device("cpu"),
        memory=False,
        log=lambda _line: None,
        **kwargs,
    )


def test_quick_run_writes_the_expected_json(tmp_path: Path) -> None:
    output = tmp_path / "overhead.json"
    assert (
        bench.main(["--quick", "--workload", "tiny", "--no-memory", "--output", str(output)]) == 0
    )
    report = json.loads(output.read_text(), parse_constant=_reject_non_standard)

    assert report["schema"] == bench.SCHEMA
    assert report["versions"]["torch"] == torch.__version__
    assert set(report["versions"]) >= {"python", "torch", "steplib", "lightning", "accelerate"}
    assert report["machine"]["torch_num_threads"] == 1
    section = report["workloads"]["tiny"]
    assert set(report["workloads"]) == {"tiny"}
    assert section["recipe"]["accumulation"] == 4
    assert section["recipe"]["clip_grad_norm"] == 1.0
    contenders = section["contenders"]
    assert list(contenders) == list(registry())  # every contender is reported, in order

    for name, entry in contenders.items():
        cls = registry()[name]
        if not cls.available():
            assert entry["status"] == "unavailable", name
            continue
        # Every contender that ran reached the raw loop's weights bit for bit, before and after
        # timing, and has a full timing summary.
        assert entry["status"] == "ok", (name, entry.get("reason"))
        for check in entry["weights"].values():
            assert check["bit_identical"] and check["max_abs_diff"] == 0.0
        timing = entry["timing"]
        assert timing["rounds"] == bench.QUICK_PLANS["tiny"].rounds
        for key in ("us_per_step", "ratio_to_raw"):
            summary = timing[key]
            assert set(summary) == {
                "median",
                "p10",
                "q1",
                "q3",
                "p90",
                "median_ci95_lo",
                "median_ci95_hi",
            }
            assert summary["p10"] <= summary["median"] <= summary["p90"]
            assert summary["median"] > 0
    assert contenders["raw"]["timing"]["ratio_to_raw"]["median"] == 1.0
    assert contenders["steplib"]["status"] == "ok"  # never skipped, peers or not
    assert section["plan"]["recorded_rounds"] == bench.QUICK_PLANS["tiny"].rounds
    # steplib reads no tensor to the host beyond what the raw loop's optimizer reads.
    assert contenders["steplib"]["host_reads_per_step"] == contenders["raw"]["host_reads_per_step"]


def _reject_non_standard(constant: str) -> None:
    raise AssertionError(f"the JSON holds {constant}, which standard JSON does not allow")


def test_weight_gate_rejects_a_contender_whose_weights_differ() -> None:
    section = run_tiny([RawContender, SteplibContender, PerturbedRaw])
    bad = section["contenders"]["perturbed"]
    assert bad["status"] == "failed"
    assert "weights differ" in bad["reason"]
    assert "timing" not in bad  # a failed contender is not timed
    check = bad["weights"]["before_timing"]
    assert not check["bit_identical"] and check["max_abs_diff"] > 0
    assert section["contenders"]["steplib"]["status"] == "ok"


def test_weight_gate_tolerance_accepts_a_small_difference() -> None:
    section = run_tiny([RawContender, PerturbedRaw], atol=1e-3)
    entry = section["contenders"]["perturbed"]
    assert entry["status"] == "ok"
    assert not entry["weights"]["before_timing"]["bit_identical"]


def test_a_contender_that_raises_is_reported_and_the_rest_are_timed() -> None:
    section = run_tiny([RawContender, Exploding, SteplibContender])
    assert section["contenders"]["exploding"]["status"] == "error"
    assert "boom" in section["contenders"]["exploding"]["reason"]
    assert section["contenders"]["steplib"]["status"] == "ok"


def test_missing_peers_are_reported_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    # What CI sees with only the `dev` extra: the peers are skipped, raw and steplib still run.
    classes = registry()
    for name in PEERS:
        monkeypatch.setattr(classes[name], "requires", ("not_an_installed_module_xyz",))
    section = run_tiny(list(classes.values()))
    for name in PEERS:
        assert section["contenders"][name]["status"] == "unavailable"
        assert "timing" not in section["contenders"][name]
    assert section["contenders"]["steplib"]["status"] == "ok"


def test_memory_is_measured_in_a_child_process() -> None:
    report = bench.measure_memory("steplib", WORKLOADS["tiny"], torch.device("cpu"), 2)
    assert "error" not in report, report
    assert report["rss_after_build_mib"] > 0
    assert report["process_peak_rss_mib"] >= report["rss_after_build_mib"]
    assert report["train_peak_over_build_mib"] >= 0


def test_raw_loop_is_required() -> None:
    with pytest.raises(ValueError, match="raw loop"):
        run_tiny([SteplibContender])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_cuda_mode_skips_cleanly_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "gpu.json"
    assert bench.main(["--device", "cuda", "--quick", "--output", str(output)]) == 0
    assert "skipping" in capsys.readouterr().out
    assert not output.exists()


@pytest.mark.gpu
def test_cuda_quick_run_counts_host_syncs(tmp_path: Path) -> None:
    output = tmp_path / "gpu.json"
    args = ["--device", "cuda", "--quick", "--workload", "tiny", "--no-memory"]
    assert bench.main([*args, "--contenders", "steplib", "--output", str(output)]) == 0
    contenders = json.loads(output.read_text())["workloads"]["tiny"]["contenders"]
    for name in ("raw", "steplib"):
        assert contenders[name]["status"] == "ok", contenders[name].get("reason")
        assert contenders[name]["host_syncs_per_step"] >= 0


def test_profile_reports_every_phase_and_restores_steplib() -> None:
    from benchmarks.profile_phases import ROWS, profile
    from steplib.state import TrainState
    from steplib.step import core

    originals = (core.Step.__call__, core.apply, TrainState.replace, core.Runner.process_grads)
    report = profile(WORKLOADS["tiny"], rounds=2, updates_per_round=1)

    rows = report["us_per_update"]
    assert list(rows) == [*ROWS, "total"]
    for row in ROWS:  # steplib runs every phase; the raw loop has no bookkeeping of its own
        assert rows[row]["steplib"] > 0, row
    assert rows["step call bookkeeping"]["raw"] == rows["state replacement"]["raw"] == 0
    assert rows["phase 2: grad processing"]["raw"] > 0
    # the timers are gone once the profile is taken
    after = (core.Step.__call__, core.apply, TrainState.replace, core.Runner.process_grads)
    assert after == originals

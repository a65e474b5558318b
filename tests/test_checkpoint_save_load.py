"""save / load / latest / list_checkpoints: what a checkpoint holds, through every kind of URL."""

from __future__ import annotations

import dataclasses
import io
import random
from pathlib import Path

import fsspec
import numpy as np
import orjson
import pytest
import torch
import xxhash
from torch import nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from steplib import ConfigError, TrainState, accumulate, clip, make_train_step
from steplib.checkpoint import (
    CorruptCheckpointError,
    checkpoint_every,
    latest,
    list_checkpoints,
    load,
    save,
)
from steplib.checkpoint.manifest import Manifest
from steplib.checkpoint.storage import FileRecord
from tests.checkpoint_helpers import assert_same, make_state, memory_dir, snapshot, train
from tests.reference import make_batches, mean_loss

__all__ = ["memory_dir"]  # the fixture, used by name


def _urls(tmp_path: Path, memory_dir: str) -> dict[str, str]:
    return {
        "local path": str(tmp_path / "ckpt"),
        "file://": f"file://{tmp_path}/ckpt-file",
        "memory://": memory_dir,
    }


@pytest.mark.parametrize("kind", ["local path", "file://", "memory://"])
def test_round_trip_restores_model_optimizer_scheduler_counters_and_extras(
    kind: str, tmp_path: Path, memory_dir: str
) -> None:
    directory = _urls(tmp_path, memory_dir)[kind]
    state = train(make_state(extras={"best": 1.5, "tag": "run-1", "ids": torch.arange(3)}))
    want = snapshot(state)
    url = save(state, directory)
    assert url == f"{directory}/step-00000003"

    train(state, n=2, seed=9)  # the same objects move on
    fresh = make_state(seed=5)
    loaded = load(url, fresh)
    got = snapshot(loaded)
    assert_same(got, want)
    assert loaded.extras["best"] == 1.5 and loaded.extras["tag"] == "run-1"
    assert torch.equal(loaded.extras["ids"], torch.arange(3))
    assert loaded.model is fresh.model  # loaded in place into the given objects
    with pytest.raises(TypeError):
        loaded.extras["x"] = 1  # type: ignore[index]  # read-only, like TrainState.create's


def test_resumed_training_continues_bit_for_bit(memory_dir: str) -> None:
    batches = make_batches(6, seed=3)
    step = make_train_step(mean_loss)
    state = make_state(dropout=0.3)
    torch.manual_seed(11)
    for batch in batches[:3]:
        state, _ = step(state, batch)
    url = save(state, memory_dir)
    for batch in batches[3:]:
        state, _ = step(state, batch)
    want = snapshot(state)

    resumed = load(url, make_state(seed=4, dropout=0.3))  # the RNG state (dropout) comes back
    for batch in batches[3:]:
        resumed, _ = step(resumed, batch)
    assert_same(snapshot(resumed), want)


def test_load_restores_torch_numpy_and_python_random(memory_dir: str) -> None:
    state = make_state()
    url = save(state, memory_dir)
    want = (torch.rand(3), np.random.rand(3), random.random())
    load(url, make_state())
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])
    assert got[2] == want[2]


def test_scaler_and_window_sums_keep_their_values_and_kinds(memory_dir: str) -> None:
    state = make_state(scaler=True)
    step = accumulate(make_train_step(mean_loss), 3)
    state = train(state, step, n=4)  # one update, then one micro-batch into the next window
    state.scaler.update(2.0**7)  # type: ignore[union-attr]
    url = save(state, memory_dir)
    assert url.endswith("step-00000001-micro-00000004")
    loaded = load(url, make_state(scaler=True))
    assert loaded.scaler.get_scale() == 2.0**7  # type: ignore[union-attr]
    assert loaded.window.size == 1
    assert isinstance(loaded.window.loss, torch.Tensor)
    assert torch.equal(loaded.window.loss, state.window.loss)  # type: ignore[arg-type]
    assert loaded.window.targets == state.window.targets
    # Between windows the sums are Python numbers (no kernel for a zero): kept as such.
    closed = load(save(train(make_state(), n=1), memory_dir), make_state())
    assert closed.window.loss == 0.0 and type(closed.window.loss) is float
    assert closed.window.targets == 0 and type(closed.window.targets) is int


def test_checkpoint_between_windows_clears_stale_gradients(memory_dir: str) -> None:
    url = save(train(make_state()), memory_dir)
    target = make_state()
    for p in target.model.parameters():
        p.grad = torch.ones_like(p)
    load(url, target)
    assert all(p.grad is None for p in target.model.parameters())


def test_extra_objects_are_saved_and_loaded_by_name(memory_dir: str) -> None:
    ema = nn.Linear(3, 3)
    url = save(make_state(), memory_dir, extras={"ema": ema})
    other = nn.Linear(3, 3)
    load(url, make_state(), extras={"ema": other})
    assert torch.equal(other.weight, ema.weight)


def test_a_torchmetrics_metric_in_extras_is_saved_with_what_it_accumulated_or_refused(
    memory_dir: str,
) -> None:
    # torchmetrics leaves a metric's states out of its state_dict() unless they are persistent
    # (not by default): saved as given, a running training accuracy resumed from zero, in silence.
    acc = MulticlassAccuracy(3)
    acc.update(torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 1, 1]))
    left_out = r"\['tp', 'fp', 'tn', 'fn'\] are not persistent"
    with pytest.raises(ConfigError, match=rf"extras\['acc'\] .*{left_out}.*\.persistent\(True\)"):
        save(make_state(), memory_dir, extras={"acc": acc})
    collection = MetricCollection({"acc": MulticlassAccuracy(3)})
    with pytest.raises(ConfigError, match=rf"extras\['train'\] .*{left_out}"):  # when built
        checkpoint_every(memory_dir, every=1, extras={"train": collection})
    assert list_checkpoints(memory_dir) == []

    acc.persistent(True)
    url = save(make_state(), memory_dir, extras={"acc": acc})
    resumed = MulticlassAccuracy(3)  # as the resumed process builds it
    load(url, make_state(), extras={"acc": resumed})
    for metric in (acc, resumed):
        metric.update(torch.tensor([0]), torch.tensor([0]))
    assert torch.equal(resumed.compute(), acc.compute())


def test_manifest_records_counters_versions_fingerprint_metrics_and_checksums(
    memory_dir: str,
) -> None:
    step = clip(accumulate(make_train_step(mean_loss), 2), max_norm=1.0)
    url = save(train(make_state(), step, n=4), memory_dir, step=step, metrics={"val": 0.5})
    body = orjson.loads(fsspec.open(f"{url}/manifest.json").open().read())
    assert body["step"] == 2 and body["micro_step"] == 4 and body["window_size"] == 0
    assert body["fingerprint"] == [
        {"wrapper": "accumulate", "k": 2},
        {"wrapper": "clip", "max_norm": 1.0, "norm_type": 2.0, "max_value": None},
    ]
    assert body["metrics"] == {"val": 0.5}
    assert body["versions"]["torch"] == torch.__version__
    assert set(body["files"]) == {"model.pt", "optimizer.pt", "train_state.pt"}
    assert body["version"] == 5
    assert all(len(f["xxh3_64"]) == 16 and f["bytes"] > 0 for f in body["files"].values())
    (info,) = list_checkpoints(memory_dir)
    assert (info.url, info.step, info.micro_step, info.metrics) == (url, 2, 4, {"val": 0.5})


def test_latest_is_the_newest_and_a_mid_window_checkpoint_sorts_after_its_step(
    memory_dir: str,
) -> None:
    step = accumulate(make_train_step(mean_loss), 3)
    state = make_state()
    urls = []
    for _ in range(5):  # micro-steps 1..5: updates after 3 (window of 3)
        state = train(state, step, n=1)
        urls.append(save(state, memory_dir))
    names = [c.name for c in list_checkpoints(memory_dir)]
    assert names == [
        "step-00000000-micro-00000001",
        "step-00000000-micro-00000002",
        "step-00000001",
        "step-00000001-micro-00000004",
        "step-00000001-micro-00000005",
    ]
    assert latest(memory_dir) == urls[-1]


def test_tied_weights_round_trip(memory_dir: str) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.embed(ids))
            return out

    torch.manual_seed(0)
    model = Tied()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    url = save(state, memory_dir)
    other = Tied()
    load(url, TrainState.create(model=other, optimizer=torch.optim.SGD(other.parameters())))
    assert torch.equal(other.embed.weight, model.embed.weight)
    assert other.head.weight is other.embed.weight


def test_saving_the_same_counters_again_replaces_the_checkpoint(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    state = make_state(extras={"version": 1})
    save(state, directory)
    url = save(state.replace(extras={"version": 2}), directory)
    assert [c.name for c in list_checkpoints(directory)] == ["step-00000000"]
    assert load(url, make_state()).extras["version"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000000"]


def test_save_refuses_values_a_weights_only_load_could_not_read(memory_dir: str) -> None:
    state = make_state(extras={"handler": object()})
    with pytest.raises(ConfigError, match=r"extras.*'handler'.*weights_only"):
        save(state, memory_dir)
    assert latest(memory_dir) is None  # nothing was written


class _Exploit:
    ran = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_mark_ran, ())


def _mark_ran() -> None:
    _Exploit.ran = True


def test_load_never_unpickles_code_even_with_a_valid_checksum(memory_dir: str) -> None:
    url = save(make_state(), memory_dir)
    fs = fsspec.filesystem("memory")
    path = url.removeprefix("memory://")
    payload = io.BytesIO()
    torch.save({"counters": _Exploit()}, payload)
    data = payload.getvalue()
    fs.pipe_file(f"{path}/train_state.pt", data)
    # A manifest that vouches for the forged file: only weights_only stands in the way.
    manifest = Manifest.from_json(fs.cat_file(f"{path}/manifest.json"), checkpoint=url)
    files = {
        **manifest.files,
        "train_state.pt": FileRecord(len(data), xxhash.xxh3_64_hexdigest(data)),
    }
    forged = dataclasses.replace(manifest, files=files)
    fs.pipe_file(f"{path}/manifest.json", forged.to_json())
    with pytest.raises(CorruptCheckpointError, match=r"train_state.pt.*weights_only"):
        load(url, make_state())
    assert not _Exploit.ran

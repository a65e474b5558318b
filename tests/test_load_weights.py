"""``load_weights``: fine-tuning from a checkpoint's model weights only (the optimizer, scheduler
and counters stay fresh), from a file of ``export_model``, from a sharded checkpoint, with the
names of DDP / compiled models, and the errors."""

from __future__ import annotations

import functools
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from steplib import ConfigError, TrainState, make_train_step
from steplib.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    load_weights,
    save,
)
from steplib.handlers import export_model
from steplib.testing import run_ranks
from tests import sharded_runs


def net(seed: int, *, head: str = "head", classes: int = 3) -> nn.ModuleDict:
    """A body (with BatchNorm buffers) and a head whose name and size a fine-tune changes."""
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
    return nn.ModuleDict({"body": body, head: nn.Linear(16, classes)})


def loss_fn(model: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    head = model["head"] if "head" in model else model["classifier"]
    return nn.functional.cross_entropy(head(model["body"](x)), y)


def batches(n: int, classes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=gen), torch.randint(0, classes, (6,), generator=gen))] * n


def fresh_state(model: nn.Module) -> TrainState:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    return TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)


def copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 updates of the pretraining run, checkpointed after the 2nd and the 3rd."""
    root = tmp_path_factory.mktemp("pretrain")
    step = make_train_step(loss_fn)
    state = fresh_state(net(0))
    weights, urls = [], []
    for i, batch in enumerate(batches(3, 3)):
        state, _ = step(state, batch)
        if i >= 1:
            urls.append(save(state, str(root / "ckpt"), step=step))
            weights.append(copy(state.model))
    return {"root": root, "urls": urls, "weights": weights, "state": state}


def test_fine_tune_loads_the_shared_weights_and_nothing_else(pretrained: dict[str, Any]) -> None:
    model = net(1, head="classifier", classes=5)  # a new head, under a new name
    state = fresh_state(model)
    new_head = copy(model["classifier"])
    with pytest.warns(CheckpointWarning, match=r"missing .*classifier\.weight, classifier\.bias"):
        report = load_weights(state, str(pretrained["root"] / "ckpt"), strict=False)  # newest
    assert report.missing_keys == ["classifier.weight", "classifier.bias"]
    assert report.unexpected_keys == ["head.weight", "head.bias"]
    saved = pretrained["weights"][-1]
    body = {k: v for k, v in model.state_dict().items() if k.startswith("body.")}
    assert len(body) == 7  # 2 Linear, 2 BatchNorm affine, 3 BatchNorm buffers
    for name, value in body.items():
        assert torch.equal(value, saved[name]), name
    for name, value in model["classifier"].state_dict().items():
        assert torch.equal(value, new_head[name]), name
    assert state.optimizer.state == {}
    assert state.scheduler is not None and state.scheduler.last_epoch == 0
    assert (state.step, state.micro_step, state.epoch) == (0, 0, 0)
    state, out = make_train_step(loss_fn)(state, batches(1, 5)[0])  # fine-tuning goes on
    assert state.step == 1 and bool(torch.isfinite(out.loss))


def test_strict_refuses_other_names_and_lists_them(pretrained: dict[str, Any]) -> None:
    model = net(1, head="classifier")
    before = copy(model)
    with pytest.raises(ConfigError) as err:
        load_weights(model, pretrained["urls"][0])
    message = str(err.value)
    assert "missing from the weights: classifier.weight, classifier.bias" in message
    assert "unexpected in the weights: head.weight, head.bias" in message
    assert "Pass strict=False" in message and pretrained["urls"][0] in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_other_shapes_are_refused_even_when_not_strict(pretrained: dict[str, Any]) -> None:
    model = net(1, classes=5)  # the head's name, another size
    before = copy(model)
    with pytest.raises(ConfigError, match=r"head\.weight \(3, 16\) in .*, \(5, 16\) here") as err:
        load_weights(model, pretrained["urls"][0], strict=False)
    assert "model.head = nn.Linear" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_ignore_mismatched_sizes_skips_other_shapes_and_reports_them(
    pretrained: dict[str, Any],
) -> None:
    # issue 28: HF's from_pretrained(ignore_mismatched_sizes=True); the head keeps its own.
    model = net(1, classes=5)  # the head's name, another size
    new_head = copy(model["head"])
    with pytest.warns(CheckpointWarning, match=r"other shapes: head\.weight \(3, 16\)"):
        report = load_weights(model, pretrained["urls"][0], ignore_mismatched_sizes=True)
    assert report.mismatched_keys == ["head.weight", "head.bias"]
    assert report == ([], [])  # no name differs
    saved = pretrained["weights"][0]
    for name, value in model.state_dict().items():
        assert torch.equal(value, new_head[name[5:]] if name.startswith("head.") else saved[name])
    with pytest.raises(ConfigError, match="ignore_mismatched_sizes=True"):
        load_weights(net(1, classes=5), pretrained["urls"][0])
    with pytest.raises(ConfigError, match="received 'yes'"):
        load_weights(model, pretrained["urls"][0], ignore_mismatched_sizes="yes")  # type: ignore[arg-type]


def test_the_report_of_skipped_shapes_does_not_say_all_keys_matched(
    pretrained: dict[str, Any],
) -> None:
    # torch's repr said "<All keys matched successfully>": a notebook showed it for a load
    # that had kept the new head's own weights.
    with pytest.warns(CheckpointWarning):
        report = load_weights(
            net(1, classes=5), pretrained["urls"][0], ignore_mismatched_sizes=True
        )
    shown = (
        "LoadedWeights(missing_keys=[], unexpected_keys=[], "
        "mismatched_keys=['head.weight', 'head.bias'])"
    )
    assert repr(report) == str(report) == shown
    assert repr(load_weights(net(1), pretrained["urls"][0])) == "<All keys matched successfully>"


def test_a_corrupt_checkpoint_is_caught_and_a_directory_falls_back(
    pretrained: dict[str, Any], tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(pretrained["root"] / "ckpt", root)
    newest = root / Path(pretrained["urls"][1]).name / "model.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    model = net(1)
    before = copy(model)
    with pytest.raises(CorruptCheckpointError, match=r"model\.pt has checksum"):
        load_weights(model, str(newest.parent))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.warns(CheckpointWarning, match="Skipped"):
        load_weights(model, str(root))  # the older checkpoint
    older = pretrained["weights"][0]
    assert all(torch.equal(v, older[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_model_files_round_trip(pretrained: dict[str, Any], fmt: str) -> None:
    url = f"memory://load-weights-{uuid.uuid4().hex}/model.{fmt}"  # fsspec, not a local path
    export_model(pretrained["state"], url, format=fmt)
    model = net(1)
    assert load_weights(model, url) == ([], [])
    saved = pretrained["weights"][-1]
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_ddp_and_compile_names_load_into_either(pretrained: dict[str, Any], tmp_path: Path) -> None:
    saved = pretrained["weights"][-1]
    path = tmp_path / "ddp.pt"  # what torch.save(ddp_model.state_dict()) writes
    torch.save({f"module.{k}": v for k, v in saved.items()}, path)
    plain = net(1)
    assert load_weights(plain, str(path)) == ([], [])
    compiled: Any = torch.compile(net(2))  # its own names start with _orig_mod.
    assert load_weights(compiled, str(path)) == ([], [])
    for model in (plain, compiled._orig_mod):
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_bad_sources_and_arguments_are_refused(tmp_path: Path) -> None:
    model = net(0)
    with pytest.raises(CheckpointError, match="no checkpoint, directory of checkpoints or file"):
        load_weights(model, str(tmp_path / "nothing"))
    lightning = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, lightning)
    with pytest.raises(ConfigError, match=r"not a state_dict .*'state_dict'"):
        load_weights(model, str(lightning))
    prefixed = tmp_path / "prefixed.pt"  # a LightningModule's names: "model." + the module's
    torch.save({f"model.{k}": v for k, v in model.state_dict().items()}, prefixed)
    with pytest.raises(ConfigError, match=r"no weight whose name .*rename them yourself"):
        load_weights(model, str(prefixed), strict=False)
    (tmp_path / "text.pt").write_text("not weights")
    with pytest.raises(ConfigError, match=r"cannot be read as a torch\.save file"):
        load_weights(model, str(tmp_path / "text.pt"))
    with pytest.raises(ConfigError, match=r"neither an nn\.Module nor a TrainState"):
        load_weights("model", str(lightning))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"strict=\.\.\.\) received 'yes'"):
        load_weights(model, str(lightning), strict="yes")  # type: ignore[arg-type]


def _fsdp_fine_tune(rank: int, world: int, *, root: str) -> dict[str, Any]:
    state, step, loader = sharded_runs.build("fsdp", rank)
    state, _ = sharded_runs.train(state, step, loader)
    url = save(state, root)  # sharded: DCP, each rank its shard
    trained = sharded_runs.full(state)["params"]
    state, _, _ = sharded_runs.build("fsdp", rank, seed=7)  # fresh weights and optimizer
    report = load_weights(state, url)
    params: list[Any] = list(state.model.parameters())  # DTensors: full_tensor() gathers
    loaded = [p.full_tensor().detach().clone() for p in params]
    return {
        "url": url,
        "trained": trained,
        "loaded": loaded,
        "report": tuple(report),
        "optimizer_state": len(state.optimizer.state),
        "step": state.step,
    }


def test_a_sharded_checkpoint_loads_into_fsdp_ranks_and_a_plain_module(tmp_path: Path) -> None:
    ranks = run_ranks(functools.partial(_fsdp_fine_tune, root=str(tmp_path)), timeout=90)
    for result in ranks:
        assert result["report"] == ([], [])
        assert result["optimizer_state"] == 0 and result["step"] == 0
        for loaded, trained in zip(result["loaded"], result["trained"], strict=True):
            assert torch.equal(loaded, trained)
    # In one process, without a process group: the body only, a new head.
    model: Any = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    with pytest.warns(CheckpointWarning, match=r"unexpected .*3\.weight, 3\.bias"):
        report = load_weights(model, ranks[0]["url"], strict=False)
    assert report == ([], ["3.weight", "3.bias"])
    assert torch.equal(model[0].weight, ranks[0]["trained"][0])
    assert torch.equal(model[0].bias, ranks[0]["trained"][1])


class _Scaled(nn.Linear):
    """A layer with a dict extra state of plain values and a tensor (as quantised layers have)."""

    def __init__(self) -> None:
        super().__init__(4, 2)
        self.scale: dict[str, Any] = {"value": 1.0, "name": "fresh", "zero_point": torch.zeros(2)}

    def get_extra_state(self) -> dict[str, Any]:
        return dict(self.scale)

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.scale = dict(state)


def _ddp_with_extra_state(rank: int, world: int, *, root: str) -> str:
    from steplib.distributed import apply_ddp

    torch.manual_seed(0)
    layer = _Scaled()
    layer.scale = {"value": 2.5, "name": "trained", "zero_point": torch.tensor([1.0, 2.0])}
    model = apply_ddp(nn.Sequential(layer))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    return save(state, root)  # sharded: the extra state is one of DCP's non-tensor values


def test_a_sharded_checkpoint_brings_back_a_dict_extra_state(tmp_path: Path) -> None:
    url, _ = run_ranks(functools.partial(_ddp_with_extra_state, root=str(tmp_path)), timeout=90)
    layer = _Scaled()
    assert load_weights(nn.Sequential(layer), url) == ([], [])
    scale = layer.scale
    assert (scale["value"], scale["name"]) == (2.5, "trained")
    # A tensor inside it goes through DCP under a dotted key; it comes back inside the dict.
    assert torch.equal(scale["zero_point"], torch.tensor([1.0, 2.0]))

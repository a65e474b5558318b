"""Model export: the file loads into a fresh model in a process that has only torch (and
safetensors), from a plain model, from 2-rank DDP and from 2-rank FSDP2 shards; safetensors
round trip with tied weights; the best-only export policy; bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from steplib import (
    ConfigError,
    Evaluator,
    Events,
    NewState,
    TrainState,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.handlers import EMA, ExportError, export_best, export_model, full_state_dict
from steplib.testing import run_ranks

# Runs in a fresh interpreter: builds the architecture with other initial weights, loads each
# file with torch / safetensors only, and saves the outputs on a fixed input.
_LOADER = """
import sys
import torch
from torch import nn

arch, out_path, *files = sys.argv[1:]
x = torch.linspace(-1, 1, 32).reshape(4, 8)
outputs = []
for path in files:
    torch.manual_seed(99)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)]
    if arch == "bn":
        layers.insert(1, nn.BatchNorm1d(16))
    model = nn.Sequential(*layers)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        weights = load_file(path)
    else:
        weights = torch.load(path, weights_only=True)
    model.load_state_dict(weights)  # strict: every name matches, none missing
    model.eval()
    with torch.no_grad():
        outputs.append(model(x))
assert not [name for name in sys.modules if name.split(".")[0] == "steplib"]
torch.save(outputs, out_path)
"""
_X = torch.linspace(-1, 1, 32).reshape(4, 8)


def _model(*, bn: bool = False, seed: int = 0) -> nn.Sequential:
    # No Flatten/view at the end: FSDP2 warns when a sharded module returns a view.
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)]
    if bn:
        layers.insert(1, nn.BatchNorm1d(16))
    return nn.Sequential(*layers)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(n)]


def _load_elsewhere(tmp_path: Path, arch: str, *files: str) -> list[torch.Tensor]:
    out = tmp_path / "outputs.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, arch, str(out), *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True)


def _outputs(weights: dict[str, torch.Tensor], *, bn: bool = False) -> torch.Tensor:
    model = _model(bn=bn, seed=7)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        return model(_X)


def test_a_plain_export_loads_into_a_fresh_model_without_steplib(tmp_path: Path) -> None:
    model = _model(bn=True)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state = run(make_train_step(_loss), state, _batches(3))  # weights and running stats move
    pt = export_model(state, str(tmp_path / "out" / "model.pt"))
    compiled: Any = torch.compile(model)  # not called: nothing compiles, only the wrapper
    st = export_model(compiled, str(tmp_path / "model.safetensors"), format="safetensors")
    assert pt == str(tmp_path / "out" / "model.pt")
    assert sorted(os.listdir(tmp_path / "out")) == ["model.pt"]  # no temporary file left

    loaded = _load_elsewhere(tmp_path, "bn", pt, st)
    model.eval()
    with torch.no_grad():
        expected = model(_X)
    assert torch.equal(loaded[0], expected) and torch.equal(loaded[1], expected)
    assert int(torch.load(pt, weights_only=True)["1.num_batches_tracked"]) == 3


def test_safetensors_round_trip_with_tied_weights_on_an_fsspec_url(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight  # one parameter under two names
            self.proj = nn.Linear(4, 4)

    model = Tied()
    model.proj.weight = nn.Parameter(torch.randn(4, 4).t())  # non-contiguous
    url = export_model(model, str(tmp_path / "tied.safetensors"), format="safetensors")
    weights = load_file(url)
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    with safe_open(url, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' loaders check
    fresh = Tied()
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.head.weight, model.embed.weight)

    memory = export_model(
        model, "memory://steplib-export-test/tied.safetensors", format="safetensors"
    )
    import fsspec
    from safetensors.torch import load

    with fsspec.open(memory, "rb") as f:
        again = load(f.read())
    assert all(torch.equal(again[k], v) for k, v in expected.items())


def _ddp_export(directory: str) -> Any:
    def train_and_export(rank: int, world: int) -> dict[str, Any]:
        from steplib import ddp_wrap
        from steplib.distributed import apply_ddp

        model = apply_ddp(_model())
        state = TrainState.create(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
        step = ddp_wrap(make_train_step(_loss))
        for batch in _batches(4, seed=10 + rank):
            state, _ = step(state, batch)
        url = export_model(state, f"{directory}/ddp.pt")
        result = {
            "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
            "exists": os.path.exists(url),  # on every rank once export_model returned
        }
        del model, state, step
        return result

    return train_and_export


def test_a_ddp_export_is_one_file_with_the_plain_modules_names(tmp_path: Path) -> None:
    results = run_ranks(_ddp_export(str(tmp_path)))
    assert all(r["exists"] for r in results)
    assert sorted(os.listdir(tmp_path)) == ["ddp.pt"]
    (loaded,) = _load_elsewhere(tmp_path, "mlp", str(tmp_path / "ddp.pt"))
    assert torch.equal(loaded, _outputs(results[0]["weights"]))
    assert set(torch.load(tmp_path / "ddp.pt", weights_only=True)) == set(_model().state_dict())


def _fsdp_export(directory: str) -> Any:
    def train_and_export(rank: int, world: int) -> dict[str, Any]:
        from steplib import fsdp_wrap
        from steplib.distributed import apply_fsdp

        model = apply_fsdp(_model(), blocks=[])
        state = TrainState.create(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
        step = fsdp_wrap(make_train_step(_loss))
        for batch in _batches(3, seed=20 + rank):
            state, _ = step(state, batch)
        local = [tuple(p.to_local().shape) for p in model.parameters()]  # type: ignore[attr-defined]
        export_model(state, f"{directory}/fsdp.pt")
        export_model(state, f"{directory}/fsdp.safetensors", format="safetensors")
        full = {
            name: p.full_tensor().detach().clone()  # type: ignore[attr-defined]
            for name, p in model.named_parameters()
        }
        own = full_state_dict(model)  # rank 0 only holds the gathered copy
        result = {"weights": full, "local": local, "own": sorted(own)}
        del model, state, step
        return result

    return train_and_export


def test_an_fsdp2_export_gathers_the_shards_into_one_file(tmp_path: Path) -> None:
    results = run_ranks(_fsdp_export(str(tmp_path)))
    assert results[0]["local"][0] == (8, 8)  # really sharded: half of Linear(8, 16) per rank
    assert results[0]["own"] == sorted(_model().state_dict()) and results[1]["own"] == []
    assert sorted(os.listdir(tmp_path)) == ["fsdp.pt", "fsdp.safetensors"]
    files = [str(tmp_path / "fsdp.pt"), str(tmp_path / "fsdp.safetensors")]
    loaded = _load_elsewhere(tmp_path, "mlp", *files)
    expected = _outputs(results[0]["weights"])
    assert torch.equal(loaded[0], expected) and torch.equal(loaded[1], expected)


def _extras_from(values: list[float]):
    def put(event: Any) -> NewState:
        return NewState(event.state.replace(extras={"val_loss": values[event.step - 1]}))

    return put


def test_export_best_writes_only_when_the_monitored_value_improves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import steplib.handlers.export

    exported: list[int] = []
    original = steplib.handlers.export.export_model

    def counting(state: TrainState, url: str, **kwargs: Any) -> str:
        exported.append(state.step)
        return original(state, url, **kwargs)

    monkeypatch.setattr(steplib.handlers.export, "export_model", counting)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    url = str(tmp_path / "best.pt")
    exporter = export_best(url, monitor="val_loss")
    events = Events()
    events.on("step_end", _extras_from([3.0, 2.0, 2.5, 1.0, 1.0, 4.0]))
    events.on("step_end", exporter)
    events.on(
        "step_end",
        lambda e: snapshots.__setitem__(
            e.step, {k: v.clone() for k, v in model.state_dict().items()}
        ),
    )
    run(make_train_step(_loss), state, _batches(6), events=events)

    assert exported == [1, 2, 4]  # a tie (step 5) is not an improvement
    assert (exporter.best.value, exporter.best.step) == (1.0, 4)
    saved = torch.load(url, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in snapshots[4].items())

    # Resumed with its state, the exporter waits for a value better than the saved best.
    again = export_best(url, monitor="val_loss")
    again.load_state_dict(exporter.state_dict())
    exported.clear()
    events = Events().on("step_end", _extras_from([1.5, 0.5])).on("step_end", again)
    run(make_train_step(_loss), state.replace(step=0), _batches(2), events=events)
    assert exported == [2]


def test_export_best_in_max_mode_with_safetensors(tmp_path: Path) -> None:
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    url = str(tmp_path / "best.safetensors")
    exporter = export_best(url, monitor="val_loss", mode="max", format="safetensors")
    events = Events().on("step_end", _extras_from([0.1, 0.3, 0.2])).on("step_end", exporter)
    run(make_train_step(_loss), state, _batches(3), events=events)
    assert exporter.best.step == 2 and set(load_file(url)) == set(model.state_dict())


def test_bad_input_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"format=...\) received 'onnx'"):
        export_model(model, str(tmp_path / "m.onnx"), format="onnx")
    with pytest.raises(ConfigError, match=r"TrainState or an nn\.Module"):
        export_model({"weight": torch.ones(1)}, str(tmp_path / "m.pt"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="monitor"):
        export_best(str(tmp_path / "m.pt"), monitor="")
    with pytest.raises(ConfigError, match="mode"):
        export_best(str(tmp_path / "m.pt"), monitor="val_loss", mode="lowest")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ConfigError, match=r"pip install 'steplib\[safetensors\]'"):
        export_model(model, str(tmp_path / "m.safetensors"), format="safetensors")
    with pytest.raises(ConfigError, match=r"steplib\[safetensors\]"):
        export_best(str(tmp_path / "m.safetensors"), monitor="val_loss", format="safetensors")


def test_a_missing_monitor_and_a_failed_write_are_explained(tmp_path: Path) -> None:
    model = _model()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    events = Events().on("step_end", export_best(str(tmp_path / "m.pt"), monitor="val_acc"))
    with pytest.raises(ConfigError, match=r"no 'val_acc' in state\.extras"):
        run(make_train_step(_loss), state, _batches(1), events=events)
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ExportError, match="could not write"):
        export_model(model, str(tmp_path / "a_file" / "m.pt"))


def _ema_run(tmp_path: Path, *, export_ema: bool) -> tuple[Any, EMA]:
    # The evaluator scores the EMA of the weights, not the weights trained.
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ema = EMA(model, decay=0.9)
    evaluator = Evaluator(
        make_eval_step(lambda m, b: m(b).pow(2).mean()),
        [torch.ones(2, 2)],
        metrics={"loss": torchmetrics.MeanMetric()},
        every=2,
        monitor="val_loss",
        model=ema.module,
    )
    url = str(tmp_path / "best.pt")
    given: dict[str, Any] = {"model": ema.module} if export_ema else {}
    exporter = export_best(url, monitor="val_loss", **given)
    events = Events(ema, evaluator).on("step_end", exporter, every=2)
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    run(step, state, [torch.ones(2, 2)] * 4, events=events)
    return exporter, ema


def test_export_best_of_another_modules_score_is_refused_naming_the_fix(tmp_path: Path) -> None:
    # Before, it exported the trained weights under the EMA's score (0.0216, for weights that
    # score 2.8e-5): the file held one model under the other's score.
    with pytest.raises(ConfigError, match=r"exports state.model, but the Evaluator.*model=ema"):
        _ema_run(tmp_path, export_ema=False)
    assert not (tmp_path / "best.pt").exists()


def test_export_best_exports_the_module_given_whose_score_it_is(tmp_path: Path) -> None:
    exporter, ema = _ema_run(tmp_path, export_ema=True)
    exported = torch.load(tmp_path / "best.pt", weights_only=True)
    assert exporter.best.step == 4
    for name, tensor in ema.module.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    score = (torch.ones(2, 2) @ exported["weight"].T + exported["bias"]).pow(2).mean()
    assert score.item() == exporter.best.value


def _pipeline_export(directory: str):
    def train_and_export(rank: int, world: int) -> dict[str, Any]:
        from steplib.distributed import split_model
        from steplib.step import make_pipeline_step, pipeline_stage

        stages = split_model(_model(), split_points=["2"])  # Linear + Tanh, then Linear

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return ((output - target) ** 2).mean()

        step = make_pipeline_step(loss_fn, stages, n_microbatches=2)
        module = pipeline_stage(step).module
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        state = TrainState.create(model=module, optimizer=opt)
        for batch in _batches(2):  # every stage gets the same batch
            state, _ = step(state, batch)
        export_model(state, f"{directory}/pipeline.pt")
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    return train_and_export


def test_a_pipeline_export_holds_every_stage_not_rank_0s_alone(tmp_path: Path) -> None:
    # Rank 0 wrote its own stage's state_dict: a file of 0.weight and 0.bias, no error.
    parts = run_ranks(_pipeline_export(str(tmp_path)))
    assert sorted(parts[0]) == ["0.bias", "0.weight"] and sorted(parts[1]) == ["2.bias", "2.weight"]
    weights = {**parts[0], **parts[1]}
    loaded = _load_elsewhere(tmp_path, "mlp", str(tmp_path / "pipeline.pt"))
    assert torch.equal(loaded[0], _outputs(weights))


def _same_names_in_two_parts(rank: int, world: int) -> str:
    # Stages built by hand, each numbering its layers from 0: the names overlap.
    layers = [nn.Linear(8, 16), nn.Linear(16, 16)] if rank == 0 else [nn.Linear(16, 3)]
    part = nn.Sequential(*layers)
    try:
        export_model(part, "memory://export-two-parts/model.pt")
    except ConfigError as err:
        return str(err)
    return "no error"


def test_parts_of_a_model_that_share_a_name_are_refused_on_every_rank() -> None:
    for message in run_ranks(_same_names_in_two_parts):
        assert "rank 0 and rank 1 both hold '0.weight'" in message, message
        assert "split_model" in message

"""examples/lora_fine_tune.py: PEFT's LoRA on a tiny Llama built from a config, trained by
steplib. Its adapters equal a plain PyTorch loop's bit for bit (dropout in the adapters
included), the base is never changed, its checkpoints hold the adapters alone, a run stopped
and resumed equals the uninterrupted one, and a resume onto another base is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

import steplib as sl
from steplib.checkpoint import latest, load
from steplib.errors import ConfigError
from steplib.testing import reference_loop

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    # peft asks the model whether it checkpoints activations by transformers' old name.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def _example() -> ModuleType:
    path = ROOT / "examples" / "lora_fine_tune.py"
    spec = importlib.util.spec_from_file_location("lora_fine_tune", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _base_state(example: ModuleType) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in example.build_base().state_dict().items()}


def test_the_adapters_equal_a_plain_loop_and_the_base_is_untouched(tmp_path: Path) -> None:
    example = _example()
    final = example.main(str(tmp_path / "run"), max_steps=8, accumulation=2)

    # The plain loop: same seed, same model, the loader's batches in its order, token-weighted
    # accumulation over windows of 2 (steplib.testing.reference_loop is plain torch).
    sl.seed_everything(0)
    model = example.with_adapters(example.build_base())
    optimizer = torch.optim.AdamW(example.trainable(model), lr=1e-3)
    loader = sl.resumable_loader(
        example.sequences(64), batch_size=4, seed=0, collate_fn=example.pad
    )
    batches = list(loader)[:16]
    reference_loop(model, optimizer, batches=batches, loss_fn=example.loss_fn, accumulation=2)

    trained = dict(final.model.named_parameters())
    assert sum(p.requires_grad for p in trained.values()) == 8  # A, B of q, v in 2 layers
    for name, param in model.named_parameters():
        assert torch.equal(trained[name], param), name
    base = _base_state(example)
    for name, value in final.model.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base[name.replace(".base_layer", "")]), name


def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    example = _example()
    whole = example.main(str(tmp_path / "whole"), max_steps=8)
    first = example.main(str(tmp_path / "resumed"), max_steps=5)  # saved at 4 and at the end
    assert first.step == 5
    resumed = example.main(str(tmp_path / "resumed"), max_steps=8)  # a new process would too
    assert resumed.step == whole.step == 8
    for (name, a), b in zip(
        resumed.model.named_parameters(), whole.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(
        resumed.optimizer.state_dict()["state"][0]["exp_avg"],
        whole.optimizer.state_dict()["state"][0]["exp_avg"],
    )


def test_its_checkpoints_hold_the_adapters_alone_and_refuse_another_base(tmp_path: Path) -> None:
    example = _example()
    final = example.main(str(tmp_path), max_steps=2)
    url = latest(str(tmp_path))
    assert url is not None
    written = torch.load(Path(url) / "model.pt", weights_only=True)
    adapters = {n for n, p in final.model.named_parameters() if p.requires_grad}
    assert set(written) == adapters  # a Llama has no buffer in its state_dict
    base = sum(p.numel() for p in final.model.parameters() if not p.requires_grad)
    assert sum(t.numel() for t in written.values()) * 20 < base

    model = example.with_adapters(example.build_base(seed=1))  # another "pretrained" base
    other = sl.TrainState.create(
        model=model, optimizer=torch.optim.AdamW(example.trainable(model), lr=1e-3)
    )
    with pytest.raises(ConfigError, match="another base"):
        load(url, other)

"""Checkpoints of the trainable parameters alone (``trainable_only=True``): what LoRA and other
adapter fine-tunes save. The frozen base is not written; a resume finds it in the model, checks
it is the one trained on (a digest), and continues bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import steplib as sl
from steplib.checkpoint import AsyncSaver, latest, load, save
from steplib.errors import ConfigError


class Adapted(nn.Module):
    """A frozen "pretrained" base with a small trainable adapter beside it (LoRA's shape)."""

    def __init__(self, base_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(base_seed)
        self.base = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
        self.base.requires_grad_(False)
        torch.manual_seed(100)
        self.down, self.up = nn.Linear(8, 2, bias=False), nn.Linear(2, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _state(base_seed: int = 0) -> sl.TrainState:
    model = Adapted(base_seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sl.TrainState.create(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _data() -> sl.data.ResumableLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g)
    )
    return sl.resumable_loader(data, batch_size=8, seed=0)


def _run(root: Path, max_steps: int) -> sl.TrainState:
    step = sl.make_train_step(_loss)
    ckpt = sl.checkpoint_every(str(root), every=2, trainable_only=True)
    return sl.run(step, _state(), _data(), events=sl.Events(sl.resume_from(ckpt), ckpt),
                  max_steps=max_steps)  # fmt: skip


def test_it_holds_the_trainable_parameters_alone_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", max_steps=9)
    _run(tmp_path / "resumed", max_steps=5)  # saved at 4 and at its end, 5
    newest = latest(str(tmp_path / "resumed"))
    assert newest is not None
    written = torch.load(Path(newest) / "model.pt", weights_only=True)
    assert sorted(written) == sorted(  # the adapter and the base's BatchNorm statistics
        [
            "down.weight",
            "up.weight",
            *(f"base.1.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")),
        ]
    )
    resumed = _run(tmp_path / "resumed", max_steps=9)
    assert resumed.step == whole.step == 9
    theirs = whole.model.state_dict()
    for name, mine in resumed.model.state_dict().items():
        assert torch.equal(mine, theirs[name]), name
    moments = [s.optimizer.state_dict()["state"][0]["exp_avg"] for s in (resumed, whole)]
    assert torch.equal(*moments)


def test_an_async_save_holds_the_trainable_parameters_alone(tmp_path: Path) -> None:
    state = _state()
    with AsyncSaver() as saver:
        url = saver.save(state, str(tmp_path), trainable_only=True)
    assert "base.0.weight" not in torch.load(Path(url) / "model.pt", weights_only=True)
    assert load(url, _state()).step == 0  # over the same base


def test_a_load_onto_another_base_is_refused_before_anything_changes(tmp_path: Path) -> None:
    url = save(_state(), str(tmp_path), trainable_only=True)
    other = _state(base_seed=1)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ConfigError, match="another base") as caught:
        load(url, other)
    assert "the same pretrained weights" in str(caught.value)
    for name, value in other.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert load(url, _state()).step == 0  # the same base loads


def test_a_load_into_other_adapters_over_the_same_base_is_refused(tmp_path: Path) -> None:
    url = save(_state(), str(tmp_path), trainable_only=True)
    other = _state()
    other.model.extra = nn.Linear(8, 3, bias=False)  # a trainable adapter the saved run had not
    with pytest.raises(ConfigError, match=r"missing from the checkpoint: extra\.weight"):
        load(url, other)


def test_bad_inputs_are_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainable_only=\.\.\.\) received 'yes'"):
        sl.checkpoint_every(str(tmp_path), every=2, trainable_only="yes")  # type: ignore[arg-type]
    frozen = _state()
    frozen.model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameter of the model"):
        save(frozen, str(tmp_path), trainable_only=True)


def _unfrozen_run(root: Path, max_steps: int) -> sl.TrainState:
    # Gradual unfreezing: the base's last layer trains from update 3 on (its optimizer holds
    # every parameter; those without a gradient are skipped).
    model = Adapted()
    state = sl.TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    ckpt = sl.checkpoint_every(str(root), every=2, trainable_only=True)
    events = sl.Events(sl.resume_from(ckpt), ckpt)
    events.on("step_end", lambda e: model.base[3].requires_grad_(True), once=3)
    return sl.run(sl.make_train_step(_loss), state, _data(), events=events, max_steps=max_steps)


def test_a_run_unfrozen_after_its_start_resumes_over_the_base_it_saved(tmp_path: Path) -> None:
    # The base a checkpoint names is its own frozen parameters, not those of the model built
    # anew: a resume after the unfreeze was refused as "another base".
    whole = _unfrozen_run(tmp_path / "whole", max_steps=9)
    _unfrozen_run(tmp_path / "resumed", max_steps=5)  # saved at 4 and 5, after the unfreeze
    resumed = _unfrozen_run(tmp_path / "resumed", max_steps=9)
    assert resumed.step == whole.step == 9
    assert resumed.model.get_parameter("base.3.weight").requires_grad
    theirs = whole.model.state_dict()
    for name, mine in resumed.model.state_dict().items():
        assert torch.equal(mine, theirs[name]), name


def test_a_parameter_trained_then_frozen_is_refused_at_the_save(tmp_path: Path) -> None:
    # Frozen now, it counted as base: its trained values went into no checkpoint, and the
    # resume into the pretrained model was refused as "another base", with the training lost.
    def every_parameter_in_the_optimizer() -> sl.TrainState:
        model = Adapted()  # the base too: torch skips a parameter without a gradient
        return sl.TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))

    state, step, data = every_parameter_in_the_optimizer(), sl.make_train_step(_loss), list(_data())
    for batch in data[:2]:
        state, _ = step(state, batch)
    resumable = save(state, str(tmp_path), trainable_only=True)  # before the freeze: fine
    state.model.up.requires_grad_(False)
    state, _ = step(state, data[2])
    with pytest.raises(ConfigError, match=r"up\.weight are frozen now but were trained"):
        save(state, str(tmp_path), trainable_only=True)
    assert load(resumable, every_parameter_in_the_optimizer()).step == 2


def test_a_base_changed_during_the_run_is_refused_with_its_likely_cause(tmp_path: Path) -> None:
    # A momentum encoder (MoCo's key encoder: frozen, averaged in place after each update) is
    # left out as base; the resume found another base and said only "pretrained weights,
    # revision, dtype and adapters", not the cause the run itself made, nor its fix.
    def momentum(event: sl.Event) -> None:
        with torch.no_grad():
            for p in event.state.model.base.parameters():
                p.mul_(0.99).add_(0.01)

    def go(max_steps: int) -> sl.TrainState:
        ckpt = sl.checkpoint_every(str(tmp_path), every=2, trainable_only=True)
        events = sl.Events(sl.resume_from(ckpt), ckpt).on("step_end", momentum)
        return sl.run(sl.make_train_step(_loss), _state(), _data(), events=events,
                      max_steps=max_steps)  # fmt: skip

    go(4)
    with pytest.raises(ConfigError, match=r"changed during the run.*trainable_only=False"):
        go(6)

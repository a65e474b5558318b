"""Law 9 for the train/eval mode of each submodule: a fine-tune keeps its frozen body in eval
mode (its BatchNorm statistics fixed) and switches it to train mode at the unfreeze, keeping
one BatchNorm in eval mode. The handler that switched them runs once, before the stop; a run
resumed past it must train in the modes the saved run had, as the plain loop does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import steplib as sl

# A load on another number of ranks warns that no rank gets its saved generators back
# (tests/test_resume_other_world_size.py tests the warning); these tests are about the rest.
_RNG_NOT_RESTORED = "ignore:load. checkpoint .* is loaded on:steplib.errors.CheckpointWarning"
pytestmark = pytest.mark.filterwarnings(_RNG_NOT_RESTORED)

UNFREEZE_AT = 4  # updates with the head alone


def _model() -> tuple[nn.Module, nn.Sequential]:
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16)
    )
    model = nn.Sequential(body, nn.ReLU(), nn.Linear(16, 3))
    body.requires_grad_(False).eval()  # frozen, its statistics too
    return model, body


def _unfreeze(body: nn.Sequential) -> None:
    body.requires_grad_(True).train()
    body[1].eval()  # the first BatchNorm keeps its pretrained statistics


def _optimizer(model: nn.Module, body: nn.Module) -> torch.optim.Optimizer:
    head = [p for p in model.parameters() if all(p is not q for q in body.parameters())]
    groups: list[dict[str, Any]] = [{"params": body.parameters(), "lr": 1e-3}, {"params": head}]
    return torch.optim.AdamW(groups, lr=1e-2)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _steplib_run(root: Path, max_steps: int) -> sl.TrainState:
    model, body = _model()
    state = sl.TrainState.create(model=model, optimizer=_optimizer(model, body))
    checkpoints = sl.checkpoint_every(str(root), every=3)
    events = sl.Events(sl.resume_from(checkpoints), checkpoints)
    events.on("step_end", lambda event: _unfreeze(body), once=UNFREEZE_AT)
    loader = sl.resumable_loader(_data(), batch_size=8, seed=0)
    return sl.run(sl.make_train_step(_loss), state, loader, events=events, max_steps=max_steps)


def test_a_run_resumed_past_a_change_of_modes_trains_in_the_saved_modes(tmp_path: Path) -> None:
    model, body = _model()  # the plain loop, over the same batches
    optimizer = _optimizer(model, body)
    for update, batch in enumerate(sl.resumable_loader(_data(), batch_size=8, seed=0), 1):
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        if update == UNFREEZE_AT:
            _unfreeze(body)
    _steplib_run(tmp_path, max_steps=6)  # stopped after the change, saved at 6
    resumed = _steplib_run(tmp_path, max_steps=12)  # built in the first modes, then resumed
    assert resumed.step == 12
    modes = {name: m.training for name, m in resumed.model.named_modules()}
    assert modes == {name: m.training for name, m in model.named_modules()}
    assert modes["0"] and not modes["0.1"] and modes["0.4"]
    want = model.state_dict()
    for name, value in resumed.model.state_dict().items():  # BatchNorm statistics too
        assert torch.equal(value, want[name]), name


def test_a_ddp_checkpoint_resumed_into_a_plain_model_keeps_what_was_frozen_and_in_eval(
    tmp_path: Path,
) -> None:
    # The frozen parameters and the modules in eval mode are recorded by name. A checkpoint of
    # a DDP model recorded "module.0.0.weight"; resumed on one process into the plain model
    # (DCP reshards the tensors), no name matched: the frozen body trained again and its
    # BatchNorms left eval mode, in silence. Names are now recorded as DCP gives them.
    from steplib.distributed import apply_ddp
    from steplib.testing import run_ranks

    def saved(rank: int, world: int) -> list[bool]:
        model, body = _model()
        ddp = apply_ddp(model)
        state = sl.TrainState.create(model=ddp, optimizer=_optimizer(model, body))
        sl.checkpoint.save(state, str(tmp_path))
        del ddp, state
        return [p.requires_grad for p in model.parameters()]

    want = run_ranks(saved)[0]
    model, body = _model()
    optimizer = _optimizer(model, body)
    modes = [m.training for m in model.modules()]
    model.requires_grad_(True).train()  # built before its freeze, say: the checkpoint says
    state = sl.TrainState.create(model=model, optimizer=optimizer)
    url = sl.checkpoint.latest(str(tmp_path))
    assert url is not None
    sl.checkpoint.load(url, state)
    assert [p.requires_grad for p in model.parameters()] == want
    assert want.count(False) == len(list(body.parameters()))
    assert [m.training for m in model.modules()] == modes

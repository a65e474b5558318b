"""checkpoint_activations: same gradients (dropout too), forward recomputed in backward, same
state_dict keys and parameters, a clear error when nothing matches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import ConfigError, TrainState, make_train_step
from steplib.distributed.activation_checkpointing import checkpoint_activations


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.3)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return x + self.dropout(torch.tanh(self.inner(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 2))


def _loss(model: nn.Module, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, generator=gen)
    y = torch.randint(0, 2, (6,), generator=gen)
    torch.manual_seed(seed)  # the same dropout masks for both models
    return F.cross_entropy(model(x), y)


def test_gradients_equal_the_plain_model_and_blocks_run_forward_twice() -> None:
    plain, wrapped = _model(), _model()
    names = checkpoint_activations(wrapped, modules=Block)
    assert names == ["1", "2"]

    _loss(plain).backward()
    _loss(wrapped).backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad), name
    blocks = [m for m in wrapped.modules() if isinstance(m, Block)]
    assert [b.forwards for b in blocks] == [2, 2]  # forward, then recomputed in backward
    assert [m.forwards for m in plain.modules() if isinstance(m, Block)] == [1, 1]


def test_state_dict_keys_and_parameters_stay_the_same() -> None:
    model = _model()
    params = list(model.parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before wrapping
    checkpoint_activations(model, modules=lambda m: isinstance(m, Block))
    assert list(model.parameters()) == params
    assert list(model.state_dict()) == keys
    plain = _model()
    plain.load_state_dict(model.state_dict())  # loads into an unwrapped model

    state = TrainState.create(model=model, optimizer=opt)
    step = make_train_step(lambda m, b: _loss(m))
    before = copy.deepcopy(model.state_dict())
    state, out = step(state, None)
    assert bool(out.did_update)
    assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])


def test_a_matched_module_is_not_wrapped_inside_again() -> None:
    model = _model()
    names = checkpoint_activations(model, modules=(Block, nn.Linear))
    assert names == ["0", "1", "2", "3"]  # Block.inner is inside a wrapped Block


def test_nothing_matched_lists_the_classes() -> None:
    with pytest.raises(ConfigError, match="matched no submodule") as info:
        checkpoint_activations(_model(), modules=nn.Conv2d)
    assert "Block, Dropout, Linear" in str(info.value)


@pytest.mark.parametrize("modules", ["Block", (), (Block, int), 3])
def test_bad_selectors_are_config_errors(modules) -> None:
    with pytest.raises(ConfigError, match="modules="):
        checkpoint_activations(_model(), modules=modules)


def test_applying_twice_is_refused() -> None:
    model = _model()
    checkpoint_activations(model, modules=Block)
    with pytest.raises(ConfigError, match="already has checkpointed"):
        checkpoint_activations(model, modules=nn.Linear)

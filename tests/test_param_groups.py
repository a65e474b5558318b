"""``weight_decay_groups`` against nanoGPT's hand-written rule, and AdamW trained with its groups
against a hand-built two-group AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steplib.errors import ConfigError
from steplib.param_groups import weight_decay_groups


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.ln_1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, a final norm, a tied head."""

    def __init__(self, vocab: int = 11, d: int = 8, seq: int = 6, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def nanogpt_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # nanoGPT's GPT.configure_optimizers, verbatim in substance.
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]


def ids(group: dict) -> list[int]:
    return [id(p) for p in group["params"]]


def test_the_groups_are_nanogpts() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    model.wpe.weight.requires_grad_(False)  # frozen: in neither group
    ours, theirs = weight_decay_groups(model, 0.1), nanogpt_groups(model, 0.1)
    assert [ids(g) for g in ours] == [ids(g) for g in theirs]
    assert [g["weight_decay"] for g in ours] == [0.1, 0.0]
    everything = ids(ours[0]) + ids(ours[1])
    assert len(everything) == len(set(everything))  # the tied wte / lm_head weight once
    assert id(model.wte.weight) in ids(ours[0]) and id(model.wpe.weight) not in everything


def test_embeddings_norm_types_and_no_decay_types_are_exempt() -> None:
    class Scale2d(nn.Module):  # a 2-D parameter that is no weight matrix
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3, 3))

    class WideNorm(nn.LayerNorm):  # a norm type whose gain is 2-D: exempt by its type
        def __init__(self) -> None:
            super().__init__((2, 3))

    model = nn.ModuleDict(
        {"emb": nn.Embedding(5, 3), "lin": nn.Linear(3, 3), "scale": Scale2d(), "n": WideNorm()}
    )
    decay, other = weight_decay_groups(model, 0.1, decay_embeddings=False, no_decay=(Scale2d,))
    assert ids(decay) == [id(model["lin"].weight)]
    assert set(ids(other)) == {
        id(model["emb"].weight),
        id(model["lin"].bias),
        id(model["scale"].gain),
        id(model["n"].weight),
        id(model["n"].bias),
    }
    # A tied weight that is also an embedding's does not decay without embedding decay.
    gpt = TinyGPT()
    decay, other = weight_decay_groups(gpt, 0.1, decay_embeddings=False)
    assert id(gpt.lm_head.weight) in ids(other) and id(gpt.lm_head.weight) not in ids(decay)


def test_adamw_with_the_groups_trains_as_a_hand_built_adamw() -> None:
    def train(build_groups) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyGPT()
        optimizer = torch.optim.AdamW(build_groups(model), lr=1e-2, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            idx = torch.randint(0, 11, (2, 6), generator=gen)
            logits = model(idx[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 11), idx[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ours = train(lambda m: weight_decay_groups(m, 0.5))
    hand = train(lambda m: nanogpt_groups(m, 0.5))
    everything_decays = train(lambda m: [{"params": list(m.parameters()), "weight_decay": 0.5}])
    assert all(torch.equal(a, b) for a, b in zip(ours, hand, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ours, everything_decays, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"weight_decay": "0.1"}, "finite number >= 0"),
        ({"weight_decay": float("nan")}, "finite number >= 0"),
        ({"weight_decay": True}, "finite number >= 0"),
        ({"weight_decay": 0.1, "no_decay": nn.LayerNorm}, "no_decay=(MyNorm,)"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=r"weight_decay_groups") as err:
        weight_decay_groups(nn.Linear(2, 2), **kwargs)
    assert says in str(err.value)


def test_a_model_without_trainable_parameters_is_refused() -> None:
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"no parameter with requires_grad=True.*requires_grad_"):
        weight_decay_groups(model, 0.1)
    with pytest.raises(ConfigError, match=r"not an nn\.Module"):
        weight_decay_groups([nn.Parameter(torch.ones(2))], 0.1)  # type: ignore[arg-type]

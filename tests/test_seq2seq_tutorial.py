"""The PyTorch tutorial's seq2seq translation loop (intermediate_source/
seq2seq_translation_tutorial.py, its per-pair ``train``) written with steplib equals it bit
for bit.

The tutorial: an encoder and a decoder, each with its own optimizer, both zeroed and stepped
per pair; teacher forcing chosen with ``random.random() < teacher_forcing_ratio`` per pair;
the decoder run one time step at a time (without teacher forcing it feeds back its own
``topk(1)`` and stops at EOS); the losses of the time steps summed and back-propagated, and
that sum divided by the target length reported.

With steplib (docs/migration/README.md, "An encoder and a decoder with two optimizers"): one
``nn.ModuleDict`` model, one optimizer with a parameter group per network (the two
optimizers' updates, element for element), ``loss_fn`` returning the summed loss (a scalar,
so steplib back-propagates it as it is) and the divided one as aux.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from steplib import Events, TrainState, make_train_step, run
from steplib.events import Event
from tests.checkpoint_helpers import assert_same

SOS, EOS, VOCAB, HIDDEN, RATIO, PAIRS = 0, 1, 12, 16, 0.5, 24


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(VOCAB, HIDDEN), nn.GRU(HIDDEN, HIDDEN)

    def forward(self, token: torch.Tensor, hidden: torch.Tensor) -> Any:
        return self.gru(self.embedding(token).view(1, 1, -1), hidden)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(VOCAB, HIDDEN), nn.GRU(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, token: torch.Tensor, hidden: torch.Tensor) -> Any:
        output, hidden = self.gru(torch.relu(self.embedding(token).view(1, 1, -1)), hidden)
        return torch.log_softmax(self.out(output[0]), dim=1), hidden


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    made = []
    for _ in range(PAIRS):
        source = torch.randint(
            2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
        )
        made.append(
            (
                torch.cat([source, torch.tensor([EOS])]),
                torch.cat([source.flip(0), torch.tensor([EOS])]),
            )
        )
    return made


def translate(encoder: nn.Module, decoder: nn.Module, pair: Any) -> tuple[torch.Tensor, int]:
    """The tutorial's ``train`` body up to the backward: the summed loss, the target length."""
    source, target = pair
    hidden = torch.zeros(1, 1, HIDDEN)
    for token in source:
        _, hidden = encoder(token, hidden)
    criterion, loss, token_in = nn.NLLLoss(), torch.zeros(()), torch.tensor([[SOS]])
    if random.random() < RATIO:  # teacher forcing
        for want in target:
            output, hidden = decoder(token_in, hidden)
            loss = loss + criterion(output, want.view(1))
            token_in = want
    else:
        for want in target:
            output, hidden = decoder(token_in, hidden)
            token_in = output.topk(1)[1].squeeze().detach()
            loss = loss + criterion(output, want.view(1))
            if token_in.item() == EOS:
                break
    return loss, len(target)


def built(kind: str) -> tuple[Encoder, Decoder, Any]:
    torch.manual_seed(0)
    encoder, decoder = Encoder(), Decoder()
    opt = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
    return encoder, decoder, opt


def reference(kind: str) -> tuple[nn.Module, nn.Module, list[float]]:
    random.seed(0)
    encoder, decoder, opt = built(kind)
    encoder_optimizer, decoder_optimizer = (
        opt(encoder.parameters(), lr=0.01),
        opt(decoder.parameters(), lr=0.02),
    )
    reported = []
    for _ in range(2):
        for pair in pairs():
            encoder_optimizer.zero_grad()
            decoder_optimizer.zero_grad()
            loss, length = translate(encoder, decoder, pair)
            loss.backward()
            encoder_optimizer.step()
            decoder_optimizer.step()
            reported.append(loss.item() / length)
    return encoder, decoder, reported


class Reported:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_step_end(self, event: Event) -> None:
        self.seen.append(float(event.output.aux["avg"]))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_seq2seq_two_optimizers_with_steplib_equal_the_tutorial_loop(kind: str) -> None:
    encoder, decoder, reported = reference(kind)

    random.seed(0)
    our_encoder, our_decoder, opt = built(kind)
    model = nn.ModuleDict({"encoder": our_encoder, "decoder": our_decoder})
    optimizer = opt(
        [
            {"params": our_encoder.parameters(), "lr": 0.01},
            {"params": our_decoder.parameters(), "lr": 0.02},
        ]
    )

    def loss_fn(m: Any, pair: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, length = translate(m["encoder"], m["decoder"], pair)
        return loss, {"avg": loss.detach() / length}

    seen = Reported()
    state = TrainState.create(model=model, optimizer=optimizer)
    state = run(make_train_step(loss_fn), state, pairs(), events=Events(seen), max_epochs=2)
    assert state.step == len(reported) == 2 * PAIRS
    assert_same(our_encoder.state_dict(), encoder.state_dict())
    assert_same(our_decoder.state_dict(), decoder.state_dict())
    assert seen.seen == pytest.approx(reported, rel=1e-6)

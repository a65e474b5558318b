"""pytorch/examples' language_translation (a ``nn.Transformer`` over padded sentences, loss
``CrossEntropyLoss(ignore_index=PAD)``) written with steplib, against its plain loop.

* The example's loss, the mean over the batch's real target tokens, as ``loss_fn`` returns it:
  bit for bit, dropout on.
* The token-weighted loss (``token_cross_entropy``: the sum over real targets and their count)
  under ``accumulate(step, 2)`` equals one update on the concatenated batch (the two
  micro-batches padded to one length), micro-batches with unequal numbers of real tokens and a
  shorter last window included (law 2 on a real model).
* The example's per-batch mean under ``accumulate(step, 2)``: each micro-batch counts as one
  target (docs/concepts.md, ``loss_fn``), so the update is that of the mean of the two batch
  means, not of the concatenated batch: not the example's loss on the big batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from steplib import Events, TrainState, accumulate, make_train_step, run
from steplib.losses import token_cross_entropy
from tests.checkpoint_helpers import assert_same

PAD, BOS, EOS, VOCAB, EMBED = 1, 2, 3, 12, 8
# nn.Transformer's advice about the example's sequence-first layout (inference speed only).
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 32) -> None:
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.pos_embedding: torch.Tensor
        self.register_buffer("pos_embedding", pos_embedding.unsqueeze(-2))

    def forward(self, token_embedding: torch.Tensor) -> torch.Tensor:
        return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(0), :])


class Translator(nn.Module):
    """The example's model (src/model.py), small."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.src_embedding = nn.Embedding(VOCAB, EMBED)
        self.tgt_embedding = nn.Embedding(VOCAB, EMBED)
        self.pos_enc = PositionalEncoding(EMBED, dropout)
        self.transformer = nn.Transformer(d_model=EMBED, nhead=2, num_encoder_layers=1,
                                          num_decoder_layers=1, dim_feedforward=16,
                                          dropout=dropout)  # fmt: skip
        self.ff = nn.Linear(EMBED, VOCAB)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src: torch.Tensor, trg: torch.Tensor, *masks: torch.Tensor) -> torch.Tensor:
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = masks
        src_emb = self.pos_enc(self.src_embedding(src))
        tgt_emb = self.pos_enc(self.tgt_embedding(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask,
                                tgt_padding_mask, src_padding_mask)  # fmt: skip
        return self.ff(outs)


def create_mask(src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The example's src/data.py create_mask, with a boolean causal mask (True: not attended),
    as its float one of 0 and -inf means, without torch's warning about mixed mask types."""
    tgt_mask = torch.triu(torch.ones(tgt.shape[0], tgt.shape[0], dtype=torch.bool), diagonal=1)
    src_mask = torch.zeros((src.shape[0], src.shape[0])).type(torch.bool)
    return src_mask, tgt_mask, (src == PAD).transpose(0, 1), (tgt == PAD).transpose(0, 1)


def collate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's collate_fn: <bos> sentence <eos>, padded with <pad>, (length, batch)."""
    wrap = [
        (torch.cat([torch.tensor([BOS]), s, torch.tensor([EOS])]),
         torch.cat([torch.tensor([BOS]), t, torch.tensor([EOS])]))
        for s, t in pairs
    ]  # fmt: skip
    return (pad_sequence([s for s, _ in wrap], padding_value=PAD),
            pad_sequence([t for _, t in wrap], padding_value=PAD))  # fmt: skip


def sentence_pairs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)

    def sentence() -> torch.Tensor:
        length = int(torch.randint(1, 7, (), generator=gen))
        return torch.randint(4, VOCAB, (length,), generator=gen)

    return [(sentence(), sentence()) for _ in range(n)]


def logits_and_targets(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """train()'s forward: the logits of tgt[:-1] and the targets tgt[1:], flattened."""
    src, tgt = batch
    tgt_input = tgt[:-1, :]
    logits = model(src, tgt_input, *create_mask(src, tgt_input))
    return logits.reshape(-1, logits.shape[-1]), tgt[1:, :].reshape(-1)


criterion = nn.CrossEntropyLoss(ignore_index=PAD)


def example_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return criterion(*logits_and_targets(model, batch))


def token_weighted(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return token_cross_entropy(*logits_and_targets(model, batch), ignore_index=PAD)


def build(dropout: float, adam: bool = True) -> tuple[Translator, torch.optim.Optimizer]:
    """The example's Adam; or SGD, whose update shows the gradient as it is: Adam divides
    each gradient by its own running scale, so the float32 noise of a gradient that is 0 in
    exact arithmetic (the attention's key bias) would become an update of the learning rate."""
    torch.manual_seed(0)
    model = Translator(dropout)
    if not adam:
        return model, torch.optim.SGD(model.parameters(), lr=0.5)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9)


def micro_batches(sizes: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    pairs, out, at = sentence_pairs(sum(sizes)), [], 0
    for size in sizes:
        out.append(pairs[at : at + size])
        at += size
    return out


def test_the_examples_mean_loss_with_steplib_equals_its_train_loop_bit_for_bit() -> None:
    batches = [collate(group) for group in micro_batches([4, 3, 4, 2])]
    want, optim = build(dropout=0.1)
    want.train()
    losses = []
    for batch in batches:
        loss = example_loss(want, batch)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    got, optimizer = build(dropout=0.1)
    got_losses: list[float] = []
    events = Events().on("step_end", lambda e: got_losses.append(float(e.output.loss)))
    state = TrainState.create(model=got, optimizer=optimizer)
    run(make_train_step(example_loss), state, batches, events=events)
    assert got_losses == losses
    assert_same(got.state_dict(), want.state_dict())


def windows_of_two(groups: list[Any]) -> list[list[Any]]:
    return [groups[i : i + 2] for i in range(0, len(groups), 2)]


def reference(loss: str, groups: list[Any]) -> nn.Module:
    """One update per window of two micro-batches (the last may hold one), on the
    concatenated window (its sentences padded to one length), or on the mean of its batch
    means."""
    model, optim = build(dropout=0.0, adam=False)
    for window in windows_of_two(groups):
        optim.zero_grad()
        if loss == "concatenated":
            example_loss(model, collate([pair for group in window for pair in group])).backward()
        else:
            torch.stack([example_loss(model, collate(g)) for g in window]).mean().backward()
        optim.step()
    return model


# Micro-batches of 3 and 1 sentences (unequal real tokens, padded to other lengths), then a
# shorter last window of one.
SIZES = [3, 1, 2, 4, 3]


def test_token_weighted_accumulation_equals_the_concatenated_batch() -> None:
    groups = micro_batches(SIZES)
    counts = [int((collate(g)[1][1:] != PAD).sum()) for g in groups]
    assert len(set(counts)) == len(counts)  # unequal token counts in every window
    want = reference("concatenated", groups)
    got, optimizer = build(dropout=0.0, adam=False)
    state = TrainState.create(model=got, optimizer=optimizer)
    state = run(accumulate(make_train_step(token_weighted), 2), state, [collate(g) for g in groups])
    assert state.step == 3
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_the_examples_mean_loss_under_accumulate_weighs_each_micro_batch_alike() -> None:
    groups = micro_batches(SIZES)
    got, optimizer = build(dropout=0.0, adam=False)
    state = TrainState.create(model=got, optimizer=optimizer)
    run(accumulate(make_train_step(example_loss), 2), state, [collate(g) for g in groups])
    want = reference("mean of means", groups)
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # ... which is not the update on the concatenated batch (what the doc says).
    concatenated = reference("concatenated", groups)
    pairs = zip(got.state_dict().values(), concatenated.state_dict().values(), strict=True)
    apart = max(float((a - b).abs().max()) for a, b in pairs)
    assert apart > 1e-4


def test_a_token_weighted_windows_loss_is_the_examples_loss_on_the_concatenated_batch() -> None:
    groups = micro_batches(SIZES[:2])
    model, optimizer = build(dropout=0.0)
    with torch.no_grad():
        want = example_loss(model, collate([pair for g in groups for pair in g]))
    step = accumulate(make_train_step(token_weighted), 2)
    state, _ = step(TrainState.create(model=model, optimizer=optimizer), collate(groups[0]))
    state, out = step(state, collate(groups[1]))
    torch.testing.assert_close(out.loss, want, rtol=0, atol=1e-6)

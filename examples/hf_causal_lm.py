"""A Hugging Face causal LM (GPT-2, built from a config: nothing is downloaded) trained with
gradient accumulation over micro-batches of unequal padding.

A causal LM takes ``labels`` equal to ``input_ids`` and shifts them inside the model; its
``logits`` are not shifted. So the ``loss_fn`` shifts too (``causal_lm_loss``), and returns the
sum over the real next tokens and their count: every window is then the mean over all its
tokens, as one big batch is. Checked by tests/test_hf_causal_lm.py against the full-batch
gradient, the model's own ``.loss`` and the pitfalls.

    python examples/hf_causal_lm.py
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import steplib as sl
from steplib.losses import causal_lm_loss

VOCAB = 100
IGNORE = -100  # the label of padding, as DataCollatorForLanguageModeling writes it
Batch = dict[str, torch.Tensor]


def build_model(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 of width 32; no dropout, so that a batch split in pieces computes what
    the whole batch does."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    # transformers 5 derives the loss from the class name and misses GPT2LMHeadModel's (it
    # falls back to the same loss, with a warning): name it.
    model.loss_type = "ForCausalLM"
    return model


def pad(rows: list[torch.Tensor]) -> Batch:
    """Right-pad to the longest row: ids with 0, mask with 0, labels with -100."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def sequences(n: int, *, seed: int = 1) -> list[torch.Tensor]:
    """Rows of 3 to 24 tokens that follow ``next = (3 * token + 1) % VOCAB``: learnable."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        token, row = int(torch.randint(0, VOCAB, (), generator=gen)), []
        for _ in range(int(torch.randint(3, 25, (), generator=gen))):
            row.append(token)
            token = (3 * token + 1) % VOCAB
        rows.append(torch.tensor(row))
    return rows


def micro_batches(n: int, *, size: int = 4, seed: int = 1) -> list[Batch]:
    """``n`` micro-batches of ``size`` rows, each padded to its own longest row: they hold
    unequal numbers of real tokens."""
    rows = sequences(n * size, seed=seed)
    return [pad(rows[i : i + size]) for i in range(0, n * size, size)]


def loss_fn(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the real next tokens and their count (not ``model(..., labels=...).loss``,
    the micro-batch's mean: see the module's docstring)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], ignore_index=IGNORE)


def main(updates: int = 6, accumulation: int = 4) -> list[float]:
    """Train for ``updates`` updates of ``accumulation`` micro-batches; the window losses."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = sl.TrainState.create(model=model, optimizer=optimizer)
    step = sl.clip(sl.accumulate(sl.make_train_step(loss_fn), accumulation), max_norm=1.0)
    losses: list[torch.Tensor] = []
    events = sl.Events().on("step_end", lambda e: losses.append(e.output.loss))
    data = micro_batches(updates * accumulation)
    sl.run(step, state, data, events=events, max_steps=updates)
    return torch.stack(losses).tolist()  # one host read, after training


if __name__ == "__main__":
    print([round(loss, 3) for loss in main()])

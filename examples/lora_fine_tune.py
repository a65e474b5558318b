"""LoRA fine-tuning with Hugging Face PEFT: a frozen base, small adapters trained by steplib.

A tiny Llama built from a config stands in for a pretrained base (nothing is downloaded; a real
run loads it with ``AutoModelForCausalLM.from_pretrained``). ``peft.get_peft_model`` freezes the
base and adds rank-4 adapters to the attention's ``q_proj`` and ``v_proj``; the optimizer gets
only what is trainable, and the checkpoints hold only what is trained
(``trainable_only=True``): a billion-parameter base is not rewritten every few updates. The
step, the accumulation and the resume are steplib's usual ones: PEFT's model is an
``nn.Module`` like any other. Checked by tests/test_lora_example.py against a plain loop, for an
exact resume, and for a resume onto another base (refused).

    python examples/lora_fine_tune.py
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import steplib as sl
from steplib.losses import causal_lm_loss

VOCAB = 64
IGNORE = -100
Batch = dict[str, torch.Tensor]


def build_base(seed: int = 0) -> LlamaForCausalLM:
    """The "pretrained" base: a 2-layer Llama of width 32, the same for a given seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def with_adapters(base: nn.Module) -> nn.Module:
    """PEFT's LoRA on the attention projections; the base's parameters are frozen by it.

    ``lora_dropout`` draws from the global generator, as it does in a plain loop: steplib's
    step leaves that generator to the model.
    """
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, config)


def pad(rows: list[torch.Tensor]) -> Batch:
    """Right-pad to the longest row: ids with 0, mask with 0, labels with -100."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def sequences(n: int, *, seed: int = 1) -> list[torch.Tensor]:
    """Rows of 4 to 16 tokens following ``next = (5 * token + 3) % VOCAB``: a task to learn."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        token = int(torch.randint(0, VOCAB, (), generator=gen))
        row = []
        for _ in range(int(torch.randint(4, 17, (), generator=gen))):
            row.append(token)
            token = (5 * token + 3) % VOCAB
        rows.append(torch.tensor(row))
    return rows


def loss_fn(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over the real next tokens and their count (see ``causal_lm_loss``)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], ignore_index=IGNORE)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters: what the optimizer updates."""
    return [p for p in model.parameters() if p.requires_grad]


def main(root: str = "runs/lora", max_steps: int = 8, accumulation: int = 2) -> sl.TrainState:
    """Train the adapters for ``max_steps`` updates, saving every 2 and resuming from ``root``
    when a checkpoint is there."""
    sl.seed_everything(0)
    model = with_adapters(build_base())
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
    state = sl.TrainState.create(model=model, optimizer=optimizer)
    step = sl.accumulate(sl.make_train_step(loss_fn), accumulation)
    loader = sl.resumable_loader(sequences(64), batch_size=4, seed=0, collate_fn=pad)
    # The adapters, their optimizer state, the counters, RNG and data position: not the base,
    # which a resume takes from where it came from (and checks by its digest).
    ckpt = sl.checkpoint_every(root, every=2, keep_last=2, trainable_only=True)
    events: Any = sl.Events(sl.resume_from(ckpt), ckpt)
    return sl.run(step, state, loader, events=events, max_steps=max_steps)


if __name__ == "__main__":
    final = main()
    n_trained = sum(p.numel() for p in trainable(final.model))
    n_all = sum(p.numel() for p in final.model.parameters())
    print(f"{final.step} updates; {n_trained} of {n_all} parameters trained")

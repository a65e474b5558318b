"""A Hugging Face ``Trainer(args=TrainingArguments(...))`` run, rewritten with steplib.

The original (``transformers`` is not needed here) is described in
``docs/migration/hf_trainer.md``, side by side with this script. Each ``TrainingArguments``
field becomes one value below, under the same name: ``gradient_accumulation_steps`` ->
``accumulate``, ``max_grad_norm`` -> ``clip``, ``bf16`` -> ``amp_wrap``, ``warmup_steps`` +
``lr_scheduler_type="cosine"`` -> ``warmup_cosine``, ``eval_steps`` -> ``Evaluator``,
``save_steps`` / ``save_total_limit`` / ``load_best_model_at_end`` -> ``checkpoint_every`` +
``load``, ``logging_steps`` -> ``Log``, ``EarlyStoppingCallback`` -> ``EarlyStopping``.

The model is a causal LM as Hugging Face's are: ``labels`` are the ``input_ids`` and the model
shifts them inside (position t predicts token t + 1), so ``loss_fn`` shifts them too
(``causal_lm_loss``). The loss is token-weighted: the gradient of each update is divided by
the number of real (non-padding) next tokens in the whole accumulation window, which is what
the HF Trainer's ``num_items_in_batch`` fix of late 2024 does.

    python examples/migrate_from_hf_trainer.py --output-dir runs/migrate_from_hf_trainer
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

from steplib import (
    EarlyStopping,
    Evaluator,
    Events,
    JsonlLogger,
    TrainMetrics,
    TrainState,
    accumulate,
    amp_wrap,
    checkpoint_every,
    clip,
    make_eval_step,
    make_train_step,
    resume_from,
    run,
    warmup_cosine,
)
from steplib.checkpoint import list_checkpoints, load
from steplib.data import resumable_loader
from steplib.handlers import Log, LRMonitor
from steplib.losses import causal_lm_loss

VOCAB = 32
IGNORE = -100  # the label HF models and collators use for padding
Example = dict[str, torch.Tensor]


class TinyLM(nn.Module):
    """A Hugging Face style causal LM: ``forward(input_ids, labels=None)`` returns a dict with
    ``logits`` and, when labels are given, the mean ``loss`` of the logits at t against the
    label at t + 1 (the model shifts the labels, as ``AutoModelForCausalLM`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Example:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out


class Examples(Dataset[Example]):
    """A list of examples as a map-style dataset (the role of a ``datasets.Dataset``)."""

    def __init__(self, items: list[Example]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Example:
        return self.items[index]


def make_dataset(n: int, *, seed: int) -> Examples:
    """Sequences of 4 to 16 tokens, each token followed by ``(3 * token + 1) % VOCAB``; the
    labels are the ids (``DataCollatorForLanguageModeling(mlm=False)``)."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(4, 17, (), generator=gen))
        ids = [int(torch.randint(0, VOCAB, (), generator=gen))]
        while len(ids) < length:
            ids.append((3 * ids[-1] + 1) % VOCAB)
        examples.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)})
    return Examples(examples)


def collate(examples: list[Example]) -> Example:
    """Pad to the longest sequence (``DataCollatorForSeq2Seq``): ids with 0, labels with -100."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = example["input_ids"]
        labels[row, : len(example["labels"])] = example["labels"]
    return {"input_ids": ids, "labels": labels}


# Trainer.compute_loss: the sum over the real next tokens and their count, not the micro-batch
# mean, so that micro-batches with more real tokens weigh more (as in one big batch). The
# labels are shifted as the model shifts them: logits at t against the label at t + 1.
def loss_fn(model: nn.Module, batch: Example) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"])["logits"]
    return causal_lm_loss(logits, batch["labels"], ignore_index=IGNORE)


# Trainer.evaluate + compute_metrics: per-token loss and accuracy over the real next tokens.
def eval_fn(model: nn.Module, batch: Example) -> dict[str, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"])["logits"][:, :-1]
    labels = batch["labels"][:, 1:]
    real = labels != IGNORE
    loss = F.cross_entropy(logits[real], labels[real], reduction="none")
    return {"value": loss, "preds": logits[real], "target": labels[real]}


def training_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The ``TrainingArguments`` fields this run uses, under their HF names."""
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--output-dir", default="runs/migrate_from_hf_trainer")
    add("--per-device-train-batch-size", type=int, default=8)
    add("--per-device-eval-batch-size", type=int, default=64)
    add("--gradient-accumulation-steps", type=int, default=4)
    add("--learning-rate", type=float, default=1e-2)
    add("--weight-decay", type=float, default=0.01)
    add("--warmup-steps", type=int, default=5)
    add("--max-steps", type=int, default=60)
    add("--max-grad-norm", type=float, default=1.0)
    add("--bf16", action=argparse.BooleanOptionalAction, default=True)
    add("--logging-steps", type=int, default=10)
    add("--eval-steps", type=int, default=20)
    add("--save-steps", type=int, default=20)
    add("--save-total-limit", type=int, default=2)
    add("--early-stopping-patience", type=int, default=3)
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = training_arguments(argv)
    torch.manual_seed(args.seed)  # TrainingArguments(seed=...)
    train_loader = resumable_loader(
        make_dataset(512, seed=1),
        batch_size=args.per_device_train_batch_size,
        collate_fn=collate,
        seed=args.seed,
    )
    eval_loader = DataLoader(
        make_dataset(128, seed=2), batch_size=args.per_device_eval_batch_size, collate_fn=collate
    )

    model = TinyLM()
    # The Trainer's default optimizer: AdamW with weight decay; lr_scheduler_type="cosine".
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay
    )
    schedule = warmup_cosine(warmup=args.warmup_steps, total=args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)

    step = make_train_step(loss_fn)
    step = accumulate(step, args.gradient_accumulation_steps)
    step = clip(step, max_norm=args.max_grad_norm)
    if args.bf16:
        step = amp_wrap(step, dtype=torch.bfloat16)

    checkpoints = f"{args.output_dir}/checkpoints"
    events = Events()
    # trainer.train(resume_from_checkpoint=True)
    events.on("fit_start", resume_from(checkpoints, data=train_loader))
    train_metrics = TrainMetrics()
    train_metrics.attach(events)
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda e: losses.append(e.output.loss))
    # report_to="tensorboard" would be TensorBoardLogger(f"{args.output_dir}/runs")
    with JsonlLogger(f"{args.output_dir}/trainer_state.jsonl") as log:
        # eval_strategy="steps", eval_steps=...; names get HF's "eval_" prefix
        evaluator = Evaluator(
            make_eval_step(eval_fn, autocast_dtype=torch.bfloat16 if args.bf16 else None),
            eval_loader,
            metrics={
                "loss": torchmetrics.MeanMetric(),
                "accuracy": torchmetrics.classification.MulticlassAccuracy(
                    num_classes=VOCAB, average="micro"
                ),
            },
            every=args.eval_steps,
            prefix="eval_",
            monitor="eval_loss",
            sinks=[log],
        )
        evaluator.attach(events)
        # callbacks=[EarlyStoppingCallback(early_stopping_patience=3)]
        stopper = EarlyStopping("eval_loss", patience=args.early_stopping_patience)
        events.on("step_end", stopper, every=args.eval_steps)
        # save_steps, save_total_limit; the best is kept too (load_best_model_at_end=True,
        # metric_for_best_model="eval_loss", greater_is_better=False)
        checkpoint_every(
            checkpoints,
            every=args.save_steps,
            keep_last=args.save_total_limit,
            keep_best=1,
            metric="eval_loss",
            data=train_loader,
        ).attach(events)
        # logging_steps; HF's learning_rate is read after the scheduler's step (the next
        # update's rate), where TrainMetrics' lr is the rate its updates used
        next_lr = LRMonitor()
        sources = [train_metrics.read, lambda e: {"learning_rate": next_lr.read(e)["next_lr"]}]
        events.on("step_end", Log(log, sources=sources), every=args.logging_steps)
        state = run(step, state, train_loader, events=events, max_steps=args.max_steps)
    trained = state.step  # TrainOutput.global_step: loading the best rewinds the counters

    # load_best_model_at_end=True
    saved = [c for c in list_checkpoints(checkpoints) if "eval_loss" in c.metrics]
    best = min(saved, key=lambda c: c.metrics["eval_loss"]) if saved else None
    if best is not None:
        state = load(best.url, state, step=step)
    return {
        "steps": trained,
        **first_and_last(losses),
        "best_eval_loss": best.metrics["eval_loss"] if best is not None else math.nan,
        "best_step": best.step if best is not None else None,
    }


def first_and_last(losses: list[torch.Tensor], n: int = 5) -> dict[str, float | None]:
    """Mean training loss of the first and the last ``n`` updates of this run (one host read;
    ``None`` when a resumed run had nothing left to do)."""
    if not losses:
        return {"first_loss": None, "last_loss": None}
    values = torch.stack(losses).tolist()
    head, tail = values[:n], values[-n:]
    return {"first_loss": sum(head) / len(head), "last_loss": sum(tail) / len(tail)}


if __name__ == "__main__":
    print(main())

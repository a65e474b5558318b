"""Train a tiny character-level transformer on the Python standard library's own docstrings.

Everything it needs ships with Python and steplib: no download, CPU only, about two minutes on
two cores with the defaults::

    python examples/demo.py                       # the defaults
    python examples/demo.py --steps 2000 --d-model 256 --layers 4 --threads 8   # a longer run

It builds the step from steplib's pieces (``make_train_step`` -> ``clip`` -> ``accumulate``),
drives it with ``steplib.run``, shows a progress bar, prints a line every ``--log-every``
updates, writes the metrics as JSON lines (``runs/demo/metrics.jsonl``), reports the held-out
loss before and after, and ends with a sample of generated text.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

# Read by OpenMP when torch loads. Waiting threads then sleep instead of spinning: on a machine
# whose cores are shared with other processes, spinning threads made each step ~10x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import steplib
from steplib import Events, TrainState, accumulate, clip, make_train_step, run, warmup_cosine
from steplib.logging import JsonlLogger
from steplib.progress import ProgressBar

# ---------------------------------------------------------------------------------------------
# Data: the docstrings of the standard library, read from its .py sources with `ast`.
# Parsing instead of importing: importing every module would run code (`antigravity` opens a
# browser, `this` prints) and depend on optional C extensions. Sorted paths keep it
# deterministic for a given Python install.
# ---------------------------------------------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings(max_chars: int) -> str:
    """Docstrings of the standard library's modules, classes and functions, in path order,
    until ``max_chars`` characters, kept to printable ASCII and newlines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    keep = set(range(32, 127)) | {ord("\n")}
    parts: list[str] = []
    size = 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            # A newer Python may warn about old escape sequences in old files; not our concern.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
            if not doc:
                continue
            doc = "".join(c for c in doc.replace("\t", "    ") if ord(c) in keep)
            parts.append(doc)
            size += len(doc) + 2
            if size >= max_chars:
                return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)


class CharTokenizer:
    """One id per distinct character of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        # Characters never seen in training (none, for a prompt taken from the corpus) are dropped.
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def chunks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping rows of ``seq_len + 1`` ids: inputs are ``row[:-1]``, targets ``row[1:]``."""
    rows = len(ids) // (seq_len + 1)
    return ids[: rows * (seq_len + 1)].view(rows, seq_len + 1)


# ---------------------------------------------------------------------------------------------
# Model: a small decoder-only transformer (pre-norm blocks, causal attention, tied embeddings).
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, *, d_model: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        if d_model % heads:
            raise SystemExit(f"--d-model {d_model} must be a multiple of the {heads} heads.")
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: fewer parameters, faster start
        self.apply(_init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def _init(module: nn.Module) -> None:
    # GPT-2's small-normal initialisation: the default uniform init of nn.Linear starts slower.
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def loss_fn(
    model: nn.Module, batch: list[torch.Tensor]
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """Token-weighted: the summed cross-entropy and how many targets it covers, so that
    ``accumulate`` divides once by the window's total (steplib's contract for loss functions).
    The accuracy rides along as an aux value and shows up in the JSONL log."""
    (rows,) = batch
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss_sum, targets.numel(), {"accuracy": accuracy}


@torch.no_grad()
def evaluate(model: nn.Module, rows: torch.Tensor, *, batch_size: int) -> float:
    """Mean per-character cross-entropy over ``rows`` (held-out text)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        loss_sum, targets, _ = loss_fn(model, [rows[start : start + batch_size]])
        total += loss_sum.item()
        count += targets
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def generate(
    model: TinyGPT, tokenizer: CharTokenizer, prompt: str, *, length: int, seed: int
) -> str:
    """Sample ``length`` characters after ``prompt`` (temperature 0.8: greedy decoding of a
    small character model tends to repeat one phrase forever)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt).tolist()
    for _ in range(length):
        context = torch.tensor([ids[-model.seq_len :]])
        probs = torch.softmax(model(context)[0, -1] / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train()
    return tokenizer.decode(ids)


# ---------------------------------------------------------------------------------------------
# Training: everything above is plain PyTorch; steplib starts here.
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add = parser.add_argument
    add("--steps", type=int, default=700, help="optimizer updates")
    add("--batch-size", type=int, default=16, help="sequences per micro-batch")
    add("--seq-len", type=int, default=128, help="characters of context")
    add("--accumulate", type=int, default=2, help="micro-batches per update")
    add("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    add("--d-model", type=int, default=128, help="transformer width")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--heads", type=int, default=4, help="attention heads")
    add("--corpus-chars", type=int, default=1_000_000, help="characters of docstrings to use")
    add("--log-every", type=int, default=50, help="print a line every this many updates")
    add("--out", default="runs/demo", help="directory (or fsspec URL) for metrics.jsonl")
    add("--seed", type=int, default=0, help="seed for the model, data order and sampling")
    add("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "accumulate", "log_every", "corpus_chars"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> TrainState:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    text = stdlib_docstrings(args.corpus_chars)
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    # The last tenth is held out: other modules' docstrings, so the eval measures generalisation.
    split = int(len(ids) * 0.9)
    train_rows, val_rows = chunks(ids[:split], args.seq_len), chunks(ids[split:], args.seq_len)
    val_rows = val_rows[:256]  # enough for a stable estimate, cheap enough to run twice
    print(
        f"corpus: {len(text):,} characters of stdlib docstrings, {len(tokenizer.chars)} distinct; "
        f"{len(train_rows):,} training rows of {args.seq_len}"
    )
    loader = DataLoader(
        TensorDataset(train_rows),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),  # the data order is seeded too
    )

    model = TinyGPT(
        len(tokenizer.chars),
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    schedule = warmup_cosine(warmup=args.steps // 10, total=args.steps, min_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)

    # The step is a value built from pieces: the loss, then clipping, then accumulation.
    step = accumulate(clip(make_train_step(loss_fn), max_norm=1.0), args.accumulate)

    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters; step: {step.describe()}")
    initial = evaluate(model, val_rows, batch_size=64)
    print(
        f"held-out loss before training: {initial:.3f} (uniform guess: "
        f"{math.log(len(tokenizer.chars)):.3f})"
    )

    # The bar reads tensors only every `every` updates (a host sync on a GPU); the printed line
    # reuses the bar's numbers and the JSON log reads on the same updates, so in between the
    # loop never waits on the device.
    bar = ProgressBar(total=args.steps, every=math.gcd(args.log_every, 10), desc="train")
    events = bar.attach(Events())

    def print_line(event: steplib.Event) -> None:
        stats = bar.stats
        bar.write(
            f"step {event.step:5d}  loss {stats['loss']:.3f}  lr {stats['lr']:.2e}  "
            f"{stats['tokens_per_s']:,.0f} tokens/s"
        )

    events.on("step_end", print_line, every=args.log_every)

    with JsonlLogger(f"{args.out.rstrip('/')}/metrics.jsonl", append=False) as log:
        events.on("step_end", log, every=bar.every)
        state = run(step, state, loader, events=events, max_steps=args.steps)
        final = evaluate(model, val_rows, batch_size=64)
        log.write({"step": state.step, "epoch": state.epoch, "val_loss": final})

    print(f"held-out loss after {state.step} updates: {final:.3f} (before: {initial:.3f})")
    print(f"metrics: {log.url}")
    sample = generate(model, tokenizer, "Return the ", length=300, seed=args.seed)
    print("sample:\n" + sample)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return state


if __name__ == "__main__":
    main(sys.argv[1:])

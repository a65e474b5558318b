"""Train a tiny character-level transformer on the Python standard library's own docstrings.

Everything it needs ships with Python and steplib: no download, CPU only, about two minutes on
two cores with the defaults::

    python examples/demo.py                       # the defaults
    python examples/demo.py --resume              # continue from the newest checkpoint
    python examples/demo.py --steps 2000 --d-model 256 --layers 4 --threads 8   # a longer run

It builds the step from steplib's pieces (``make_train_step`` -> ``clip`` -> ``accumulate``),
drives it with ``steplib.run``, and adds the standard handlers: a progress bar, running means of
the training loss kept on the device, throughput (tokens/s and model FLOPs per update, counted
once on the meta device), an evaluation on a held-out split every ``--eval-every`` updates, and
a JSON-lines log (``runs/demo/metrics.jsonl``). It checkpoints every ``--checkpoint-every``
updates in the background (``runs/demo/checkpoints``, keeping the last two and the best by the
held-out loss); SIGTERM or SIGUSR1 saves at the next update and stops, and ``--resume``
continues exactly where the last run stopped (weights, optimizer, schedule, data order, random
state). At the end it saves a plot of the training and held-out loss (``runs/demo/loss.png``;
needs matplotlib, the ``plot`` extra) and prints a sample of generated text.
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

import fsspec
import orjson
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import steplib
from steplib import (
    Events,
    TrainState,
    accumulate,
    clip,
    make_train_step,
    run,
    skip_nonfinite,
    warmup_cosine,
)
from steplib.checkpoint import checkpoint_every, list_checkpoints, preemption, resume_from
from steplib.data import resumable_loader
from steplib.handlers import (
    ConsoleLogger,
    Evaluator,
    JsonlLogger,
    Log,
    ProgressBar,
    Throughput,
    TrainMetrics,
    flops_per_batch,
    make_eval_step,
)
from steplib.losses import token_cross_entropy

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
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token-weighted: the summed cross-entropy and how many targets it covers, so that
    ``accumulate`` divides once by the window's total (steplib's contract for loss functions).
    The accuracy rides along as an aux value and shows up in the JSONL log."""
    (rows,) = batch
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits = model(inputs)
    loss_sum, count = token_cross_entropy(logits, targets)
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss_sum, count, {"accuracy": accuracy}


def eval_fn(model: nn.Module, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the held-out metrics take: per-character losses for a ``MeanMetric`` (``value``) and
    the predictions for an accuracy (``preds``, ``target``); a ``MetricCollection`` hands each
    metric the names its ``update`` accepts. steplib's eval step runs it without gradients, in
    eval mode."""
    (rows,) = batch
    inputs, targets = rows[:, :-1], rows[:, 1:]
    logits = model(inputs).flatten(0, 1)
    losses = F.cross_entropy(logits, targets.flatten(), reduction="none")
    return {"value": losses, "preds": logits.argmax(-1), "target": targets.flatten()}


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


def plot_losses(log_url: str, png_url: str) -> bool:
    """Plot the training loss (running means) and the held-out loss from the JSON-lines log.

    matplotlib is optional (the ``plot`` extra): without it, print a note and return False.
    The figure is drawn with matplotlib's object API, which touches no global backend, so
    calling this from a notebook leaves its plotting set-up alone.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed (pip install 'steplib[plot]'): no loss plot.")
        return False
    with fsspec.open(log_url, "rb") as file:
        lines = [orjson.loads(line) for line in file.read().splitlines()]
    train = [(line["step"], line["loss"]) for line in lines if line.get("loss") is not None]
    held_out = [(line["step"], line["val_loss"]) for line in lines if "val_loss" in line]
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    for points, label, style in ((train, "train", "-"), (held_out, "held-out", "o-")):
        if points:
            axes.plot(*zip(*points, strict=True), style, label=label)
    axes.set_xlabel("optimizer update")
    axes.set_ylabel("cross-entropy per character")
    axes.legend()
    axes.grid(alpha=0.3)
    with fsspec.open(png_url, "wb") as file:
        figure.savefig(file, format="png", dpi=120)
    return True


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
    add("--eval-every", type=int, default=100, help="evaluate on the held-out rows this often")
    add("--eval-rows", type=int, default=256, help="held-out rows per evaluation")
    add("--peak-flops", type=float, default=None, help="your device's peak FLOP/s, for MFU")
    add("--out", default="runs/demo", help="directory (or fsspec URL) for metrics.jsonl")
    add("--seed", type=int, default=0, help="seed for the model, data order and sampling")
    add("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    add("--checkpoint-every", type=int, default=100, help="updates between checkpoints")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = parser.parse_args(argv)
    names = ("steps", "batch_size", "seq_len", "accumulate", "log_every", "corpus_chars")
    for name in (*names, "eval_every", "eval_rows", "checkpoint_every"):
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
    val_rows = val_rows[: args.eval_rows]  # enough for a stable estimate, cheap to repeat
    print(
        f"corpus: {len(text):,} characters of stdlib docstrings, {len(tokenizer.chars)} distinct; "
        f"{len(train_rows):,} training rows of {args.seq_len}"
    )
    # A loader whose position and shuffle order go into the checkpoints (its own seeded
    # generator: the data order never depends on the global one).
    loader = resumable_loader(
        TensorDataset(train_rows),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        seed=args.seed,
    )

    model = TinyGPT(
        len(tokenizer.chars),
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        seq_len=args.seq_len,
    )
    # fused=True: one kernel per update, and it can skip a non-finite update inside the kernel,
    # so skip_nonfinite below decides without a host sync (steplib.step.device_skips).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), fused=True)
    schedule = warmup_cosine(warmup=args.steps // 10, total=args.steps, min_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    state = TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)

    # The step is a value built from pieces: the loss, then clipping, then accumulation, then
    # skipping an update whose loss or gradients are not finite.
    step = accumulate(clip(make_train_step(loss_fn), max_norm=1.0), args.accumulate)
    step = skip_nonfinite(step, max_consecutive=5)

    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters; step: {step.describe()}")
    # FLOPs of one update, counted once on the meta device (nothing runs, nothing changes).
    # A batch of the loader's shape, taken directly: iterating the loader would draw from its
    # generator and change the data order.
    example = [train_rows[: args.batch_size]]
    flops = flops_per_batch(model, example, loss_fn=loss_fn) * args.accumulate
    print(f"model FLOPs per update: {flops / 1e9:.2f} G")

    # Every handler below reads the device only on its own interval (a host sync on a GPU):
    # the bar and the JSON log every `every` updates, the evaluation every --eval-every.
    out = args.out.rstrip("/")
    checkpoints = f"{out}/checkpoints"
    events = Events()
    if args.resume:
        # First on fit_start, so that every handler after it sees the resumed state.
        events.on("fit_start", resume_from(checkpoints, data=loader))
    elif old := list_checkpoints(checkpoints):
        # A fresh run replaces the last run's checkpoints, as it replaces its metrics.
        print(f"fresh run: removing {len(old)} checkpoint(s) of the last run in {checkpoints}")
        fs, path = fsspec.core.url_to_fs(checkpoints)
        fs.rm(path, recursive=True)
    bar = ProgressBar(total=args.steps, every=math.gcd(args.log_every, 10), desc="train")
    bar.attach(events)
    train = TrainMetrics()  # running means of the loss and the accuracy, on the device
    train.attach(events)
    speed = Throughput(
        samples_per_step=args.batch_size * args.accumulate,
        flops_per_step=flops,
        peak_flops=args.peak_flops,  # None: no MFU; steplib never guesses a hardware peak
    )
    speed.attach(events)

    def print_line(event: steplib.Event) -> None:
        stats = bar.stats
        bar.write(
            f"step {event.step:5d}  loss {stats['loss']:.3f}  lr {stats['lr']:.2e}  "
            f"{stats['tokens_per_s']:,.0f} tokens/s"
        )

    events.on("step_end", print_line, every=args.log_every)

    with JsonlLogger(f"{out}/metrics.jsonl", append=args.resume) as log:
        evaluator = Evaluator(
            make_eval_step(eval_fn),
            [[rows] for rows in val_rows.split(64)],
            metrics={
                "loss": torchmetrics.MeanMetric(),
                "accuracy": MulticlassAccuracy(len(tokenizer.chars), average="micro"),
            },
            every=args.eval_every,
            at_fit_end=True,  # the final weights get a value too
            sanity_batches=0,  # the evaluation at fit_start below checks the eval step
            monitor="val_loss",
            sinks=[log, ConsoleLogger(file=sys.stdout)],
        )
        events.on("fit_start", evaluator)  # the held-out loss before training, at step 0
        evaluator.attach(events)
        events.on("step_end", Log(log, sources=[train.read, speed.read]), every=bar.every)
        # After the evaluator, so a checkpoint records the val_loss it put in state.extras.
        # Written in the background: the parameters are copied while the next forward and
        # backward run; training waits only for the copy of the buffers and RNG states.
        saver = checkpoint_every(
            checkpoints,
            every=args.checkpoint_every,
            keep_last=2,
            keep_best=1,
            metric="val_loss",
            data=loader,
            background=True,
        )
        preempted = preemption(saver)  # SIGTERM / SIGUSR1: save at the next update, then stop
        preempted.attach(saver.attach(events))
        state = run(step, state, loader, events=events, max_steps=args.steps)
        if preempted.received is not None:
            print(f"preempted: saved {preempted.saved}; continue with --resume")
            raise SystemExit(preempted.exit_code)

    initial, final = evaluator.history[0][1]["val_loss"], state.extras["val_loss"]
    print(
        f"held-out loss after {state.step} updates: {final:.3f} (before: {initial:.3f}; "
        f"uniform guess: {math.log(len(tokenizer.chars)):.3f}; best {evaluator.best.value:.3f} "
        f"at step {evaluator.best.step})"
    )
    print(f"metrics: {log.url}")
    if plot_losses(log.url, f"{out}/loss.png"):
        print(f"plot: {out}/loss.png")
    sample = generate(model, tokenizer, "Return the ", length=300, seed=args.seed)
    print("sample:\n" + sample)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return state


if __name__ == "__main__":
    main(sys.argv[1:])

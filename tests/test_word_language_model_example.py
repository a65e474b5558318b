"""pytorch/examples' word_language_model (an LSTM language model trained with truncated
back-propagation through time) written with steplib equals the original loop bit for bit.

The original carries the LSTM's hidden state from batch to batch within an epoch, detached
(``repackage_hidden``: gradients stop at the batch boundary), starts each epoch and each
evaluation from zeros, clips the gradient norm to 0.25, updates by hand (``p.data.add_(p.grad,
alpha=-lr)``: plain SGD) and divides the learning rate by 4 after an epoch whose validation
loss did not improve. Its evaluation carries a hidden state of its own across the validation
set, so it never disturbs training's.

With steplib (docs/migration/README.md, "A state carried from batch to batch"): the hidden
state lives in buffers of a small module around the model, so a checkpoint holds it with the
weights and a resume mid-epoch continues it; an ``epoch_start`` handler sets it to zeros (a
resumed epoch has no second ``epoch_start``, which set it to zeros in the middle of the epoch
until session 21); the evaluation is one batch holding the whole validation set, whose
function carries a hidden state of its own; ``ReduceLROnPlateau(factor=0.25, patience=0,
threshold=0)`` is ``lr /= 4``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from steplib import Evaluator, Events, TrainState, clip, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.events import Stop
from steplib.handlers import Scheduler

NTOKENS, BSZ, EVAL_BSZ, BPTT, EPOCHS, LR, CLIP = 13, 4, 3, 5, 4, 8.0, 0.25


class RNNModel(nn.Module):
    """word_language_model/model.py's RNNModel, LSTM only."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        shape = (self.nlayers, bsz, self.nhid)
        return weight.new_zeros(shape), weight.new_zeros(shape)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def _setup() -> tuple[torch.Tensor, torch.Tensor, RNNModel]:
    torch.manual_seed(1111)
    gen = torch.Generator().manual_seed(0)
    # 23 rows: chunks of 5, 5, 5, 5 and 2 tokens (the last one shorter, as in the original).
    train = batchify(torch.randint(NTOKENS, (23 * BSZ + 1,), generator=gen), BSZ)
    val = batchify(torch.randint(NTOKENS, (12 * EVAL_BSZ,), generator=gen), EVAL_BSZ)
    return train, val, RNNModel(NTOKENS, 6, 5, 2, dropout=0.2)


def repackage_hidden(h: Any) -> Any:
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def _evaluate(model: RNNModel, data_source: torch.Tensor) -> float:
    """The original's evaluate(), with its own hidden state."""
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(EVAL_BSZ)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, BPTT):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * F.nll_loss(output, targets).item()
    return total_loss / (len(data_source) - 1)


def _original() -> tuple[list[float], list[float], nn.Module]:
    """main.py's train() and its epoch loop, reduced to what changes the numbers."""
    train_data, val_data, model = _setup()
    lr, best_val_loss, losses, lrs = LR, None, [], []
    for _ in range(EPOCHS):
        model.train()
        hidden = model.init_hidden(BSZ)
        for i in range(0, train_data.size(0) - 1, BPTT):
            data, targets = get_batch(train_data, i)
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = F.nll_loss(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for p in model.parameters():
                assert p.grad is not None
                p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())
        val_loss = _evaluate(model, val_data)
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            lr /= 4.0
        lrs.append(lr)
    return losses, lrs, model


class Carried(nn.Module):
    """The model with the hidden state it carries from batch to batch, in buffers: a
    checkpoint saves them with the weights, and a resume continues from them."""

    h: torch.Tensor
    c: torch.Tensor

    def __init__(self, model: RNNModel, bsz: int) -> None:
        super().__init__()
        self.model = model
        h, c = model.init_hidden(bsz)
        self.register_buffer("h", h)
        self.register_buffer("c", c)

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        output, (h, c) = self.model(data, (self.h, self.c))
        # Truncated BPTT: the next batch starts from these values, without their graph.
        self.h, self.c = h.detach(), c.detach()
        return output

    def reset(self) -> None:
        self.h, self.c = torch.zeros_like(self.h), torch.zeros_like(self.c)


def loss_fn(model: Carried, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    data, targets = batch
    return F.nll_loss(model(data), targets)


def eval_fn(model: Any, val_data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole validation set is one batch: its chunks share a hidden state of their own
    (the training one, in the buffers, is not touched)."""
    rnn, hidden, losses, lengths = model.model, model.model.init_hidden(EVAL_BSZ), [], []
    for i in range(0, val_data.size(0) - 1, BPTT):
        data, targets = get_batch(val_data, i)
        output, hidden = rnn(data, hidden)
        losses.append(F.nll_loss(output, targets))
        lengths.append(len(data))
    return {"value": torch.stack(losses), "weight": torch.tensor(lengths, dtype=torch.float32)}


def _steplib(
    url: str | None = None, stop_at: int | None = None
) -> tuple[list[float], list[float], nn.Module]:
    train_data, val_data, rnn = _setup()
    model = Carried(rnn, BSZ)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    state = TrainState.create(model=model, optimizer=optimizer)
    step = clip(make_train_step(loss_fn), max_norm=CLIP)
    chunks = [get_batch(train_data, i) for i in range(0, train_data.size(0) - 1, BPTT)]
    data = resumable_loader(chunks, batch_size=None, shuffle=False)
    evaluator = Evaluator(
        make_eval_step(eval_fn),
        [val_data],
        # float64: the original sums Python floats
        metrics={"loss": MeanMetric().set_dtype(torch.float64)},
        at_epoch_end=True,
        monitor="val_loss",
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, factor=0.25, patience=0, threshold=0
    )
    losses: list[float] = []
    lrs: list[float] = []
    events = Events(evaluator, Scheduler(plateau, metric=evaluator))
    events.on("step_end", lambda e: losses.append(float(e.output.loss)))
    events.on("epoch_start", lambda e: model.reset())  # as train() starts from init_hidden
    events.on("epoch_end", lambda e: lrs.append(optimizer.param_groups[0]["lr"]))
    if url is not None:
        ckpt = checkpoint_every(url, every=1, data=data)
        events.add(resume_from(ckpt)).add(ckpt)
    if stop_at is not None:
        events.on("step_end", lambda e: Stop("preempted") if e.step == stop_at else None)
    run(step, state, data, events=events, max_epochs=EPOCHS)
    return losses, lrs, rnn


def test_word_language_model_as_written_with_steplib_equals_the_original_loop() -> None:
    want_losses, want_lrs, want_model = _original()
    got_losses, got_lrs, got_model = _steplib()
    assert got_losses == want_losses
    assert got_lrs == want_lrs
    assert LR / 4 in want_lrs  # the plateau rule acted
    assert all(math.isfinite(x) for x in want_losses)
    for a, b in zip(got_model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stop_at", [7, 10])  # mid-epoch; an epoch's last update
def test_word_language_model_resumed_mid_epoch_keeps_its_hidden_state(
    tmp_path: Any, stop_at: int
) -> None:
    want_losses, want_lrs, want_model = _original()
    url = str(tmp_path / "ckpt")
    first, _, _ = _steplib(url, stop_at=stop_at)
    rest, got_lrs, got_model = _steplib(url)
    assert first + rest == want_losses
    assert got_lrs[-1] == want_lrs[-1]
    for a, b in zip(got_model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(a, b)

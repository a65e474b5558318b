"""pytorch/examples' GAT (gat/main.py) with early stopping on the validation loss, written with
steplib, equals its plain loop bit for bit: the epoch it stops at, the best value and its
epoch, the best model kept and the last one.

The example trains full-batch: one batch is the whole graph, the training and validation
nodes are masks of that batch, and each epoch is one update followed by an evaluation. Its
loop has no early stopping; here it gets the one of the GAT paper's code (pyGAT): stop after
``PATIENCE`` epochs in a row without a lower validation loss, keep the best model's weights.

With steplib the data is a list of one batch (``[graph]``), evaluated by an ``Evaluator`` on
the same batch at each epoch's end, with ``EarlyStopping(evaluator)`` and
``checkpoint_every(..., keep_best=1, metric=evaluator)``; the best model comes back with
``load_weights(model, best_checkpoint(dir, evaluator))``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from steplib import (
    EarlyStopping,
    Evaluator,
    Events,
    TrainState,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import (
    best_checkpoint,
    checkpoint_every,
    list_checkpoints,
    load_weights,
    resume_from,
)
from steplib.events import Stop
from tests.checkpoint_helpers import assert_same

NODES, FEATURES, CLASSES, EPOCHS, PATIENCE = 40, 12, 3, 60, 4


class GraphAttentionLayer(nn.Module):
    """The example's layer (averaged heads), unchanged."""

    def __init__(self, in_features: int, out_features: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.n_hidden, self.dropout = n_heads, out_features, dropout
        self.W = nn.Parameter(torch.empty(size=(in_features, self.n_hidden * n_heads)))
        self.a = nn.Parameter(torch.empty(size=(n_heads, 2 * self.n_hidden, 1)))
        self.leakyrelu = nn.LeakyReLU(0.2)
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)

    def forward(self, h: torch.Tensor, adj_mat: torch.Tensor) -> torch.Tensor:
        n_nodes = h.shape[0]
        h_transformed = F.dropout(torch.mm(h, self.W), self.dropout, training=self.training)
        h_transformed = h_transformed.view(n_nodes, self.n_heads, self.n_hidden).permute(1, 0, 2)
        source_scores = torch.matmul(h_transformed, self.a[:, : self.n_hidden, :])
        target_scores = torch.matmul(h_transformed, self.a[:, self.n_hidden :, :])
        e = self.leakyrelu(source_scores + target_scores.mT)
        e = torch.where(adj_mat > 0, e, -9e16 * torch.ones_like(e))
        attention = F.dropout(F.softmax(e, dim=-1), self.dropout, training=self.training)
        return torch.matmul(attention, h_transformed).mean(dim=0)


class GAT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gat1 = GraphAttentionLayer(FEATURES, 8, n_heads=2, dropout=0.3)
        self.gat2 = GraphAttentionLayer(8, CLASSES, n_heads=1, dropout=0.3)

    def forward(self, input_tensor: torch.Tensor, adj_mat: torch.Tensor) -> torch.Tensor:
        x = F.elu(self.gat1(input_tensor, adj_mat))
        return F.log_softmax(self.gat2(x, adj_mat), dim=1)


criterion = nn.NLLLoss()


def build() -> tuple[GAT, torch.optim.Optimizer, Any, torch.Tensor, torch.Tensor]:
    """A random graph with self-loops, the example's masks and optimizer."""
    torch.manual_seed(13)
    features = torch.rand(NODES, FEATURES)
    labels = (features @ torch.randn(FEATURES, CLASSES)).argmax(dim=1)  # learnable, in part
    labels[: NODES // 4] = torch.randint(CLASSES, (NODES // 4,))
    adj_mat = torch.eye(NODES) + (torch.rand(NODES, NODES) < 0.15).float()
    idx = torch.randperm(NODES)
    idx_val, idx_train = idx[10:20], idx[20:]
    model = GAT()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=5e-4)
    return model, optimizer, (features, adj_mat, labels), idx_train, idx_val


def example_test(model: nn.Module, graph: Any, mask: torch.Tensor) -> float:
    """The example's test(), its loss only."""
    features, adj_mat, labels = graph
    model.eval()
    with torch.no_grad():
        return criterion(model(features, adj_mat)[mask], labels[mask]).item()


def original() -> dict[str, Any]:
    """The example's loop (train_iter, then the validation loss) with pyGAT's early stopping."""
    model, optimizer, graph, idx_train, idx_val = build()
    features, adj_mat, labels = graph
    best, best_epoch, bad, best_weights, epochs = float("inf"), 0, 0, None, 0
    for epoch in range(1, EPOCHS + 1):
        model.train()
        optimizer.zero_grad()
        output = model(features, adj_mat)
        loss = criterion(output[idx_train], labels[idx_train])
        loss.backward()
        optimizer.step()
        epochs = epoch
        loss_val = example_test(model, graph, idx_val)
        if loss_val < best:
            best, best_epoch, bad = loss_val, epoch, 0
            best_weights = copy.deepcopy(model.state_dict())
        else:
            bad += 1
            if bad == PATIENCE:
                break
    return {"epochs": epochs, "best": best, "best_epoch": best_epoch, "best_weights": best_weights,
            "last_weights": model.state_dict()}  # fmt: skip


def with_steplib(
    url: str, evaluate: dict[str, Any], saves: dict[str, Any], stop_at: int | None = None
) -> dict[str, Any]:
    model, optimizer, graph, idx_train, idx_val = build()

    def loss_fn(model: nn.Module, graph: Any) -> torch.Tensor:
        features, adj_mat, labels = graph
        return criterion(model(features, adj_mat)[idx_train], labels[idx_train])

    def val_loss(model: nn.Module, graph: Any) -> dict[str, torch.Tensor]:
        features, adj_mat, labels = graph
        return {"value": criterion(model(features, adj_mat)[idx_val], labels[idx_val])}

    evaluator = Evaluator(make_eval_step(val_loss), [graph], metrics={"loss": MeanMetric()},
                          monitor="val_loss", **evaluate)  # fmt: skip
    ckpt = checkpoint_every(url, keep_best=1, metric=evaluator, **saves)
    events = Events(resume_from(ckpt), evaluator, EarlyStopping(evaluator, patience=PATIENCE))
    events.add(ckpt)
    if stop_at is not None:  # a preemption, say
        events.on("step_end", lambda e: Stop("stopped") if e.step == stop_at else None)
    state = TrainState.create(model=model, optimizer=optimizer)
    state = run(make_train_step(loss_fn), state, [graph], events=events, max_epochs=EPOCHS)
    last_weights = copy.deepcopy(model.state_dict())
    load_weights(model, best_checkpoint(url, evaluator))
    return {"epochs": state.epoch, "best": evaluator.best.value, "best_epoch": evaluator.best.step,
            "best_weights": model.state_dict(), "last_weights": last_weights}  # fmt: skip


# A full-batch run evaluates and saves once an update, each at either event. A save every=1
# at the epoch's last (only) update is made at its epoch_end, after the evaluation: before,
# it was made at the step_end, no checkpoint held a score, keep_best=1 kept only the newest
# (the best, of epoch 14, deleted) and best_checkpoint raised after training.
CADENCES = [
    ({"at_epoch_end": True}, {"at_epoch_end": True}),
    ({"at_epoch_end": True}, {"every": 1}),
    ({"every": 1}, {"every": 1}),
    ({"every": 1}, {"at_epoch_end": True}),
]


@pytest.mark.parametrize(("evaluate", "saves"), CADENCES)
def test_gat_with_early_stopping_and_the_best_kept_equals_its_plain_loop(
    tmp_path: Path, evaluate: dict[str, Any], saves: dict[str, Any]
) -> None:
    want = original()
    assert 1 < want["best_epoch"] < want["epochs"] < EPOCHS  # it stops early, after its best
    got = with_steplib(str(tmp_path / "ckpt"), evaluate, saves)
    assert got["epochs"] == want["epochs"]
    assert got["best"] == want["best"]  # the same float32 value
    assert got["best_epoch"] == want["best_epoch"]  # one update per epoch: step == epoch
    assert_same(got["best_weights"], want["best_weights"])
    assert_same(got["last_weights"], want["last_weights"])
    # The best, and the newest (kept for a resume).
    steps = [c.step for c in list_checkpoints(str(tmp_path / "ckpt"))]
    assert steps == [want["best_epoch"], want["epochs"]]


@pytest.mark.parametrize("stop_at", [5, 16])  # before the best; after it, two epochs without
def test_gat_stopped_and_resumed_stops_where_its_plain_loop_does(
    tmp_path: Path, stop_at: int
) -> None:
    want = original()
    url = str(tmp_path / "ckpt")
    cadence = {"at_epoch_end": True}
    with_steplib(url, cadence, cadence, stop_at=stop_at)
    got = with_steplib(url, cadence, cadence)
    assert got["epochs"] == want["epochs"]
    assert (got["best"], got["best_epoch"]) == (want["best"], want["best_epoch"])
    assert_same(got["best_weights"], want["best_weights"])
    assert_same(got["last_weights"], want["last_weights"])

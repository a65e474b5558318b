"""facebookresearch/detr's ``main.py`` and ``engine.train_one_epoch`` (a set-prediction model
trained by AdamW, the backbone in a second parameter group at a lower rate, the gradient's norm
clipped, the rate dropped by a ``StepLR`` at each epoch's end, an evaluation after each epoch)
written as its plain loop and with steplib give the same parameters, AdamW moments, rates and
losses, bit for bit, also killed and resumed in new objects inside an epoch and at an epoch's
end after the rate's drop, and on 2 gloo ranks whose samples hold different numbers of boxes.

What the port keeps of ``models/detr.py`` and ``util/misc.py`` (written here, not copied):
``SetCriterion.forward`` (a matching outside autograd, then ``loss_ce`` over every query with the
"no object" class down-weighted by ``eos_coef``, ``loss_bbox`` (L1) and ``loss_giou`` summed over
the matched boxes and divided by ``num_boxes``, the number of target boxes all-reduced over the
ranks and divided by the world size; ``class_error`` and ``cardinality_error`` for the logs
only; the same losses again, suffixed ``_0``, for the auxiliary decoder layer), the weighted sum
of ``weight_dict``, ``reduce_dict`` for the logged values, and ``clip_grad_norm_`` only when
``clip_max_norm > 0``. A stand-in model: an MLP "backbone" and "transformer" of 2 layers,
predicting ``QUERIES`` (class, box) pairs from each layer; targets a list of dicts of 1 to 3
boxes per sample; a greedy matching instead of scipy's Hungarian one (scipy is no dependency).

With steplib the loss returns the weighted sum and the unweighted dict as aux (``TrainMetrics``
averages it, over the ranks too, as ``reduce_dict`` and ``MetricLogger`` do), ``clip(step,
max_norm=...)``, ``Scheduler(StepLR)`` at each epoch's end and an ``Evaluator`` after it.
The recipe: docs/migration/README.md, "A set-prediction loss normalised over ranks (DETR)".
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torchmetrics import MeanMetric

from steplib import (
    Evaluator,
    Events,
    TrainMetrics,
    TrainState,
    clip,
    make_eval_step,
    make_train_step,
    run,
    seed_everything,
)
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.handlers.scheduling import Scheduler
from steplib.step import ddp_wrap
from steplib.testing import run_ranks
from tests.checkpoint_helpers import KilledError, assert_same_run, record_and_kill

FEATURES, HIDDEN, LAYERS = 6, 16, 2  # an "image" of FEATURES; 2 decoder layers: 1 auxiliary
QUERIES, CLASSES = 4, 3  # --num_queries; num_classes (the "no object" class is CLASSES)
LR, LR_BACKBONE, WEIGHT_DECAY, LR_DROP = 1e-2, 1e-3, 1e-4, 2  # --lr --lr_backbone ... --lr_drop
MAX_NORM, EOS_COEF = 0.1, 0.1  # --clip_max_norm, --eos_coef
WEIGHTS = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}  # --*_loss_coef
WEIGHT_DICT = {**WEIGHTS, **{f"{k}_{i}": v for i in range(LAYERS - 1) for k, v in WEIGHTS.items()}}
BATCH, SAMPLES, VAL, EPOCHS = 4, 26, 6, 4  # 6 updates an epoch (drop_last), 24 in all
UPDATES = SAMPLES // BATCH
EVERY = 4  # saves every 4 updates and at each epoch's end (DETR's): 4, 6, 8, 12, ...


def box_cxcywh_to_xyxy(x: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def generalized_box_iou(boxes1: torch.Tensor, boxes2: torch.Tensor) -> torch.Tensor:
    """util/box_ops.py's, as written there (with its ``box_iou``)."""
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = area1[:, None] + area2 - inter
    iou = inter / union
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[:, :, 0] * wh[:, :, 1]
    return iou - (area - union) / area


@torch.no_grad()
def greedy_matcher(outputs: dict[str, Any], targets: Any) -> list[tuple[torch.Tensor, ...]]:
    """``HungarianMatcher``'s cost (class, L1, GIoU; weights 1, 5, 2) read on the host as there,
    each sample's pairs taken cheapest first instead of by ``linear_sum_assignment``."""
    bs, num_queries = outputs["pred_logits"].shape[:2]
    out_prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)
    out_bbox = outputs["pred_boxes"].flatten(0, 1)
    tgt_ids = torch.cat([v["labels"] for v in targets])
    tgt_bbox = torch.cat([v["boxes"] for v in targets])
    cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
    cost = 5 * torch.cdist(out_bbox, tgt_bbox, p=1) - out_prob[:, tgt_ids] + 2 * cost_giou
    cost = cost.view(bs, num_queries, -1).cpu()
    indices = []
    for i, c in enumerate(cost.split([len(v["boxes"]) for v in targets], -1)):
        c = c[i].clone()
        pairs = []
        for _ in range(min(c.shape)):
            row, col = divmod(int(c.argmin()), c.shape[1])
            pairs.append((row, col))
            c[row, :], c[:, col] = float("inf"), float("inf")
        pairs.sort()  # linear_sum_assignment returns the rows in order
        indices.append(
            tuple(torch.as_tensor(p, dtype=torch.int64) for p in zip(*pairs, strict=True))
        )
    return indices


class SetCriterion(nn.Module):
    """models/detr.py's, as written there, for the losses ``labels``, ``boxes`` and
    ``cardinality``; ``num_boxes`` as there (``normalise=False``: the sums, for a
    ``(loss_sum, num_targets)`` loss)."""

    empty_weight: torch.Tensor

    def __init__(self, normalise: bool = True) -> None:
        super().__init__()
        self.weight_dict, self.normalise = WEIGHT_DICT, normalise
        empty_weight = torch.ones(CLASSES + 1)
        empty_weight[-1] = EOS_COEF
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(self, outputs: Any, targets: Any, indices: Any, log: bool = True) -> Any:
        src_logits = outputs["pred_logits"]
        idx = self._get_src_permutation_idx(indices)
        target_classes_o = torch.cat(
            [t["labels"][J] for t, (_, J) in zip(targets, indices, strict=True)]
        )
        target_classes = torch.full(src_logits.shape[:2], CLASSES, dtype=torch.int64)
        target_classes[idx] = target_classes_o
        loss_ce = F.cross_entropy(src_logits.transpose(1, 2), target_classes, self.empty_weight)
        losses = {"loss_ce": loss_ce}
        if log:
            losses["class_error"] = 100 - accuracy(src_logits[idx], target_classes_o)
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs: Any, targets: Any) -> Any:
        pred_logits = outputs["pred_logits"]
        tgt_lengths = torch.as_tensor([len(v["labels"]) for v in targets])
        card_pred = (pred_logits.argmax(-1) != pred_logits.shape[-1] - 1).sum(1)
        return {"cardinality_error": F.l1_loss(card_pred.float(), tgt_lengths.float())}

    def loss_boxes(self, outputs: Any, targets: Any, indices: Any, num_boxes: Any) -> Any:
        idx = self._get_src_permutation_idx(indices)
        src_boxes = outputs["pred_boxes"][idx]
        target_boxes = torch.cat(
            [t["boxes"][i] for t, (_, i) in zip(targets, indices, strict=True)], dim=0
        )
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none")
        loss_giou = 1 - torch.diag(
            generalized_box_iou(box_cxcywh_to_xyxy(src_boxes), box_cxcywh_to_xyxy(target_boxes))
        )
        return {"loss_bbox": loss_bbox.sum() / num_boxes, "loss_giou": loss_giou.sum() / num_boxes}

    def _get_src_permutation_idx(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for (src, _) in indices])

    def get_losses(self, outputs: Any, targets: Any, num_boxes: Any, log: bool = True) -> Any:
        indices = greedy_matcher(outputs, targets)  # self.matcher(outputs, targets)
        losses = self.loss_labels(outputs, targets, indices, log=log)
        losses.update(self.loss_boxes(outputs, targets, indices, num_boxes))
        if log:  # cardinality on the auxiliary outputs too in DETR; here the last layer's only
            losses.update(self.loss_cardinality(outputs, targets))
        return losses

    def forward(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        num_boxes: Any = 1.0
        if self.normalise:
            num_boxes = sum(len(t["labels"]) for t in targets)
            num_boxes = torch.as_tensor([num_boxes], dtype=torch.float)
            world = 1
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(num_boxes)
                world = dist.get_world_size()
            num_boxes = torch.clamp(num_boxes / world, min=1).item()
        losses = self.get_losses(outputs, targets, num_boxes)
        for i, aux_outputs in enumerate(outputs["aux_outputs"]):
            aux = self.get_losses(aux_outputs, targets, num_boxes, log=False)
            losses.update({k + f"_{i}": v for k, v in aux.items()})
        return losses


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """util/misc.py's, top-1."""
    if target.numel() == 0:
        return torch.zeros([])
    pred = output.topk(1, 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return correct[:1].view(-1).float().sum(0).mul_(100.0 / target.size(0))


class Detr(nn.Module):
    """A stand-in for ``DETR``: its outputs' dict (``pred_logits``, ``pred_boxes``,
    ``aux_outputs`` of the earlier decoder layers) and a submodule named ``backbone``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU())
        self.transformer = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()) for _ in range(LAYERS)
        )
        self.class_embed = nn.Linear(HIDDEN, QUERIES * (CLASSES + 1))
        self.bbox_embed = nn.Linear(HIDDEN, QUERIES * 4)

    def forward(self, samples: torch.Tensor) -> dict[str, Any]:
        h, outs = self.backbone(samples), []
        for layer in self.transformer:
            h = layer(h)
            logits = self.class_embed(h).view(-1, QUERIES, CLASSES + 1)
            outs.append(
                {
                    "pred_logits": logits,
                    "pred_boxes": self.bbox_embed(h).view(-1, QUERIES, 4).sigmoid(),
                }
            )
        return {**outs[-1], "aux_outputs": outs[:-1]}


class Boxes(Dataset[tuple[torch.Tensor, dict[str, torch.Tensor]]]):
    """A detection set: a sample and 1 to 3 boxes (cx, cy, w, h) with their labels."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = torch.randn(n, FEATURES, generator=g)
        counts = torch.randint(1, 4, (n,), generator=g).tolist()
        self.targets = [
            {
                "labels": torch.randint(0, CLASSES, (k,), generator=g),
                "boxes": torch.cat(
                    [
                        0.25 + 0.5 * torch.rand(k, 2, generator=g),
                        0.1 + 0.3 * torch.rand(k, 2, generator=g),
                    ],
                    1,
                ),
            }
            for k in counts
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.samples[i], self.targets[i]


def collate_fn(batch: list[Any]) -> tuple[torch.Tensor, tuple[dict[str, torch.Tensor], ...]]:
    """util/misc.py's (``tuple(zip(*batch))``), the samples stacked (no ``NestedTensor``)."""
    samples, targets = tuple(zip(*batch, strict=True))
    return torch.stack(samples), targets


def _setup(world: int = 1, ddp: Any = DistributedDataParallel) -> tuple[Any, ...]:
    """main.py's model, param_dicts, AdamW, StepLR and loaders (steplib's resumable one for
    the training set, each rank its share when ``world`` > 1)."""
    seed_everything(0)
    model: nn.Module = Detr()
    model_without_ddp = model
    if world > 1:
        model = ddp(model)
    param_dicts: list[dict[str, Any]] = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n]},
        {
            "params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n],
            "lr": LR_BACKBONE,
        },
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=LR, weight_decay=WEIGHT_DECAY)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, LR_DROP)
    loader = resumable_loader(
        Boxes(SAMPLES, seed=1),
        batch_size=BATCH // world,
        seed=3,
        drop_last=True,
        collate_fn=collate_fn,
        shard=world > 1,
    )
    val = [collate_fn([Boxes(VAL, seed=2)[i] for i in range(j, j + 2)]) for j in range(0, VAL, 2)]
    return model, optimizer, lr_scheduler, loader, val


def reduce_dict(input_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """util/misc.py's (average=True)."""
    if not (dist.is_available() and dist.is_initialized()):
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict)
        values = torch.stack([input_dict[k] for k in names])
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return dict(zip(names, values, strict=True))


def weighted(loss_dict: dict[str, torch.Tensor]) -> Any:
    """train_one_epoch's ``losses``."""
    return sum(loss_dict[k] * WEIGHT_DICT[k] for k in loss_dict if k in WEIGHT_DICT)


def _result(model: nn.Module, optimizer: Any, losses: list[Any], **more: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),  # the moments, and each group's last rate
        "losses": [loss.detach().clone() for loss in losses],
        **more,
    }


@functools.cache  # the tests compare with it, never change it
def _plain(world: int = 1) -> dict[str, Any]:
    """main.py's epochs of ``train_one_epoch``, ``lr_scheduler.step()`` and ``evaluate``
    (its loss only), in one process or on ``world`` ranks."""
    model, optimizer, lr_scheduler, loader, val = _setup(world)
    criterion = SetCriterion()
    losses, lrs, epoch_stats, test_losses, boxes = [], [], [], [], []
    for _epoch in range(EPOCHS):
        model.train()
        stats: dict[str, list[float]] = {}
        for samples, targets in loader:
            outputs = model(samples)
            loss_dict = criterion(outputs, targets)
            loss = weighted(loss_dict)
            loss_dict_reduced = reduce_dict(loss_dict)  # MetricLogger's values, unscaled
            optimizer.zero_grad()
            loss.backward()
            if MAX_NORM > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            losses.append(loss)
            boxes.append(sum(len(t["labels"]) for t in targets))
            lrs.append(optimizer.param_groups[0]["lr"])
            for k, v in loss_dict_reduced.items():
                stats.setdefault(k, []).append(v.item())
        lr_scheduler.step()
        epoch_stats.append({k: sum(v) / len(v) for k, v in stats.items()})  # global_avg
        if world == 1:  # evaluate(...)'s loss over the validation set
            model.eval()
            with torch.no_grad():
                test = [weighted(criterion(model(s), t)).item() for s, t in val]
            test_losses.append(sum(test) / len(test))
    return _result(
        model, optimizer, losses, lrs=lrs, stats=epoch_stats, test=test_losses, boxes=boxes
    )


CRITERION = SetCriterion()


def loss_fn(model: Any, batch: Any) -> Any:
    """train_one_epoch's forward: the weighted sum, and the unweighted values to log."""
    samples, targets = batch
    loss_dict = CRITERION(model(samples), targets)
    return weighted(loss_dict), loss_dict  # loss_ce with its graph: the logs read it detached


def eval_fn(model: Any, batch: Any) -> torch.Tensor:
    samples, targets = batch
    return weighted(CRITERION(model(samples), targets))


def _steplib(
    url: str | None = None, kill_at: int | None = None, world: int = 1, loss: Any = loss_fn
) -> dict[str, Any]:
    model, optimizer, lr_scheduler, loader, val = _setup(world, ddp=apply_ddp)
    evaluator = Evaluator(
        make_eval_step(eval_fn), val, metrics={"loss": MeanMetric()}, at_epoch_end=True
    )
    train = TrainMetrics()
    events = Events(Scheduler(lr_scheduler))
    if world == 1:
        events.add(evaluator)
    train.attach(events)
    stats: list[dict[str, float]] = []
    events.on("epoch_end", lambda e: stats.append(train.read(e)))
    if url is not None:
        ckpt = checkpoint_every(url, every=EVERY, epochs=1)
        events.add(resume_from(ckpt))
        events.add(ckpt)
    resumed, losses, lrs = record_and_kill(events, kill_at)
    state = TrainState.create(model=model, optimizer=optimizer)
    step = make_train_step(loss)
    if MAX_NORM > 0:
        step = clip(step, max_norm=MAX_NORM)
    with contextlib.suppress(KilledError):
        run(ddp_wrap(step) if world > 1 else step, state, loader, events=events, max_epochs=EPOCHS)
    test = [float(h["val_loss"]) for _, h in evaluator.history]
    return _result(model, optimizer, losses, lrs=lrs, stats=stats, test=test, resumed=resumed[0])


SUMS = SetCriterion(normalise=False)


def loss_fn_targets(model: Any, batch: Any) -> Any:
    """``num_boxes`` as steplib's target count: ``(loss_sum, num_targets)`` with the box losses
    summed over this rank's boxes (the step divides the gradient by the boxes of all ranks) and
    ``loss_ce``, a mean over the queries, times this rank's boxes (to be divided back)."""
    samples, targets = batch
    loss_dict = SUMS(model(samples), targets)
    num_boxes = sum(len(t["labels"]) for t in targets)
    loss_sum = sum(
        loss_dict[k] * WEIGHT_DICT[k] * (num_boxes if k.startswith("loss_ce") else 1)
        for k in loss_dict
        if k in WEIGHT_DICT
    )
    return loss_sum, num_boxes, {k: v.detach() for k, v in loss_dict.items()}


def test_detr_loop_with_steplib_equals_it_bit_for_bit() -> None:
    want = _plain()
    # the run is not trivial: the rate dropped after 2 epochs, the backbone's a tenth of it
    assert want["lrs"] == [LR] * 12 + [LR / 10] * 12
    assert want["optimizer"]["param_groups"][1]["lr"] == LR_BACKBONE / 100
    got = _steplib()
    assert_same_run(got, want)
    # the logs: each epoch's means of the unweighted losses (MetricLogger's in float64, here
    # in float32 on the device) and the evaluation's loss (a MeanMetric in float32)
    assert [set(s) - set(want["stats"][0]) for s in got["stats"]] == [
        {"updates", "loss", "num_targets", "lr"}
    ] * EPOCHS
    for mine, theirs in zip(got["stats"], want["stats"], strict=True):
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs, rel=1e-6)
    assert got["test"] == pytest.approx(want["test"], rel=1e-6)


@pytest.mark.parametrize(("kill_at", "resumed"), [(6, 4), (10, 8), (14, 12), (23, 20)])
# at an epoch's last update, before its end's save (resumed from 4, inside the first epoch);
# inside the second epoch; after the save at the second epoch's end, where every=4 and the
# epoch's end meet and the rate dropped (12); inside the last epoch
def test_detr_loop_killed_and_resumed_equals_it_uninterrupted(
    tmp_path: Path, kill_at: int, resumed: int
) -> None:
    url = str(tmp_path / "ckpt")
    _steplib(url, kill_at=kill_at)
    got = _steplib(url)
    assert got["resumed"] == resumed
    assert_same_run(got, _plain())
    # the evaluator's history, the evaluations before the save too (in the checkpoint)
    assert got["test"] == pytest.approx(_plain()["test"], rel=1e-6)
    want = _plain()["stats"]  # each epoch's means, the resumed epoch's too (in the checkpoint)
    first = resumed // UPDATES
    for mine, theirs in zip(got["stats"], want[first:], strict=True):
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs, rel=1e-6)


def _apart(got: dict[str, Any], want: dict[str, Any]) -> float:
    return max(float((got["model"][k] - v).abs().max()) for k, v in want["model"].items())


def _plain_on_ranks(rank: int, world: int) -> dict[str, Any]:
    return _plain(world=world)


def _steplib_on_ranks(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    return _steplib(world=world, **kwargs)


def test_num_boxes_as_num_targets_is_detrs_on_one_process() -> None:
    """``(loss_sum, num_targets)``, the box losses' sums over ``num_boxes``, and ``loss_ce``
    times ``num_boxes``: DETR's loss on one process, rounded otherwise (6e-8 apart after 24
    updates)."""
    assert 0 < _apart(_steplib(loss=loss_fn_targets), _plain()) < 1e-6


def _stats_on_ranks(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Each epoch's means, over both ranks (``TrainMetrics``'s aux all-reduced when read,
    ``reduce_dict``'s each update)."""
    first = got["resumed"] // UPDATES
    for mine, theirs in zip(got["stats"], want["stats"][first:], strict=True):
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs, rel=1e-6)


def test_detr_under_ddp_killed_and_resumed_equals_its_ddp_loop(tmp_path: Path) -> None:
    """2 gloo ranks whose batches hold different numbers of boxes: DETR's criterion kept as it
    is (``num_boxes`` all-reduced in the loss, a plain scalar loss) gives DETR's DDP loop bit
    for bit, also killed at update 14 and resumed from the save at 12 in new processes.
    Expressed as ``(loss_sum, num_targets)`` instead, the box losses are normalised as DETR's
    (by the boxes of all ranks) but ``loss_ce``, a mean over each rank's queries, is weighted
    by each rank's share of the boxes instead of ``1 / world``: 0.076 apart in the weights."""
    url = str(tmp_path / "ckpt")
    want = run_ranks(_plain_on_ranks, world=2)
    assert want[0]["boxes"][:3] == [3, 4, 2] and want[1]["boxes"][:3] == [2, 3, 4]
    got = run_ranks(_steplib_on_ranks, world=2)
    run_ranks(functools.partial(_steplib_on_ranks, url=url, kill_at=14), world=2)
    resumed = run_ranks(functools.partial(_steplib_on_ranks, url=url), world=2)
    assert [rank["resumed"] for rank in resumed] == [12, 12]
    targets = run_ranks(functools.partial(_steplib_on_ranks, loss=loss_fn_targets), world=2)
    for rank in range(2):
        mean = [(a + b) / 2 for a, b in zip(want[0]["losses"], want[1]["losses"], strict=True)]
        mine = {**want[rank], "losses": mean}  # the loss reported: the mean over the ranks
        assert_same_run(got[rank], mine)
        assert_same_run(resumed[rank], mine)
        _stats_on_ranks(got[rank], want[rank])
        _stats_on_ranks(resumed[rank], want[rank])
        assert 0.05 < _apart(targets[rank], want[rank]) < 0.1

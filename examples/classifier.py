"""The README's tour: a CNN; accumulation, clipping, warmup + cosine; evaluation, early stopping
and keep-best checkpoints on one metric; TensorBoard; a progress bar; a test of the best."""

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import steplib as sl
from steplib.checkpoint import best_checkpoint, load


def images(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 4, (n,), generator=g)
    for q in range(4):  # the class is the brighter quadrant
        x[y == q, :, q // 2 * 6 : q // 2 * 6 + 6, q % 2 * 6 : q % 2 * 6 + 6] += 0.5
    return list(zip(x.split(32), y.split(32), strict=True))


def main(root: str = "runs/classifier", epochs: int = 4) -> float:
    sl.seed_everything(0)
    train, val, test = images(1024, 0), images(256, 1), images(256, 2)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(800, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sl.warmup_cosine(warmup=8, total=16 * epochs))
    state = sl.TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = sl.make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), to_device=True)
    step = sl.clip(sl.accumulate(step, 2), max_norm=1.0)
    eval_step = sl.make_eval_step(lambda m, b: (m(b[0]), b[1]), to_device=True)
    acc = {"accuracy": MulticlassAccuracy(4, average="micro")}  # correct / total
    tb = sl.TensorBoardLogger(f"{root}/tb")
    evaluator = sl.Evaluator(
        eval_step, val, metrics=acc, every=20, monitor="val_accuracy", mode="max", sinks=[tb]
    )
    stop = sl.EarlyStopping(evaluator, patience=3)
    keep_best = sl.checkpoint_every(root, every=20, keep_best=1, metric=evaluator)
    handlers = [evaluator, stop, keep_best, sl.handlers.Log(tb, every=10), sl.ProgressBar()]
    state = sl.run(step, state, train, events=handlers, max_epochs=epochs)
    best = load(best_checkpoint(root, evaluator), state, step=step)
    return float(sl.evaluate(eval_step, best.model, test, metrics=acc)["accuracy"])


if __name__ == "__main__":
    print(f"test accuracy of the best checkpoint: {main():.3f}")

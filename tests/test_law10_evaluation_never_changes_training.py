"""Law 10: evaluation never changes training. Losses and parameters are bit-identical with and
without any evaluation (the sanity pass, every N updates, several validation sets, at epoch and
fit end), whatever the validation loader is, against the plain loop of ``tests/reference.py``
that evaluates nothing; and a run resumed with evaluation on equals the uninterrupted one.

What evaluation could draw from training's generators: starting a ``DataLoader`` iterator takes
a base seed from torch's global generator, a shuffling sampler without its own generator draws
its order from it, and an eval step may draw itself (noise, test-time augmentation) from torch,
numpy or Python's ``random``. The training loss here draws from all three and uses dropout, so
any draw evaluation leaves behind shows in the losses.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from steplib import Evaluator, Events, TrainState, make_eval_step, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from tests.reference import Batch, make_batches, params_of, reference_loop, tiny_model

EPOCHS, BATCHES = 2, 6


def noisy_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A loss that draws from every global generator: torch (dropout, noise), numpy, random."""
    x, y, _ = batch
    scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
    return F.mse_loss(model(x + 0.01 * torch.randn_like(x)) * scale, y)


def noisy_eval(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """An eval step that draws from every global generator too (test-time noise)."""
    x = batch[0]
    random.random(), np.random.rand()
    return {"value": model(x + torch.randn_like(x)).pow(2).mean()}


def validation_sets() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, 8, generator=gen)
    return {
        # A shuffling loader with no generator of its own: its order and base seed come from
        # torch's global generator.
        "val": DataLoader(TensorDataset(x), batch_size=8, shuffle=True),
        "ood": [(x[:8] * 3,), (x[8:16] * 3,)],  # a plain list
    }


def evaluator(every: int = 3) -> Evaluator:
    return Evaluator(
        make_eval_step(noisy_eval),
        validation_sets(),
        metrics={"loss": MeanMetric()},
        every=every,
        at_epoch_end=True,
        at_fit_end=True,
        sanity_batches=2,
        combine="loss",
    )


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def steplib_run(
    events: Events, *, epochs: int = EPOCHS, state: TrainState | None = None
) -> tuple[list[torch.Tensor], TrainState]:
    losses: list[torch.Tensor] = []
    events.on("step_end", lambda event: losses.append(event.output.loss.clone()))
    if state is None:
        model = tiny_model(0, dropout=0.3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState.create(model=model, optimizer=opt)
    seed_all(7)
    data = make_batches(BATCHES)
    state = run(make_train_step(noisy_loss), state, data, events=events, max_epochs=epochs)
    return losses, state


def test_law10_evaluation_never_changes_training_losses_or_parameters() -> None:
    model = tiny_model(0, dropout=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seed_all(7)
    records = reference_loop(model, opt, make_batches(BATCHES) * EPOCHS, noisy_loss)

    watched = evaluator()
    losses, state = steplib_run(watched.attach(Events()))

    assert len(watched.history) >= 4  # every 3 updates, the epoch ends, the fit end
    assert watched.sanity_values is not None
    assert [float(r["loss"]) for r in records] == [float(loss) for loss in losses]
    for mine, theirs in zip(params_of(state.model), params_of(model), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("every", [1, 4])
def test_law10_holds_whatever_the_cadence(every: int) -> None:
    quiet, _ = steplib_run(Events())
    watched, _ = steplib_run(evaluator(every).attach(Events()))
    assert [float(x) for x in quiet] == [float(x) for x in watched]


def test_law10_a_resumed_run_with_evaluation_equals_the_uninterrupted_one(tmp_path: Any) -> None:
    uninterrupted, whole = steplib_run(evaluator().attach(Events()))

    # The first leg: one epoch, checkpointed at its end; the second: new objects, resumed
    # (the sanity pass runs again at its start).
    directory = str(tmp_path / "ckpt")
    first_leg = evaluator().attach(Events())
    checkpoint_every(directory, at_epoch_end=True).attach(first_leg)
    first, _ = steplib_run(first_leg, epochs=1)

    second_leg = Events().on("fit_start", resume_from(directory))
    evaluator().attach(second_leg)
    second, resumed = steplib_run(second_leg)

    assert [float(x) for x in first + second] == [float(x) for x in uninterrupted]
    for mine, theirs in zip(params_of(resumed.model), params_of(whole.model), strict=True):
        assert torch.equal(mine, theirs)

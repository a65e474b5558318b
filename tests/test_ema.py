"""EMA: equals a hand-computed average and torch's own EMA (``AveragedModel``) bit for bit,
skips updates that were not applied, copies or averages buffers, takes its decay from a function
of the update's number (timm's ``ModelEmaV3``: tests/test_timm_recipe.py), evaluates, and is
saved and restored with a checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    Events,
    TrainState,
    accumulate,
    make_train_step,
    run,
    skip_nonfinite,
)
from steplib.checkpoint import load, save
from steplib.handlers import EMA, evaluate, make_eval_step


def _setup(n: int = 8, *, nan_at: int | None = None, batch_norm: bool = False):
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 6)]
    if batch_norm:
        layers.append(torch.nn.BatchNorm1d(6))
    layers += [torch.nn.Tanh(), torch.nn.Linear(6, 3)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    state = TrainState.create(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        x = torch.randn(5, 4, generator=gen)
        if i == nan_at:
            x[0, 0] = float("nan")
        batches.append((x, torch.randint(0, 3, (5,), generator=gen)))
    return state, batches


def _loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.numel()


def _by_hand(state, step, batches, decay: float):
    """Train with a handler that keeps its own EMA with the textbook formula."""
    average = [p.detach().clone() for p in state.model.parameters()]
    applied: list[bool] = []

    def track(event) -> None:
        did = bool(event.output.did_update)
        applied.append(did)
        if did:
            for a, p in zip(average, state.model.parameters(), strict=True):
                a.copy_(decay * a + (1 - decay) * p.detach())

    return average, applied, Events().on("step_end", track)


def test_ema_equals_the_hand_computed_average() -> None:
    state, batches = _setup(8)
    ema = EMA(state.model, decay=0.8)
    step = accumulate(make_train_step(_loss_fn), 2)
    average, applied, events = _by_hand(state, step, batches, 0.8)
    ema.attach(events)
    run(step, state, batches, events=events)
    assert applied == [True] * 4 and ema.updates == 4
    for mine, theirs in zip(ema.module.parameters(), average, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    # ...and differs from the live weights (it is an average, not a copy).
    assert not torch.allclose(next(ema.module.parameters()), next(state.model.parameters()))


def test_ema_is_unchanged_by_a_skipped_update() -> None:
    state, batches = _setup(6, nan_at=3)
    ema = EMA(state.model, decay=0.5)
    step = skip_nonfinite(make_train_step(_loss_fn))
    snapshots: list[list[torch.Tensor]] = []
    average, applied, events = _by_hand(state, step, batches, 0.5)
    ema.attach(events)
    events.on("step_end", lambda e: snapshots.append([p.clone() for p in ema.module.parameters()]))
    final = run(step, state, batches, events=events)

    assert applied == [True, True, True, False, True, True] and final.skipped_updates == 1
    assert ema.updates == 5
    for before, after in zip(snapshots[2], snapshots[3], strict=True):
        assert torch.equal(before, after)  # the skipped update left the average as it was
    for mine, theirs in zip(ema.module.parameters(), average, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_warmup_uses_the_smaller_decay_early_on() -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    ema = EMA(model, decay=0.99, warmup=True)
    model.weight.data.fill_(1.0)
    ema.update()
    # n = 1 after the first update: d = min(0.99, 2 / 11)
    assert ema.module.state_dict()["weight"].item() == pytest.approx(1 - 2 / 11)


@pytest.mark.parametrize("buffers", [False, True])
def test_ema_equals_torchs_averaged_model_ema_bit_for_bit(buffers: bool) -> None:
    """torch's EMA copies the weights at its first update, then lerps (one rounding): a decay
    function of the update's number gives the copy, and the average lerps too."""
    state, batches = _setup(6, batch_norm=True)
    theirs = AveragedModel(state.model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=buffers)
    ema = EMA(state.model, decay=lambda n: 0.0 if n == 1 else 0.8, average_buffers=buffers)
    events = ema.attach(Events()).on("step_end", lambda e: theirs.update_parameters(state.model))
    run(make_train_step(_loss_fn), state, batches, events=events)
    live = state.model.state_dict()
    for (name, mine), their in zip(
        ema.module.state_dict().items(), theirs.module.state_dict().values(), strict=True
    ):
        # torch casts an averaged integer buffer (num_batches_tracked) back to an integer
        assert torch.equal(mine, their if mine.is_floating_point() else live[name]), name
    assert buffers != torch.equal(ema.module.state_dict()["1.running_var"], live["1.running_var"])


def test_a_decay_function_gets_each_updates_number_skipped_ones_counted() -> None:
    state, batches = _setup(6, nan_at=3)
    seen: list[int] = []

    def decay(n: int) -> float:
        seen.append(n)
        return 0.5

    ema = EMA(state.model, decay=decay)
    run(skip_nonfinite(make_train_step(_loss_fn)), state, batches, events=ema.attach(Events()))
    assert seen == [1, 2, 3, 4, 5, 6] and ema.updates == 5
    with pytest.raises(ConfigError, match=r"step=state\.step"):
        ema.update()
    with pytest.raises(ConfigError, match=r"decay function at update 7 received 1\.0"):
        EMA(state.model, decay=lambda n: 1.0).update(step=7)
    with pytest.raises(ConfigError, match="warmup=True"):
        EMA(state.model, decay=lambda n: 0.5, warmup=True)
    saved = ema.state_dict()
    EMA(state.model, decay=lambda n: 0.9).load_state_dict(saved)  # a function: not compared
    with pytest.raises(ConfigError, match="decay='a function'"):
        EMA(state.model, decay=0.5).load_state_dict(saved)


def test_buffers_are_copied_and_the_average_evaluates() -> None:
    state, batches = _setup(4, batch_norm=True)
    ema = EMA(state.model, decay=0.5)
    run(make_train_step(_loss_fn), state, batches, events=ema.attach(Events()))
    mine, theirs = ema.module.state_dict(), state.model.state_dict()
    assert torch.equal(mine["1.running_mean"], theirs["1.running_mean"])
    assert not ema.module.training and state.model.training

    eval_step = make_eval_step(lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))
    on_ema = evaluate(eval_step, ema.module, batches, metrics=MeanMetric())
    on_model = evaluate(eval_step, state, batches, metrics=MeanMetric())
    loaded = copy.deepcopy(state.model)
    loaded.load_state_dict(ema.module.state_dict())
    assert on_ema == evaluate(eval_step, loaded, batches, metrics=MeanMetric())
    assert on_ema != on_model


def test_ema_is_saved_and_restored_with_a_checkpoint(tmp_path: Path) -> None:
    state, batches = _setup(4)
    ema = EMA(state.model, decay=0.7)
    state = run(make_train_step(_loss_fn), state, batches, events=ema.attach(Events()))
    url = save(state, str(tmp_path / "ckpt"), extras={"ema": ema})

    fresh_state, _ = _setup(4)
    fresh = EMA(fresh_state.model, decay=0.7)
    load(url, fresh_state, extras={"ema": fresh})
    assert fresh.updates == 4
    for a, b in zip(fresh.module.parameters(), ema.module.parameters(), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(ConfigError, match=r"decay=0\.7"):
        EMA(fresh_state.model, decay=0.9).load_state_dict(ema.state_dict())


@pytest.mark.parametrize("decay", [1.0, -0.1, 2, True, "0.9"])
def test_bad_decay_is_a_config_error(decay) -> None:
    with pytest.raises(ConfigError, match="decay"):
        EMA(torch.nn.Linear(1, 1), decay=decay)


def test_not_a_module_and_a_changed_model_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="module"):
        EMA("model")  # type: ignore[arg-type]
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    ema = EMA(model)
    model.append(torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="changed after EMA"):
        ema.update()


def _gan(counted_first: str):
    torch.manual_seed(0)
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opts = {
        "G": torch.optim.SGD(g.parameters(), lr=0.1),
        "D": torch.optim.SGD(d.parameters(), lr=0.1),
    }
    order = [counted_first, *(n for n in opts if n != counted_first)]
    state = TrainState.create(model={"G": g, "D": d}, optimizer={n: opts[n] for n in order})
    d_step = make_train_step(lambda m, b: m["D"](m["G"](b).detach()).pow(2).mean(), optimizer="D")
    g_step = make_train_step(lambda m, b: -m["D"](m["G"](b)).mean(), optimizer="G")
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 2, generator=gen) for _ in range(6)]
    return state, {"D": accumulate(d_step, 2), "G": g_step}, batches


@pytest.mark.parametrize("counted_first", ["D", "G"])
def test_ema_of_one_model_in_a_run_of_several_steps_follows_that_models_updates(
    counted_first: str,
) -> None:
    # D updates every 2nd batch, G every batch. Before the fix the EMA averaged on the run's
    # step_end, the first optimizer's updates: with D first, 3 of G's 6 updates.
    state, steps, batches = _gan(counted_first)
    ema = EMA(state.model["G"], decay=0.5)
    run(steps, state, batches, events=[ema])

    ref_state, ref_steps, _ = _gan(counted_first)
    generator = ref_state.model["G"]
    average = [p.detach().clone() for p in generator.parameters()]
    updates = 0
    for index, batch in enumerate(batches):  # the plain loop: average after each of G's updates
        last = index == len(batches) - 1
        ref_state, _ = ref_steps["D"](ref_state, batch, close_window=last)
        ref_state, out = ref_steps["G"](ref_state, batch, close_window=last)
        if bool(out.did_update):
            updates += 1
            for a, p in zip(average, generator.parameters(), strict=True):
                a.copy_(0.5 * a + 0.5 * p.detach())
    assert updates == 6 and ema.updates == 6
    for mine, theirs in zip(ema.module.parameters(), average, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_ema_in_a_run_of_several_steps_refuses_what_it_cannot_follow() -> None:
    state, steps, batches = _gan("D")
    # The whole ModuleDict: G's and D's optimizers both update it.
    with pytest.raises(
        ConfigError, match=r"optimizers \['D', 'G'\] of the state.*EMA\(generator\)"
    ):
        run(steps, state, batches, events=[EMA(state.model)])


def test_ema_follows_the_step_built_with_its_optimizer_whatever_the_steps_are_named() -> None:
    # Named otherwise than their optimizers, the steps were refused ("which one updates G is
    # not known"); each step knows the optimizer it was built with.
    averages = []
    for names in (("D", "G"), ("critic", "generator")):
        state, steps, batches = _gan("D")
        ema = EMA(state.model["G"], decay=0.5)
        run(dict(zip(names, steps.values(), strict=True)), state, batches, events=[ema])
        averages.append((ema.updates, [p.clone() for p in ema.module.parameters()]))
    assert averages[0][0] == averages[1][0] == 6
    for named, renamed in zip(averages[0][1], averages[1][1], strict=True):
        assert torch.equal(named, renamed)


def _ema_of_fsdp(rank: int, world: int) -> str:
    from steplib.distributed import apply_fsdp

    try:
        EMA(apply_fsdp(torch.nn.Linear(2, 2)))
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_an_ema_of_an_fsdp2_model_is_refused_with_what_to_do() -> None:
    # It failed in torch's deepcopy ("FSDP does not support deepcopy"), naming no way out.
    from steplib.testing import run_ranks

    for message in run_ranks(_ema_of_fsdp):
        assert "FSDP2-sharded" in message and "apply_ddp" in message

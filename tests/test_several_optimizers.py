"""Several named models and optimizers in one TrainState (issue 17): a tiny GAN equals a
hand-written two-optimizer loop bit for bit; a frozen teacher stays frozen; a checkpoint holds
both optimizers and resumes exactly; ddp_wrap with two DDP models equals one process; errors."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    ddp_wrap,
    evaluate,
    make_eval_step,
    make_train_step,
    run,
)
from steplib.checkpoint import load, save
from steplib.testing import run_ranks

K = 2  # both optimizers accumulate 2 micro-batches per update
Batch = tuple[torch.Tensor, torch.Tensor]


def _nets(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    critic = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    return generator, critic


def _data(n: int, size: int = 6, seed: int = 1) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 2, generator=gen) * 0.5 + 1, torch.randn(size, 4, generator=gen))
            for _ in range(n)]  # fmt: skip


def d_loss(model: Any, batch: Batch) -> torch.Tensor:
    real, z = batch
    fake = model["G"](z).detach()
    real_logits, fake_logits = model["D"](real), model["D"](fake)
    return F.binary_cross_entropy_with_logits(
        real_logits, torch.ones_like(real_logits)
    ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))


def g_loss(model: Any, batch: Batch) -> torch.Tensor:
    _, z = batch
    logits = model["D"](model["G"](z))
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def _optimizers(g: nn.Module, d: nn.Module) -> tuple[Any, Any, Any, Any]:
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-2, betas=(0.5, 0.9))
    sched_g = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda s: 1.0 / (1 + s))
    scaler_d = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return opt_g, opt_d, sched_g, scaler_d


def _state(g: nn.Module, d: nn.Module) -> TrainState:
    opt_g, opt_d, sched_g, scaler_d = _optimizers(g, d)
    return TrainState.create(
        model={"G": g, "D": d},
        optimizer={"G": opt_g, "D": opt_d},
        scheduler={"G": sched_g},
        scaler={"D": scaler_d},
    )


def _steps() -> tuple[Any, Any]:
    d_step = make_train_step(d_loss, optimizer="D")
    d_step = clip(amp_wrap(accumulate(d_step, K), dtype=torch.float16), max_norm=1.0)
    g_step = clip(accumulate(make_train_step(g_loss, optimizer="G"), K), max_norm=0.5)
    return d_step, g_step


def _hand_written_gan(g: nn.Module, d: nn.Module, data: list[Batch]) -> torch.amp.GradScaler:
    """The loop a user writes by hand: D then G on every batch, each accumulating K
    micro-batches; D in float16 with loss scaling and clipping at 1.0, G clipped at 0.5 with a
    schedule. D is frozen during G's backward (so that G's loss leaves D's gradients alone)."""
    opt_g, opt_d, sched_g, scaler = _optimizers(g, d)
    nets = {"G": g, "D": d}
    for i, batch in enumerate(data):
        closes = (i + 1) % K == 0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = d_loss(nets, batch)
        scaler.scale(loss / K).backward()
        if closes:
            scaler.unscale_(opt_d)
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            scaler.step(opt_d)
            scaler.update()
            opt_d.zero_grad(set_to_none=True)
        d.requires_grad_(False)
        (g_loss(nets, batch) / K).backward()
        d.requires_grad_(True)
        if closes:
            torch.nn.utils.clip_grad_norm_(g.parameters(), 0.5)
            opt_g.step()
            opt_g.zero_grad(set_to_none=True)
            sched_g.step()
    return scaler


def _train(state: TrainState, data: list[Batch]) -> TrainState:
    d_step, g_step = _steps()
    for batch in data:
        state, _ = d_step(state, batch)
        state, _ = g_step(state, batch)
    return state


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, got), want in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_a_gan_equals_the_hand_written_two_optimizer_loop_bit_for_bit() -> None:
    data = _data(6)
    ref_g, ref_d = _nets()
    ref_scaler = _hand_written_gan(ref_g, ref_d, data)
    g, d = _nets()
    state = _train(_state(g, d), data)
    _assert_same(g, ref_g)
    _assert_same(d, ref_d)
    assert state.names == ("G", "D")
    assert (state.step, state["D"].step) == (3, 3)
    assert (state.micro_step, state["D"].micro_step) == (6, 6)
    assert state["D"].scaler.get_scale() == ref_scaler.get_scale()  # type: ignore[union-attr]
    assert state.scheduler.last_epoch == 3 and state["D"].scheduler is None  # type: ignore[union-attr]


def test_the_generator_step_leaves_the_open_critic_window_alone() -> None:
    g, d = _nets()
    state = _state(g, d)
    d_step, g_step = _steps()
    batch = _data(1)[0]
    state, _ = d_step(state, batch)  # D's window is open: its gradients are its own so far
    before = [p.grad.clone() for p in d.parameters()]  # type: ignore[union-attr]
    state, _ = g_step(state, batch)
    assert all(torch.equal(p.grad, b) for p, b in zip(d.parameters(), before, strict=True))  # type: ignore[arg-type]
    assert all(p.grad is not None for p in g.parameters())
    assert state["D"].window.size == 1 and state.window.size == 1


def test_a_frozen_teacher_is_never_trained_and_stays_in_eval_mode() -> None:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    student = nn.Sequential(nn.Linear(4, 3))
    ref_student = nn.Sequential(nn.Linear(4, 3))
    ref_student.load_state_dict(student.state_dict())
    teacher.requires_grad_(False).eval()
    kept = {k: v.clone() for k, v in teacher.state_dict().items()}

    def distill(model: Any, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = F.softmax(model["teacher"](x), dim=-1)
        return F.cross_entropy(model["student"](x), target)

    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    state = TrainState.create(model={"student": student, "teacher": teacher}, optimizer=opt)
    step = make_train_step(distill)
    ref_opt = torch.optim.SGD(ref_student.parameters(), lr=0.5)
    data = [torch.randn(5, 4) for _ in range(4)]
    for x in data:
        state, _ = step(state, x)
        evaluate(make_eval_step(distill), state, data[:1], metrics=MeanMetric())
        ref_loss = F.cross_entropy(ref_student(x), F.softmax(teacher(x), dim=-1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    _assert_same(student, ref_student)
    assert not teacher.training
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, kept[k]) for k, v in teacher.state_dict().items())


def test_a_checkpoint_holds_both_optimizers_and_resumes_exactly(tmp_path: Path) -> None:
    data = _data(7)
    g, d = _nets()
    state = _train(_state(g, d), data[:3])  # both windows open: 1 of 2 micro-batches
    assert state.window.size == 1 and state["D"].window.size == 1
    url = save(state, str(tmp_path))
    state = _train(state, data[3:])
    want_g, want_d = [p.clone() for p in g.parameters()], [p.clone() for p in d.parameters()]

    g2, d2 = _nets(seed=5)  # other initial weights: everything must come from the checkpoint
    resumed = load(url, _state(g2, d2))
    assert (resumed.step, resumed["D"].step) == (1, 1)
    assert (resumed.window.size, resumed["D"].window.size) == (1, 1)
    assert resumed["D"].scaler.get_scale() == 2.0**8  # type: ignore[union-attr]
    resumed = _train(resumed, data[3:])
    assert all(torch.equal(a, b) for a, b in zip(g2.parameters(), want_g, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(d2.parameters(), want_d, strict=True))
    assert resumed["D"].scaler.get_scale() == state["D"].scaler.get_scale()  # type: ignore[union-attr]
    assert resumed.scheduler.last_epoch == state.scheduler.last_epoch  # type: ignore[union-attr]


def test_a_checkpoint_of_two_optimizers_does_not_load_into_one(tmp_path: Path) -> None:
    g, d = _nets()
    url = save(_state(g, d), str(tmp_path))
    model = nn.ModuleDict({"G": g, "D": d})
    single = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(ConfigError, match=r"holds the optimizers \['G', 'D'\], this state one"):
        load(url, single)


def test_the_errors_say_which_optimizer_and_the_fix() -> None:
    g, d = _nets()
    state = _state(g, d)
    batch = _data(1)[0]
    with pytest.raises(ConfigError, match=r"optimizers are \['G', 'D'\]: name the one.*'G'"):
        make_train_step(g_loss)(state, batch)
    with pytest.raises(ConfigError, match=r"updates optimizer 'E'.*name one of them"):
        make_train_step(g_loss, optimizer="E")(state, batch)
    with pytest.raises(ConfigError, match=r"make_train_step\(optimizer=\.\.\.\) received"):
        make_train_step(g_loss, optimizer="")
    with pytest.raises(KeyError, match=r"optimizers are \['G', 'D'\]"):
        state["E"]
    opt_g, opt_d, sched_g, _ = _optimizers(g, d)
    with pytest.raises(ConfigError, match=r"scheduler=\{'G': ...\}"):
        TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d},
                          scheduler=sched_g)  # fmt: skip
    with pytest.raises(ConfigError, match=r"names \['E'\], which are not optimizers"):
        TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d},
                          scheduler={"E": sched_g})  # fmt: skip
    both = torch.optim.SGD(d.parameters(), lr=1)
    with pytest.raises(ConfigError, match="in both optimizer 'D' and optimizer 'both'"):
        TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d, "both": both})
    with pytest.raises(ConfigError, match=r"model\['D'\] has 4 trainable parameter\(s\) that no"):
        TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g})
    single = TrainState.create(model=g, optimizer=opt_g)
    with pytest.raises(ConfigError, match="build the step without optimizer='G'"):
        make_train_step(g_loss, optimizer="G")(single, batch)


def test_a_step_whose_loss_reaches_none_of_its_optimizers_parameters_is_refused() -> None:
    # The steps' optimizer names swapped: D's loss (through G's detached output) reached none
    # of G's parameters, so "G's" updates changed nothing, while G's loss trained D to call
    # the fakes real; both counted as updates, in silence.
    g, d = _nets()
    state, batch = _state(g, d), _data(1)[0]
    before = [p.clone() for p in g.parameters()]
    swapped = r"optimizer 'G' reached none of its trainable.*optimizer='D'"
    with pytest.raises(ConfigError, match=swapped):
        make_train_step(d_loss, optimizer="G")(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, g.parameters(), strict=True))
    # The right name trains: D's window holds its gradients.
    state, _ = accumulate(make_train_step(d_loss, optimizer="D"), 2)(state, batch)
    assert all(p.grad is not None for p in d.parameters())


def test_one_scaler_shared_by_two_optimizers_is_refused_with_the_fix() -> None:
    # D's update grows or backs off the shared scale while G's window is open: G's earlier
    # micro-batches were scaled by the old scale and would be unscaled by the new one (with
    # growth_interval=1 G trained 0.025 away from the unscaled run), in silence.
    g, d = _nets()
    opt_g, opt_d, _, scaler = _optimizers(g, d)
    with pytest.raises(ConfigError) as info:
        TrainState.create(
            model={"G": g, "D": d},
            optimizer={"G": opt_g, "D": opt_d},
            scaler={"G": scaler, "D": scaler},
        )
    message = str(info.value)
    assert "one GradScaler for both 'G' and 'D'" in message
    assert "'D': torch.amp.GradScaler(device)" in message


def test_optimizers_swapped_between_named_models_are_refused() -> None:
    # The "G" step would train D, and the "D" step G: every loss right, the wrong net moved.
    g, d = _nets()
    swapped = {"G": torch.optim.Adam(d.parameters()), "D": torch.optim.Adam(g.parameters())}
    with pytest.raises(ConfigError) as info:
        TrainState.create(model={"G": g, "D": d}, optimizer=swapped)
    assert "optimizer 'G' updates parameters of model['D'], none of model['G']" in str(info.value)
    assert "torch.optim.Adam(model['G'].parameters())" in str(info.value)
    # Named after no module, or training its own module and a shared one: accepted.
    shared = nn.Linear(2, 2)
    TrainState.create(
        model={"G": g, "D": d, "E": shared},
        optimizer={
            "G": torch.optim.Adam([*g.parameters(), *shared.parameters()]),
            "critic": torch.optim.Adam(d.parameters()),
        },
    )


def test_a_module_named_like_an_nn_module_method_is_refused_with_the_fix() -> None:
    g, _ = _nets()
    with pytest.raises(ConfigError, match=r"module named 'train'.*model=\{'train_net': \.\.\.\}"):
        TrainState.create(model={"train": g}, optimizer=torch.optim.Adam(g.parameters()))


def _ddp_gan(rank: int, world: int) -> list[torch.Tensor]:
    from steplib.distributed import apply_ddp

    g, d = _nets()
    g, d = apply_ddp(g), apply_ddp(d)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-2, betas=(0.5, 0.9))
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    d_step = ddp_wrap(clip(accumulate(make_train_step(d_loss, optimizer="D"), K), max_norm=1.0))
    g_step = ddp_wrap(clip(accumulate(make_train_step(g_loss, optimizer="G"), K), max_norm=0.5))
    for real, z in _data(4, size=8):
        half = slice(rank * 4, (rank + 1) * 4)
        state, _ = d_step(state, (real[half], z[half]))
        state, _ = g_step(state, (real[half], z[half]))
    result = [p.detach().clone() for p in (*g.module.parameters(), *d.module.parameters())]
    del state, d_step, g_step, g, d  # free the reducers before the group goes
    return result


def test_ddp_with_two_models_equals_one_process_on_the_whole_batch() -> None:
    g, d = _nets()
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-2, betas=(0.5, 0.9))
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    d_step = clip(accumulate(make_train_step(d_loss, optimizer="D"), K), max_norm=1.0)
    g_step = clip(accumulate(make_train_step(g_loss, optimizer="G"), K), max_norm=0.5)
    for batch in _data(4, size=8):
        state, _ = d_step(state, batch)
        state, _ = g_step(state, batch)
    want = [p.detach() for p in (*g.parameters(), *d.parameters())]
    for got in run_ranks(_ddp_gan):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def _all_reduces_per_call(rank: int, world: int) -> list[tuple[str, list[str]]]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from steplib.distributed import apply_ddp

    g, d = _nets()
    g, d = apply_ddp(g), apply_ddp(d)
    seen: list[str] = []
    for name, model in (("G", g), ("D", d)):
        # Unannotated: DDP refuses a hook whose `bucket` annotation is not dist.GradBucket,
        # and this module's annotations are strings.
        def count(bucket_state, bucket, name=name):
            seen.append(name)
            return allreduce_hook(bucket_state, bucket)

        model.register_comm_hook(None, count)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    steps = {
        name: ddp_wrap(accumulate(make_train_step(loss, optimizer=name), K))
        for name, loss in (("D", d_loss), ("G", g_loss))
    }
    calls = []
    for batch in _data(2 * K, size=4):
        for name, step in steps.items():
            seen.clear()
            state, _ = step(state, batch)
            calls.append((name, list(seen)))
    del state, steps, g, d  # free the reducers before the group goes
    return calls


def test_ddp_all_reduces_each_model_once_per_update_not_in_its_no_sync_micro_batches() -> None:
    # g_loss runs D's DDP forward: D's reducer must not be armed by it, or D's next no_sync
    # micro-batch all-reduces (once more per micro-batch, and rounded otherwise than a resumed
    # run whose fresh reducer was never armed).
    want = [(name, [name] if (i + 1) % K == 0 else []) for i in range(2 * K) for name in ("D", "G")]
    for calls in run_ranks(_all_reduces_per_call):
        assert calls == want


def _d_loss_feeding_g(model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _, z = batch
    fake = model["G"](z)  # G's one forward of the batch, handed to G's step with its graph
    return d_loss(model, batch), {"fake": fake}


def _g_loss_fed(model: Any, fake: torch.Tensor) -> torch.Tensor:
    logits = model["D"](fake)
    return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def _fed_gan(g: nn.Module, d: nn.Module, data: list[Batch], wrap: Any) -> None:
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    state = TrainState.create(model={"G": g, "D": d}, optimizer={"G": opt_g, "D": opt_d})
    steps = {
        name: wrap(accumulate(make_train_step(loss, optimizer=name), K))
        for name, loss in (("D", _d_loss_feeding_g), ("G", _g_loss_fed))
    }
    run(steps, state, data, feed={"G": lambda batch, earlier: earlier["D"]["fake"]})


def _fed_gan_on_ranks(rank: int, world: int, *, norm: bool = False) -> list[torch.Tensor]:
    from steplib.distributed import apply_ddp

    g, d = _nets()
    if norm:  # running statistics of each rank's own data, which DDP broadcasts from rank 0
        assert isinstance(g, nn.Sequential)
        g.insert(1, nn.BatchNorm1d(8))
    g, d = apply_ddp(g), apply_ddp(d)
    half = slice(rank * 4, (rank + 1) * 4)
    _fed_gan(g, d, [(real[half], z[half]) for real, z in _data(2 * K, size=8)], ddp_wrap)
    result = [t.detach().clone() for t in (*g.parameters(), *d.parameters(), *g.buffers())]
    del g, d  # free the reducers before the group goes
    return result


def test_ddp_averages_a_generator_whose_forward_ran_in_the_critic_step() -> None:
    # feed: G's forward runs in D's step (where G is kept under no_sync), its backward in G's.
    g, d = _nets()
    _fed_gan(g, d, _data(2 * K, size=8), lambda step: step)
    want = [p.detach() for p in (*g.parameters(), *d.parameters())]
    first, second = run_ranks(_fed_gan_on_ranks)
    assert all(map(torch.equal, first, second))  # G's gradients were averaged over the ranks
    for a, b in zip(first, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_ddp_gives_a_fed_generator_the_buffers_of_rank_0_at_each_update() -> None:
    first, second = run_ranks(functools.partial(_fed_gan_on_ranks, norm=True))
    assert all(map(torch.equal, first, second))  # parameters, and BatchNorm's statistics


def _freeze_schedule_run(use_steplib: bool) -> list[torch.Tensor]:
    """Two named optimizers; the net's body frozen at the start, unfrozen after update 2, its
    head frozen after update 4: what is trained is decided at each update, as plain torch
    decides it."""
    torch.manual_seed(0)
    body, head, critic = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 1)
    net = nn.Sequential(body, nn.Tanh(), head)
    body.requires_grad_(False)
    opt_net = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt_critic = torch.optim.SGD(critic.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(6)
    ]

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model["net"](x), y)

    state = TrainState.create(
        model={"net": net, "critic": critic}, optimizer={"net": opt_net, "critic": opt_critic}
    )
    step = make_train_step(loss_fn, optimizer="net")
    for n, (x, y) in enumerate(batches):
        if n == 2:
            body.requires_grad_(True)
        if n == 4:
            head.requires_grad_(False)
        if use_steplib:
            state, _ = step(state, (x, y))
        else:
            F.mse_loss(net(x), y).backward()
            opt_net.step()
            opt_net.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in net.parameters()]


def test_what_is_trained_follows_requires_grad_at_each_update_as_in_plain_torch() -> None:
    plain = _freeze_schedule_run(use_steplib=False)
    mine = _freeze_schedule_run(use_steplib=True)
    for a, b in zip(mine, plain, strict=True):
        assert torch.equal(a, b)


def test_a_group_added_to_a_named_optimizer_later_trains_as_in_the_plain_loop() -> None:
    # Gradual unfreezing in a state of several optimizers: the body joins the student's
    # optimizer with add_param_group after two updates. The backward's inputs were the
    # optimizer's parameters as TrainState.create saw them: the body got no gradient and
    # never moved, in silence.
    def build() -> tuple[nn.Sequential, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        critic = nn.Linear(3, 1)
        student[0].requires_grad_(False)
        opt_s = torch.optim.AdamW(student[2].parameters(), lr=1e-2)
        return student, critic, opt_s, torch.optim.AdamW(critic.parameters(), lr=1e-2)

    def unfreeze(student: nn.Sequential, opt_s: torch.optim.Optimizer) -> None:
        student[0].requires_grad_(True)
        opt_s.add_param_group({"params": student[0].parameters(), "lr": 1e-3})

    def student_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model["S"](batch[0]), batch[1])

    def critic_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model["C"](model["S"](batch[0]).detach()).pow(2).mean()

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen))]
    batches *= 6
    student, critic, opt_s, opt_c = build()  # the plain loop
    model = nn.ModuleDict({"S": student, "C": critic})
    for i, batch in enumerate(batches):
        if i == 2:
            unfreeze(student, opt_s)
        for loss_fn, opt in ((critic_loss, opt_c), (student_loss, opt_s)):
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
    student_sl, critic_sl, opt_s, opt_c = build()
    body = [p.detach().clone() for p in student_sl[0].parameters()]
    state = TrainState.create(
        model={"S": student_sl, "C": critic_sl}, optimizer={"S": opt_s, "C": opt_c}
    )
    steps = [
        make_train_step(critic_loss, optimizer="C"),
        make_train_step(student_loss, optimizer="S"),
    ]
    for i, batch in enumerate(batches):
        if i == 2:
            unfreeze(student_sl, opt_s)
        for step in steps:
            state, _ = step(state, batch)
    assert not torch.equal(next(student_sl[0].parameters()), body[0])  # the body trained
    for got, want in zip(model.parameters(), state.model.parameters(), strict=True):
        assert torch.equal(got, want)

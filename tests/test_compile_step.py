"""compile_step: numerically equal to the eager step, recompilations counted, applied last.

What "equal to eager" can mean for a compiled step (measured for issue 3, torch 2.13, CPU):

* A compiled update computes the same formulas in another order (inductor fuses, and dynamo
  turns ``addcdiv_`` into a fused multiply-add): one update differs from eager by ~1e-8 in
  float32 and by ~1e-17 in float64. But torch's compiled AdamW (its documented recipe too)
  computes the bias corrections ``1 - beta ** step`` from the step counter tensor, float32 by
  default, where eager code reads it with ``.item()`` and works in double: 4e-7 from eager in
  float64 parameters after 200 updates, ~1e-6 in float32. compile_step widens the counter to
  float64, which brings both back to rounding (5e-17 and ~3e-8).
* Over many updates, the rounding differences stay at that level unless something amplifies
  them. ReLU does: a pre-activation within ~1e-7 of zero has its gate flipped by a rounding
  difference, the gradient of that sample changes by a finite amount, and Adam turns it into an
  lr-sized step (~1e-3 here). That is what the "AdamW drifts by 1e-4..1e-3" of the first
  version was (a gate flipped at update 20). A parameter whose true gradient is zero (a bias
  before BatchNorm, the key bias of attention) does the same: Adam normalises its rounding
  noise into lr-sized steps. Any two implementations that round differently diverge so.

So the tests check: in float64, compiled AdamW equals eager to 1e-12 after 200 updates (this
fails by 4e-7 with torch's float32 step counters and by ~1e-2 with an LR one update late); in
float32, 1e-5 after 200 updates on a smooth (tanh) MLP and, for SGD, on the ReLU MLP.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import steplib.step.compile.graphs as compile_module
from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    warmup_cosine,
)
from steplib.checkpoint import load, save
from steplib.step.compile import compile_stats, compile_step


def _mlp(activation: type[nn.Module] = nn.ReLU, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), activation(), nn.Linear(64, 1)).to(dtype)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _data(
    n: int, size: int = 32, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(size, 64, generator=gen, dtype=dtype),
            torch.randn(size, 1, generator=gen, dtype=dtype),
        )
        for _ in range(n)
    ]


def _train(
    step: Any,
    updates: int,
    batches: list[Any],
    *,
    optimizer: str = "sgd",
    activation: type[nn.Module] = nn.ReLU,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, list[torch.Tensor]]:
    model = _mlp(activation, dtype)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        foreach = True if optimizer == "adamw-foreach" else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=20, total=updates))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    losses = []
    for i in range(updates * 4):
        state, out = step(state, batches[i % len(batches)])
        if state.window.size == 0:
            losses.append(out.loss)
    return model, losses


def _max_diff(model: nn.Module, reference: nn.Module) -> float:
    return max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


def _eager() -> Any:
    return accumulate(clip(make_train_step(_loss), max_norm=1.0), 4)


def test_compiled_step_equals_eager_within_1e5_after_200_updates_without_recompiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = _data(16)
    eager_model, eager_losses = _train(_eager(), 200, batches)
    entries: list[Any] = []
    region_call = compile_module.Region.__call__

    def counted(self: Any, *args: Any) -> Any:
        entries.append(self)
        return region_call(self, *args)

    monkeypatch.setattr(compile_module.Region, "__call__", counted)
    compiled = compile_step(_eager())
    model, losses = _train(compiled, 200, batches)
    # The first update runs eagerly; each later one enters one graph per micro-batch and none
    # more: the closing micro-batch's graph holds phase 2 and the update.
    assert len(entries) == 199 * 4
    for got, want in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), atol=1e-5, rtol=1e-5)
    stats = compile_stats(compiled)
    # One graph per kind of micro-batch (first of a window, accumulating, closing with phase 2
    # and the update): no graph break anywhere. (With a cold inductor cache dynamo traces the update
    # twice: its first compile specialises the float64 LR it had traced as a symbolic float,
    # "Restarting analysis due to _tensorify_python_scalars"; the backend counts both.)
    assert stats.fused_backward is True
    assert stats.graphs in (3, 4)
    assert stats.recompiles == 0  # the LR changed on every update, as a tensor: no recompile
    assert stats.updates == 200


def test_compiled_adamw_in_float64_equals_eager_to_1e12_after_200_updates() -> None:
    batches = _data(16, dtype=torch.float64)
    kwargs: dict[str, Any] = {"optimizer": "adamw", "dtype": torch.float64}
    eager_model, _ = _train(_eager(), 200, batches, **kwargs)
    compiled = compile_step(_eager())
    model, _ = _train(compiled, 200, batches, **kwargs)
    assert _max_diff(model, eager_model) < 1e-12
    assert compile_stats(compiled).recompiles == 0


def test_torch_float32_step_counters_fail_the_float64_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the 1e-12 above guards against: torch's compiled AdamW as it is, with float32 step
    # counters (bias corrections in float32), is 1e-7..1e-6 away from eager.
    monkeypatch.setattr(compile_module, "_widens_counters", lambda group: False)
    batches = _data(16, dtype=torch.float64)
    kwargs: dict[str, Any] = {"optimizer": "adamw", "dtype": torch.float64}
    eager_model, _ = _train(_eager(), 50, batches, **kwargs)
    model, _ = _train(compile_step(_eager()), 50, batches, **kwargs)
    assert _max_diff(model, eager_model) > 1e-9


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach"])
def test_compiled_adamw_in_float32_is_within_1e5_of_eager_after_200_updates(optimizer: str) -> None:
    # tanh, not ReLU: a smooth model does not turn a rounding difference into a flipped gate
    # (see the module docstring); the float64 test above checks the update's arithmetic.
    # foreach=True: Adam's foreach update refuses the tensor LR compile_step gives it ("lr as
    # a Tensor is not supported for capturable=False and foreach=True", at the first compiled
    # update); the group is switched to the single-tensor update, as torch's default is.
    batches = _data(16)
    kwargs: dict[str, Any] = {"optimizer": optimizer, "activation": nn.Tanh}
    eager_model, eager_losses = _train(_eager(), 200, batches, **kwargs)
    compiled = compile_step(_eager())
    model, losses = _train(compiled, 200, batches, **kwargs)
    assert _max_diff(model, eager_model) < 1e-5
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), atol=1e-5, rtol=1e-5)
    assert compile_stats(compiled).recompiles == 0


def test_onecyclelr_cycling_adams_beta1_does_not_recompile() -> None:
    # OneCycleLR writes a new beta1 (a Python float) with every LR: compile_step keeps the
    # betas as float64 tensors, so each new value is an input of the graph, not a recompile.
    models, steps = [], []
    for compiled in (False, True):
        model = _mlp(nn.Tanh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
        state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
        step = compile_step(_eager()) if compiled else _eager()
        for batch in _data(16) * 10:  # 160 micro-batches: 40 updates
            state, _ = step(state, batch)
        models.append(model)
        steps.append(step)
    assert _max_diff(models[1], models[0]) < 1e-5
    stats = compile_stats(steps[1])
    assert (stats.graphs, stats.recompiles, stats.updates) == (3, 0, 40)


@pytest.mark.parametrize("saved_after", [40, 41], ids=["between-windows", "mid-window"])
def test_a_compiled_run_resumed_from_a_checkpoint_equals_the_uninterrupted_one(
    tmp_path: Path, saved_after: int
) -> None:
    # The optimizer of a resumed run holds its state already: its first update is compiled,
    # as the uninterrupted run's was at that point (an eager one differs by ~1e-8).
    def build() -> tuple[TrainState, Any]:
        model = _mlp(nn.Tanh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=3, total=20))
        state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
        return state, compile_step(_eager())

    batches = _data(16) * 5  # 80 micro-batches: 20 updates
    state, step = build()
    reference = []
    for batch in batches:
        state, out = step(state, batch)
        reference.append(out.loss)
    first, step = build()
    for batch in batches[:saved_after]:
        first, _ = step(first, batch)
    url = save(first, str(tmp_path))
    resumed, step = build()
    resumed = load(url, resumed)
    losses = []
    for batch in batches[saved_after:]:
        resumed, out = step(resumed, batch)
        losses.append(out.loss)
    assert torch.equal(torch.stack(losses), torch.stack(reference[saved_after:]))
    for got, want in zip(resumed.model.parameters(), state.model.parameters(), strict=True):
        assert torch.equal(got, want)
    assert compile_stats(step).updates == 20 - saved_after // 4


def _run_both(
    make_model: Any, loss_fn: Any, batches: list[Any], *, k: int = 2, backend: str = "aot_eager"
) -> tuple[nn.Module, nn.Module, Any, list[Any], list[Any]]:
    runs = []
    for compiled in (False, True):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = TrainState.create(model=model, optimizer=opt)
        step = accumulate(clip(make_train_step(loss_fn), max_norm=1.0), k)
        if compiled:
            step = compile_step(step, backend=backend)
        outs = []
        for batch in batches:
            state, out = step(state, batch)
            outs.append(out)
        runs.append((model, step, outs))
    (eager_model, _, eager_outs), (model, step, outs) = runs
    return eager_model, model, step, eager_outs, outs


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.embed(tokens)))
        return out


def _token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    tokens, targets = batch
    logits = model(tokens).flatten(0, 1)
    mask = (targets >= 0).flatten()
    losses = F.cross_entropy(logits, targets.clamp(min=0).flatten(), reduction="none")
    return (losses * mask).sum(), mask.sum(), {"tokens": mask.sum()}


def test_fused_backward_with_token_counts_aux_and_tied_weights_equals_eager() -> None:
    gen = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, 16, (4, 5), generator=gen), torch.randint(-1, 16, (4, 5), generator=gen))
        for _ in range(12)
    ]
    eager_model, model, step, eager_outs, outs = _run_both(_Tied, _token_loss, batches)
    assert compile_stats(step).fused_backward is True
    for got, want in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for out, eager_out in zip(outs, eager_outs, strict=True):
        torch.testing.assert_close(out.num_targets, eager_out.num_targets)
        torch.testing.assert_close(out.aux["tokens"], eager_out.aux["tokens"])
        torch.testing.assert_close(out.loss, eager_out.loss, atol=1e-6, rtol=1e-6)


def test_a_python_int_target_count_is_carried_out_of_the_graph() -> None:
    def sum_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        x, y = batch
        return F.mse_loss(model(x), y, reduction="sum"), len(x)

    eager_model, model, step, eager_outs, outs = _run_both(
        lambda: _mlp(nn.Tanh), sum_loss, _data(8, size=5)
    )
    assert compile_stats(step).fused_backward is True
    assert [out.num_targets for out in outs] == [out.num_targets for out in eager_outs]
    assert _max_diff(model, eager_model) < 1e-6


def test_a_batchnorm_model_falls_back_to_autograd_and_says_why() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    eager_model, model, step, _, _ = _run_both(make, _loss, _data(8))
    stats = compile_stats(step)
    assert stats.fused_backward is False
    assert stats.why_not_fused  # the in-place update of the running statistics
    assert _max_diff(model, eager_model) < 1e-6
    for got, want in zip(model.buffers(), eager_model.buffers(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_parameter_without_gradient_keeps_the_autograd_path() -> None:
    # The fused graph would give the unused layer a zero gradient where autograd leaves None
    # (and AdamW would then decay it): it is used only when every parameter got a gradient.
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = nn.Linear(64, 1), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.used(x)
            return out

    eager_model, model, step, _, _ = _run_both(Unused, _loss, _data(8))
    assert compile_stats(step).fused_backward is False
    assert model.get_submodule("unused").weight.grad is None
    assert _max_diff(model, eager_model) < 1e-6


def test_a_layer_frozen_after_warm_up_stops_training_as_in_eager() -> None:
    # Freezing after the fused graph was planned (fine-tuning's requires_grad_(False)): the
    # fused graph differentiates with respect to every parameter it was planned with, so the
    # frozen layer went on training (it moved by ~0.06 here) where autograd gives it no
    # gradient and the optimizer skips it.
    batches = _data(12)
    runs = []
    for compiled in (False, True):
        model = _mlp(nn.Tanh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = TrainState.create(model=model, optimizer=opt)
        step = accumulate(make_train_step(_loss), 2)
        if compiled:
            step = compile_step(step, backend="aot_eager")
        for i, batch in enumerate(batches):
            if i == 6:  # after three updates: the fused plan is in use
                model.get_submodule("0").requires_grad_(False)
                frozen = [p.detach().clone() for p in model.get_submodule("0").parameters()]
            state, _ = step(state, batch)
        for got, want in zip(model.get_submodule("0").parameters(), frozen, strict=True):
            assert torch.equal(got, want)
        runs.append(model)
    eager_model, model = runs
    assert _max_diff(model, eager_model) < 1e-6


def test_a_layer_added_to_the_optimizer_after_warm_up_trains_as_in_eager() -> None:
    # Gradual unfreezing: the backbone joins the optimizer with add_param_group. The fused graph
    # made before differentiated only the head, so the backbone never moved; and the new
    # group's LR stayed a float and its Adam step counters float32 (the module doc says why
    # both are widened).
    batches = _data(5)
    runs = []
    for compiled in (False, True):
        model = _mlp(nn.Tanh)
        backbone, head = model.get_submodule("0"), model.get_submodule("2")
        backbone.requires_grad_(False)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.01)
        step = accumulate(make_train_step(_loss), 2)
        if compiled:
            step = compile_step(step, backend="aot_eager")
        state = TrainState.create(model=model, optimizer=opt)
        for i in range(24):
            if i == 8:  # after four updates: the fused plan is in use
                backbone.requires_grad_(True)
                opt.add_param_group({"params": backbone.parameters(), "lr": 5e-3})
                before = [p.detach().clone() for p in backbone.parameters()]
            state, _ = step(state, batches[i % len(batches)])
        moved = [
            float((p.detach() - b).abs().max())
            for p, b in zip(backbone.parameters(), before, strict=True)
        ]
        assert min(moved) > 1e-3
        runs.append(model)
    eager_model, model = runs
    assert _max_diff(model, eager_model) < 1e-6
    added = opt.param_groups[1]
    assert isinstance(added["lr"], torch.Tensor)
    assert all(opt.state[p]["step"].dtype == torch.float64 for p in added["params"])


def test_gradient_hooks_on_parameters_run_as_in_eager() -> None:
    # The fused graph differentiates detached copies of the parameters, so autograd's hooks on
    # them never ran: a gradient mask (pruning) let the masked weights train (by ~0.1), and a
    # post-accumulate hook was called once (the eager first update) instead of each time.
    batches = _data(6)
    runs = []
    for compiled in (False, True):
        model = _mlp(nn.Tanh)
        first = model.get_submodule("0")
        assert isinstance(first, nn.Linear)
        mask = torch.rand(first.weight.shape, generator=torch.Generator().manual_seed(3)) > 0.5
        calls: list[int] = []
        last = model.get_submodule("2")
        assert isinstance(last, nn.Linear)
        last.weight.register_post_accumulate_grad_hook(lambda p, calls=calls: calls.append(1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: a masked entry stays
        step = accumulate(make_train_step(_loss), 2)
        if compiled:
            step = compile_step(step, backend="aot_eager")
        state = TrainState.create(model=model, optimizer=opt)
        for i in range(12):
            if i == 4:  # after two updates: the fused plan is in use
                first.weight.register_hook(lambda g, mask=mask: g * mask)
                before = first.weight.detach().clone()
            state, _ = step(state, batches[i % len(batches)])
        assert torch.equal(first.weight.detach()[~mask], before[~mask])
        assert len(calls) == 12
        runs.append(model)
    eager_model, model = runs
    assert _max_diff(model, eager_model) < 1e-6


def test_a_shorter_last_window_matches_eager_without_recompiling() -> None:
    batches = _data(14)
    runs = []
    for compiled in (False, True):
        model = _mlp(nn.Tanh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = TrainState.create(model=model, optimizer=opt)
        step = accumulate(clip(make_train_step(_loss), max_norm=1.0), 4)
        if compiled:
            step = compile_step(step, backend="aot_eager")
        for i, batch in enumerate(batches):  # 3 windows of 4, then one of 2
            state, out = step(state, batch, close_window=i == len(batches) - 1)
        assert state.step == 4 and bool(out.did_update)
        runs.append((model, step))
    (eager_model, _), (model, step) = runs
    assert _max_diff(model, eager_model) < 1e-6
    assert compile_stats(step).recompiles == 0


def test_a_new_input_shape_after_warm_up_is_counted_as_a_recompile() -> None:
    step = compile_step(make_train_step(_loss), backend="aot_eager", dynamic=False)
    model = _mlp()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in _data(4):
        state, _ = step(state, batch)
    assert compile_stats(step).warm and compile_stats(step).recompiles == 0
    state, _ = step(state, _data(1, size=7)[0])
    assert compile_stats(step).recompiles >= 1


def test_a_trace_that_dynamo_restarts_counts_as_one_graph() -> None:
    # Dynamo may discard a finished trace and compile the same frame again (it did once per
    # process for the transformer's closing graph, over a float64 LR): one graph, not two.
    from torch._guards import CompileContext, CompileId, compile_context

    stats = compile_module.CompileStats()
    region: Any = types.SimpleNamespace(stats=stats, ran=False)  # what the backend reads
    backend = compile_module._CountingBackend(lambda graph, inputs: "compiled", region)
    graph = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))):
        assert backend(graph, []) == "compiled"
        backend(graph, [])  # the restarted trace of the same frame compile
    assert (stats.graphs, stats.recompiles) == (1, 0)
    region.ran = True
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=1))):
        backend(graph, [])  # a guard failed: a new compile of the same frame
    assert (stats.graphs, stats.recompiles) == (2, 1)


def test_wrapping_after_compile_step_is_refused_with_the_fix() -> None:
    compiled = compile_step(make_train_step(_loss), backend="aot_eager")
    with pytest.raises(ConfigError, match=r"Apply compile_step last: compile_step\(clip"):
        clip(compiled, max_norm=1.0)


def test_unknown_compile_argument_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"torch\.compile does not take"):
        compile_step(make_train_step(_loss), fullgrahp=True)


def test_mode_and_options_together_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"both mode= and options="):
        compile_step(make_train_step(_loss), mode="default", options={"cpp_wrapper": True})


def test_compiled_skips_decided_on_the_device_match_eager() -> None:
    """skip_nonfinite with a fused optimizer and a LambdaLR (the device-decided skip of
    ``steplib.step.device_skips``) compiled: the same skips, schedule and parameters as eager."""
    from steplib import skip_nonfinite

    torch.manual_seed(0)
    xs = [torch.randn(8, 4) for _ in range(12)]
    xs[5] = xs[5] * float("inf")  # the third window is skipped

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    results = []
    for compiled in (False, True):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
        state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
        step = skip_nonfinite(clip(accumulate(make_train_step(loss_fn), 2), max_norm=1.0))
        if compiled:
            step = compile_step(step)
        for x in xs:
            state, _ = step(state, x)
        results.append((state, [p.detach().clone() for p in model.parameters()]))
    (eager, eager_params), (comp, comp_params) = results
    assert compile_stats(step).graphs > 0 and compile_stats(step).recompiles == 0
    assert int(eager.skipped_updates) == int(comp.skipped_updates) == 1
    assert eager.scheduler.last_epoch == comp.scheduler.last_epoch == 5  # type: ignore[union-attr]
    for a, b in zip(eager_params, comp_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_inductor_size_asserts_are_off_unless_options_set_them() -> None:
    # dynamo's guards already check every input's sizes and strides; the asserts repeated it
    # in the generated code on every call (~8% of the tiny MLP's compiled update).
    default = compile_step(_eager())
    assert default.plan.runner.inner.config["size_asserts"] is False
    with_mode = compile_step(_eager(), mode="max-autotune-no-cudagraphs")
    assert with_mode.plan.runner.inner.config["size_asserts"] is False
    kept = compile_step(_eager(), options={"size_asserts": True})
    assert kept.plan.runner.inner.config["size_asserts"] is True


def test_a_fresh_scheduler_over_an_optimizer_with_state_sees_its_first_update_run() -> None:
    # Fine-tuning from a loaded optimizer with a new schedule: torch's scheduler checks at its
    # first step that the optimizer's own step() ran (it warns otherwise, an error here).
    torch.manual_seed(0)
    model = _mlp()
    warm = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _data(1)[0]
    _loss(model, batch).backward()
    warm.step()
    model.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(warm.state_dict())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=2, total=8))
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched)
    step = compile_step(make_train_step(_loss))
    for batch in _data(3):
        state, _ = step(state, batch)
    assert sched.last_epoch == 3


def test_under_cuda_graphs_no_optimizer_is_traced_and_eager_numbers_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # mode="reduce-overhead" on an H100: dynamo asserted while tracing the optimizer once CUDA
    # graph trees ran, and a gradient kept from a graph's output was overwritten by the next
    # replay (a segfault). The update runs eagerly there; on a CPU the same code path runs.
    batches = _data(16)
    eager_model, _ = _train(_eager(), 30, batches, optimizer="adamw")
    entered: set[str] = set()
    region_call = compile_module.Region.__call__

    def named(self: Any, *args: Any) -> Any:
        entered.add(self.fn.__wrapped__.__name__)
        return region_call(self, *args)

    monkeypatch.setattr(compile_module.Region, "__call__", named)
    compiled = compile_step(_eager(), mode="reduce-overhead")
    model, _ = _train(compiled, 30, batches, optimizer="adamw")
    assert entered == {"micro_first", "process_grads"}  # no update, no graph adding to inputs
    # The forward/backward is captured; phase 2, which scales the gradients in place (what
    # CUDA graphs never capture: inductor warned at every compile), is compiled without.
    runner = compiled.plan.runner
    assert runner.micro_first.copies_outputs and not runner.compiled_process.copies_outputs
    assert _max_diff(model, eager_model) < 1e-5
    assert compile_stats(compiled).updates == 30


def test_a_cuda_graph_backend_s_outputs_are_copies_the_next_replay_cannot_overwrite() -> None:
    class CudaGraphBackend:  # what inductor's wrapper says in mode="reduce-overhead"
        def __init__(self) -> None:
            self.config = {"triton.cudagraphs": True}

        def __call__(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            return graph.forward

    stats = compile_module.CompileStats()
    region = compile_module.Region(
        lambda x: x.view(-1), CudaGraphBackend(), stats, {}, guard_filter=None
    )
    x = torch.ones(2, 2)
    out = region(x)
    assert torch.equal(out, x.view(-1))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_under_autocast_emulate_precision_casts_makes_inductor_round_as_eager(dtype) -> None:
    # Under autocast inductor keeps a fused chain's intermediates in float32 where eager rounds
    # each op's output to float16 / bfloat16: without the option the two drifted 1e-5..5e-4
    # apart in 12 updates of a tiny MLP, not the ~1e-8 of float32 (docs/performance.md). With
    # it the compiled step rounds as eager does.
    params = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if dtype == torch.float16 else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
        step = accumulate(clip(amp_wrap(make_train_step(_loss), dtype=dtype), max_norm=1.0), 2)
        if compiled:
            step = compile_step(step, options={"emulate_precision_casts": True})
        gen = torch.Generator().manual_seed(1)
        for _ in range(16):
            state, _ = step(
                state, (torch.randn(6, 8, generator=gen), torch.randn(6, 1, generator=gen))
            )
        params.append(list(model.parameters()))
    for got, want in zip(*params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)

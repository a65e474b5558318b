"""Pipeline parallelism: a 2-stage pipeline on 2 CPU processes (gloo) trains like one process
on the whole model (float64, within 1e-6) with GPipe and with 1F1B, with ``clip`` over the
norm of both stages, through ``run`` and its events, and resumes from per-stage checkpoints
exactly; so do 4 stages interleaved over the 2 processes (two each). A split that does not fit
the model or the processes is refused at build time."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import (
    ConfigError,
    Events,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    ddp_wrap,
    run,
    skip_nonfinite,
    tap,
)
from steplib.checkpoint import load, save
from steplib.distributed.pipeline_split import split_model
from steplib.step.pipeline import make_pipeline_step, pipeline_stage
from steplib.testing import assert_no_host_sync, run_ranks

CLASSES = 3
MICRO = 4  # micro-batches per batch
ROWS = 8  # rows per batch: 2 per micro-batch


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)
    ).double()


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        x = torch.randn(ROWS, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (ROWS,), generator=gen)
        y[torch.rand(ROWS, generator=gen) < 0.3] = -100  # unequal targets per micro-batch
        y[0] = 0
        batches.append((x, y))
    return batches


def _loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss_sum = F.cross_entropy(output, target, reduction="sum", ignore_index=-100)
    return loss_sum, (target != -100).sum()


def _build(schedule: str, seed: int = 0, hooks: list[str] | None = None) -> tuple[Any, TrainState]:
    stages = split_model(_model(seed), split_points=["2"])
    pipe = make_pipeline_step(_loss, stages, n_microbatches=MICRO, schedule=schedule)
    calls = hooks if hooks is not None else []
    step = tap(
        skip_nonfinite(clip(pipe, max_norm=0.5)),
        after_backward=lambda state: calls.append("after_backward"),
        before_update=lambda state: calls.append("before_update"),
    )
    opt = torch.optim.SGD(pipeline_stage(pipe).module.parameters(), lr=0.1, momentum=0.9)
    return step, TrainState.create(model=pipeline_stage(pipe).module, optimizer=opt)


def _train(rank: int, world: int, *, schedule: str, root: str) -> dict[str, Any]:
    data = _batches()
    hooks: list[str] = []
    step, state = _build(schedule, hooks=hooks)
    seen: list[tuple[float, float]] = []
    events = Events().on(
        "step_end", lambda e: seen.append((e.output.loss.item(), e.output.grad_norm.item()))
    )
    state = run(step, state, data[:2], events=events)  # one epoch of 2 batches
    url = save(
        state, f"{root}/stage-{pipeline_stage(step).stage_index}", step=step
    )  # each stage its own part
    for batch in data[2:]:
        state, out = step(state, batch)
        seen.append((out.loss.item(), out.grad_norm.item()))
    params = {k: v.detach().clone() for k, v in pipeline_stage(step).module.state_dict().items()}

    # Resume from the checkpoint into freshly built (differently initialised) stages.
    resumed_step, resumed = _build(schedule, seed=7)
    resumed = load(url, resumed, step=resumed_step)
    for batch in data[2:]:
        resumed, _ = resumed_step(resumed, batch)
    resumed_params = {
        k: v.detach().clone() for k, v in pipeline_stage(resumed_step).module.state_dict().items()
    }
    return {
        "params": params,
        "resumed": resumed_params,
        "seen": seen,
        "step": state.step,
        "epoch": state.epoch,
        "hooks": hooks,
    }


def _reference(
    model: nn.Module | None = None, *, max_norm: float = 0.5
) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    model = model or _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for x, y in _batches():
        loss_sum, count = _loss(model(x), y)
        loss = loss_sum / count
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        seen.append((loss.item(), norm.item()))
    return model.state_dict(), seen


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_two_stages_equal_one_process_and_resume_exactly(
    schedule: str, tmp_path: Path
) -> None:
    first, second = run_ranks(functools.partial(_train, schedule=schedule, root=str(tmp_path)))
    want, want_seen = _reference()

    assert set(first["params"]) == {"0.weight", "0.bias"}  # children 0, 1
    assert set(second["params"]) == {"2.weight", "2.bias", "4.weight", "4.bias"}  # 2, 3, 4
    got = {**first["params"], **second["params"]}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-6)
    for result in (first, second):
        # Both stages report the whole model's loss and norm (the first stage has no loss).
        for (loss, norm), (want_loss, want_norm) in zip(result["seen"], want_seen, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-6)  # float32 window loss
            assert norm == pytest.approx(want_norm, rel=1e-9)
        assert (result["step"], result["epoch"]) == (4, 1)
        assert result["hooks"] == ["after_backward", "before_update"] * 4
        for name, value in result["params"].items():
            assert torch.equal(result["resumed"][name], value), name  # bit for bit
    assert min(norm for _, norm in want_seen) > 0.5  # the clip did clip


def _three_arguments(model: Any, x: Any, y: Any) -> Any:
    return x


def _bad_input(rank: int, world: int) -> list[str]:
    stages = split_model(_model(), split_points=["2"])
    three = split_model(_model(), split_points=["2", "4"])
    mine_only = [s if i == rank else None for i, s in enumerate(stages)]
    attempts = {
        "three stages": lambda: make_pipeline_step(_loss, three, n_microbatches=MICRO),
        "missing": lambda: make_pipeline_step(_loss, [mine_only[0], None], n_microbatches=MICRO),
        "schedule": lambda: make_pipeline_step(
            _loss, stages, n_microbatches=MICRO, schedule="zigzag"
        ),
        "1f1b": lambda: make_pipeline_step(_loss, stages, n_microbatches=1),
        "loss arity": lambda: make_pipeline_step(
            _three_arguments,  # type: ignore[arg-type]
            stages,
            n_microbatches=MICRO,
        ),
    }
    messages = []
    for attempt in attempts.values():
        try:
            attempt()
        except ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    step = make_pipeline_step(_loss, stages, n_microbatches=MICRO)
    for wrap in (
        lambda: accumulate(step, 2),
        lambda: amp_wrap(step, dtype=torch.bfloat16),
        lambda: ddp_wrap(step),
        lambda: tap(step, before_backward=print),
    ):
        try:
            wrap()
        except ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    opt = torch.optim.SGD(pipeline_stage(step).module.parameters(), lr=0.1)
    state = TrainState.create(model=pipeline_stage(step).module, optimizer=opt)
    x, y = _batches(1)[0]
    state, _ = step(state, (x, y))
    for batch in ((x[:6], y[:6]), (x[:4], y[:4]), x):
        try:
            step(state, batch)
        except ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_pipeline_bad_input_is_refused_at_build_time_on_every_rank() -> None:
    for rank, messages in enumerate(run_ranks(_bad_input)):
        (three, missing, schedule, one_f1b, arity, acc, amp, ddp, hook, rows, shape, pair) = (
            messages
        )
        assert "3 stages for a pipeline group of 2 processes" in three
        assert "stages[1]" in missing and (rank == 1 or "rank 1:" in missing)
        assert "'zigzag'" in schedule and "['gpipe', '1f1b', 'interleaved-1f1b'," in schedule
        assert "n_microbatches >= 2" in one_f1b
        assert "loss_fn(output, target)" in arity
        assert "n_microbatches" in acc and "accumulate" in acc
        assert "amp_wrap" in amp and "autocast" in amp
        assert "ddp_wrap cannot wrap a pipeline step" in ddp and "2-D" in ddp
        assert "before_backward" in hook and "after_backward" in hook
        assert "6 rows" in rows and "divisible by 4" in rows
        assert "the first had" in shape and "drop_last=True" in shape
        assert "inputs_and_target" in pair


def _tied(rank: int, world: int) -> list[str]:
    # Layer 4's weight is layer 0's. Split apart, each process would train its own copy from
    # its stage's share of the gradient (0.12 from the one-process run after 4 updates, when it
    # was accepted). Four stages on two processes may share it: stages 0 and 2 are rank 0's.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) if i % 2 == 0 else nn.Tanh() for i in range(6)))
    model.append(nn.Linear(8, CLASSES))
    model[4].weight = model[0].weight
    messages = []
    for points, schedule in ((["2"], "gpipe"), (["2", "4", "6"], "interleaved-1f1b")):
        stages = split_model(model, split_points=points)
        try:
            make_pipeline_step(_loss, stages, n_microbatches=MICRO, schedule=schedule)
        except ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_a_weight_tied_across_processes_is_refused_on_every_rank() -> None:
    for across, same_process in run_ranks(_tied):
        assert "stage 0's parameter '0.weight' is also stage 1's '4.weight'" in across
        assert "processes (0 and 1)" in across and "untie it" in across
        assert same_process == "no error"  # stages 0 and 2 are both rank 0's


def test_split_model_refuses_a_split_that_does_not_match_the_model() -> None:
    model = _model()
    with pytest.raises(ConfigError, match=r"'9' is not a child.*\['0', '1', '2', '3', '4'\]"):
        split_model(model, split_points=["9"])
    with pytest.raises(ConfigError, match="nested names"):
        split_model(model, split_points=["2.weight"])
    with pytest.raises(ConfigError, match="increasing and after the first child"):
        split_model(model, split_points=["3", "2"])
    with pytest.raises(ConfigError, match="increasing and after the first child"):
        split_model(model, split_points=["0"])
    with pytest.raises(ConfigError, match="single stage"):
        split_model(model, split_points=[])
    with pytest.raises(ConfigError, match="list of child names"):
        split_model(model, split_points="2")
    with pytest.raises(ConfigError, match=r"not an nn\.Sequential"):
        split_model(nn.Linear(2, 2), split_points=["weight"])


def test_split_stages_chain_to_the_model() -> None:
    model = _model()
    stages = split_model(model, split_points=["2", "4"])
    x = _batches(1)[0][0]
    assert torch.equal(stages[2](stages[1](stages[0](x))), model(x))
    assert [len(s) for s in stages] == [2, 2, 1]


def test_make_pipeline_step_without_a_process_group_says_what_to_call() -> None:
    with pytest.raises(ConfigError, match="init_distributed"):
        make_pipeline_step(_loss, split_model(_model(), split_points=["2"]), n_microbatches=2)


def _default_float64(rank: int, world: int) -> list[float]:
    # Every tensor made without a dtype is float64: the stages' window sums must still travel
    # in one dtype (a float32 count on the last stage against float64 elsewhere aborted gloo).
    torch.set_default_dtype(torch.float64)
    try:
        stages = split_model(_model(), split_points=["2"])
        step = clip(make_pipeline_step(_loss, stages, n_microbatches=MICRO), max_norm=0.5)
        module = pipeline_stage(step).module
        state = TrainState.create(model=module, optimizer=torch.optim.SGD(module.parameters()))
        losses = []
        for batch in _batches(2):
            state, out = step(state, batch)
            losses.append(out.loss.item())
        return losses
    finally:
        torch.set_default_dtype(torch.float32)


def test_pipeline_trains_under_a_float64_default_dtype() -> None:
    first, second = run_ranks(_default_float64)
    assert first == second and all(loss > 0 for loss in first)  # every stage reports the loss


INTERLEAVED = ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")


def _deep_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, CLASSES)).double()


def _chunks(seed: int = 0) -> list[nn.Sequential]:
    return split_model(_deep_model(seed), split_points=["2", "4", "6"])  # 4 stages


def _state(pipe: Any) -> TrainState:
    module = pipeline_stage(pipe).module
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return TrainState.create(model=module, optimizer=opt)


def _build_interleaved(schedule: str, seed: int = 0) -> tuple[Any, TrainState]:
    pipe = make_pipeline_step(_loss, _chunks(seed), n_microbatches=MICRO, schedule=schedule)
    return skip_nonfinite(clip(pipe, max_norm=0.3)), _state(pipe)


def _refused(stages: list[Any], n_microbatches: int, schedule: str) -> str:
    try:
        make_pipeline_step(_loss, stages, n_microbatches=n_microbatches, schedule=schedule)
    except ConfigError as error:
        return str(error)
    return "no error"


def _record(seen: list[tuple[float, float]], event: Any) -> None:
    seen.append((event.output.loss.item(), event.output.grad_norm.item()))


def _interleaved(rank: int, world: int, *, root: str) -> dict[str, Any]:
    data = _batches()
    results: dict[str, Any] = {}
    for schedule in INTERLEAVED:
        step, state = _build_interleaved(schedule)
        seen: list[tuple[float, float]] = []
        events = Events().on("step_end", functools.partial(_record, seen))
        state = run(step, state, data[:2], events=events)
        url = save(state, f"{root}/{schedule}/stage-{pipeline_stage(step).stage_index}", step=step)
        for batch in data[2:]:
            state, out = step(state, batch)
            seen.append((out.loss.item(), out.grad_norm.item()))
        results[schedule] = {
            "params": {k: v.clone() for k, v in state.model.state_dict().items()},
            "seen": seen,
            "stages": pipeline_stage(step).stage_indices,
        }
    # The last schedule's checkpoint (both stages of this process) into fresh stages.
    resumed_step, resumed = _build_interleaved(INTERLEAVED[-1], seed=7)
    resumed = load(url, resumed, step=resumed_step)
    for batch in data[2:]:
        resumed, _ = resumed_step(resumed, batch)
    results["resumed"] = {k: v.clone() for k, v in resumed.model.state_dict().items()}
    # Law 8 after the first call (where torch's shape inference reads on the host); without
    # skip_nonfinite, which reads its decision on the host by design.
    pipe = make_pipeline_step(_loss, _chunks(), n_microbatches=MICRO, schedule=INTERLEAVED[0])
    state, _ = clip(pipe, max_norm=0.3)(_state(pipe), data[0])
    assert_no_host_sync(clip(pipe, max_norm=0.3), state, data[1:2])
    # An interleaved schedule with one stage per process: the module is the stage itself.
    two = split_model(_model(), split_points=["2"])
    pipe = make_pipeline_step(_loss, two, n_microbatches=MICRO, schedule="interleaved-1f1b")
    module = pipeline_stage(pipe).module
    results["one each"] = (type(module).__name__, pipe(_state(pipe), data[0])[1].loss.item())
    three = split_model(_deep_model(), split_points=["2", "4"])
    layouts: list[tuple[list[Any], int, str]] = [
        (three, 4, "looped-bfs"),
        (_chunks(), 4, "1f1b"),
        (_chunks(), 5, "interleaved-1f1b"),
        ([*_chunks()[:3], None], 4, "looped-bfs"),  # rank 1's second stage missing
    ]
    results["refused"] = [_refused(stages, n, schedule) for stages, n, schedule in layouts]
    return results


def test_pipeline_four_stages_on_two_processes_equal_one_process(tmp_path: Path) -> None:
    # Not bit for bit: each micro-batch's gradient is its own backward, summed into .grad,
    # where the reference's one backward sums the rows inside each matmul (float64: ~1e-16).
    first, second = run_ranks(functools.partial(_interleaved, root=str(tmp_path)))
    want, want_seen = _reference(_deep_model(), max_norm=0.3)
    for schedule in INTERLEAVED:
        mine, theirs = first[schedule], second[schedule]
        assert (mine["stages"], theirs["stages"]) == ((0, 2), (1, 3))  # placed in a loop
        # Keyed by stage index in the ModuleDict, then by the model's own names.
        assert set(mine["params"]) == {"0.0.weight", "0.0.bias", "2.4.weight", "2.4.bias"}
        assert set(theirs["params"]) == {"1.2.weight", "1.2.bias", "3.6.weight", "3.6.bias"}
        got = {k.split(".", 1)[1]: v for k, v in {**mine["params"], **theirs["params"]}.items()}
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-6, msg=schedule)
        for result in (mine, theirs):  # the whole model's loss and norm on every process
            for (loss, norm), (want_loss, want_norm) in zip(result["seen"], want_seen, strict=True):
                assert loss == pytest.approx(want_loss, rel=1e-6)
                assert norm == pytest.approx(want_norm, rel=1e-9)
    assert min(norm for _, norm in want_seen) > 0.3  # the clip did clip
    for result in (first, second):
        final = result[INTERLEAVED[-1]]["params"]
        assert set(result["resumed"]) == set(final)
        for name, value in final.items():
            assert torch.equal(result["resumed"][name], value), name  # bit for bit
    one_loss = _reference()[1][0][0]
    assert first["one each"] == second["one each"] == ("Sequential", pytest.approx(one_loss))
    for rank, result in enumerate((first, second)):
        three, single, rounds, missing = result["refused"]
        assert "3 stages for a pipeline group of 2 processes" in three
        assert "schedule='interleaved-1f1b'" in three
        assert "schedule='1f1b') runs one stage per process" in single
        assert "'interleaved-1f1b'" in single
        assert "n_microbatches=5" in rounds and "is not a multiple of 2" in rounds
        assert "n_microbatches=4" in rounds
        assert "stages[3]" in missing and (rank == 1 or "rank 1:" in missing)


def _three_d(rank: int, world: int) -> dict[str, Any]:
    """nn.Linear stages on a 3-D input (their outputs are views), under two schedules."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, 4, generator=gen), torch.randn(8, 3, 4, generator=gen)
    found: dict[str, Any] = {}
    for schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        torch.manual_seed(0)
        chunks = [nn.Sequential(nn.Linear(4, 4)) for _ in range(4)]
        pipe = make_pipeline_step(
            lambda out, target: (F.mse_loss(out, target, reduction="sum"), target.numel()),
            chunks,
            n_microbatches=MICRO,
            schedule=schedule,
        )
        module = pipeline_stage(pipe).module
        state = TrainState.create(model=module, optimizer=torch.optim.SGD(module.parameters()))
        losses = []
        for _ in range(2):
            state, out = pipe(state, (x, y))
            losses.append(out.loss.item())
        found[schedule] = (losses, {k: v.clone() for k, v in module.state_dict().items()})
    return found


def test_the_zero_bubble_schedule_takes_stages_whose_outputs_are_views() -> None:
    # Before: torch's split backward raised "Can't detach views in-place" (pytorch#142229).
    for result in run_ranks(_three_d):
        (want_losses, want), (losses, got) = result.values()
        assert losses == pytest.approx(want_losses, rel=1e-6)
        assert set(got) == set(want)  # the hook changes no parameter name
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-6)


def _loss_with_aux(output: torch.Tensor, target: torch.Tensor) -> Any:
    kept = target != -100
    right = ((output.argmax(-1) == target) & kept).double().sum()
    return (*_loss(output, target), {"right": right, "count": kept.sum()})


def _aux_on_every_stage(rank: int, world: int) -> dict[str, Any]:
    from steplib.handlers import TrainMetrics

    stages = split_model(_model(), split_points=["2"])
    pipe = make_pipeline_step(_loss_with_aux, stages, n_microbatches=MICRO, schedule="gpipe")
    state = _state(pipe)
    metrics = TrainMetrics()
    events = metrics.attach(Events())
    aux: list[dict[str, torch.Tensor]] = []
    events.on("step_end", lambda e: aux.append({k: v.clone() for k, v in e.output.aux.items()}))
    run(pipe, state, _batches(), events=events)
    return {"aux": aux, "record": metrics.read(None)}  # a Log reads on every rank


def test_every_stage_reports_the_last_stages_aux_values_and_train_metrics_reads_them() -> None:
    # Only the last stage held them: rank 0 (which logs) reported none, and TrainMetrics'
    # read all-reduced its aux sums on rank 1 alone, where rank 0 had none to reduce (a hang).
    first, last = run_ranks(_aux_on_every_stage, timeout=60)
    assert [sorted(a) for a in first["aux"]] == [["count", "right"]] * 4
    for mine, theirs in zip(first["aux"], last["aux"], strict=True):
        assert all(
            torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine
        )
    model = _model()  # the reference: one process, the same updates
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    right = []
    for x, y in _batches():
        with torch.no_grad():
            micro = [
                _loss_with_aux(model(a), b)[2]["right"]
                for a, b in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)
            ]
        right.append(torch.stack(micro).mean())
        loss_sum, count = _loss(model(x), y)
        (loss_sum / count).backward()
        opt.step()
        opt.zero_grad()
    for result in (first, last):
        assert result["record"]["right"] == pytest.approx(torch.stack(right).mean().item())

"""The same laws on CUDA (skipped without a GPU; the CPU path is tested everywhere else)."""

from __future__ import annotations

import pytest
import torch

from steplib import (
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    skip_nonfinite,
)
from steplib.errors import TooManySkipsError
from tests.reference import (
    concat,
    make_batches,
    mean_loss,
    reference_loop,
    tiny_model,
    token_loss,
)

pytestmark = pytest.mark.gpu


def _cuda(batches):
    return [tuple(t.cuda() for t in b) for b in batches]


def test_gpu_step_runs_without_a_host_sync_and_leaves_data_where_it_was() -> None:
    model = tiny_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    state = TrainState.create(model=model, optimizer=opt)
    step = amp_wrap(clip(accumulate(make_train_step(token_loss), 2), max_norm=1.0))
    batches = _cuda(make_batches(4))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            state, out = step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.loss.device.type == "cuda" and out.num_targets.device.type == "cuda"
    assert state.step == 2


def test_gpu_accumulation_equals_concatenated_batch() -> None:
    micro = _cuda(make_batches(3, [2, 5, 1]))
    model = tiny_model(0).cuda()
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(token_loss), 3)
    for batch in micro:
        state, _ = step(state, batch)
    ref = tiny_model(0).cuda()
    reference_loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [concat(micro)], token_loss)
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_gpu_skips_decided_on_the_device_make_no_host_sync() -> None:
    model = tiny_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    step = make_train_step(token_loss)
    step = skip_nonfinite(amp_wrap(clip(step, max_norm=1.0), dtype=torch.float16))
    batches = _cuda(make_batches(6))
    x, y, mask = batches[2]
    batches[2] = (x * float("inf"), y, mask)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            state, _ = step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # every position copy has landed: the next update sets the last one
    state, _ = step(state, batches[0])
    assert int(state.skipped_updates) == 1 and sched.last_epoch in (5, 6)  # 6 once it lands
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gpu_a_checkpoint_holds_the_schedule_position_kept_on_the_device(tmp_path) -> None:
    from steplib.checkpoint import save
    from steplib.errors import ConfigError

    model = tiny_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    state = TrainState.create(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    step = skip_nonfinite(amp_wrap(make_train_step(token_loss), dtype=torch.float16))
    with pytest.raises(ConfigError, match="step=step"):  # the position may be in the step
        save(state, str(tmp_path / "without"))
    for batch in _cuda(make_batches(4)):
        state, _ = step(state, batch)
    save(state, str(tmp_path / "with"), step=step)
    assert sched.last_epoch == 4  # settled by the save: the object may lag an update or two


def test_gpu_min_loss_scale_names_the_update_below_it_without_a_host_sync() -> None:
    model = tiny_model(0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    state = TrainState.create(
        model=model, optimizer=opt, scaler=torch.amp.GradScaler("cuda", init_scale=16.0)
    )
    step = amp_wrap(make_train_step(token_loss), dtype=torch.float16, min_loss_scale=1.0)
    batches = [(x * float("inf"), y, m) for x, y, m in _cuda(make_batches(9))]
    # 16 -> 8, 4, 2, 1, then 0.5 in update 5: read once its copy has landed.
    with pytest.raises(TooManySkipsError, match=r"fell to 0\.5 at step 5,"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches[:8]:
                state, _ = step(state, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # not raised yet: every copy has landed, the next update reads
        step(state, batches[8])
    assert state.step >= 4  # raised in the fifth update or later, never before


def test_gpu_async_save_holds_the_values_at_save_time_while_training_goes_on(tmp_path) -> None:
    from steplib.checkpoint import AsyncSaver, load

    def cuda_state(seed: int) -> TrainState:
        model = tiny_model(seed).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return TrainState.create(model=model, optimizer=opt)

    step = make_train_step(token_loss)
    state = cuda_state(0)
    for batch in _cuda(make_batches(3)):
        state, _ = step(state, batch)
    at_save = {k: v.clone() for k, v in state.model.state_dict().items()}
    with AsyncSaver() as saver:
        url = saver.save(state, str(tmp_path))
        for batch in _cuda(make_batches(3, seed=7)):  # queued right behind the copies
            state, _ = step(state, batch)
    loaded = load(url, cuda_state(1))
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, at_save[name])
        assert not torch.equal(value, state.model.state_dict()[name])


def test_gpu_compile_step_with_cuda_graphs_matches_eager_without_recompiling() -> None:
    from steplib import compile_step
    from steplib.step import compile_stats

    batches = _cuda(make_batches(8))  # every micro-batch the same shape: one graph each
    models = []
    for compiled in (False, True):
        model = tiny_model(0).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = TrainState.create(model=model, optimizer=opt)
        step = accumulate(clip(make_train_step(mean_loss), max_norm=1.0), 2)
        if compiled:
            step = compile_step(step, mode="reduce-overhead")  # CUDA graphs
        for _ in range(3):
            for batch in batches:
                state, _out = step(state, batch)
        models.append(model)
    stats = compile_stats(step)
    assert stats.updates == 12 and stats.recompiles == 0 and stats.fused_backward is True
    for got, want in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpu_compiled_step_makes_no_host_sync_once_warm() -> None:
    # The compiled graphs and dynamo's guards must not read a CUDA tensor on the host (a guard
    # that checks the LR tensor with .item() would, on every call). On the CPU dynamo guards
    # the float64 LR and step counters with `not isnan(x.item())`: a host read, no sync there.
    from steplib import compile_step

    model = tiny_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # no .item() of its own
    state = TrainState.create(model=model, optimizer=opt)
    step = compile_step(accumulate(clip(make_train_step(mean_loss), max_norm=1.0), 2))
    batches = _cuda(make_batches(8))
    for batch in batches[:4]:  # the eager first update, then the one that compiles
        state, _ = step(state, batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[4:]:
            state, _ = step(state, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state.step == 4

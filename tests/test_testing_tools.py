"""steplib.testing: every helper passes on a correct case and fails, with a message that names
the divergence, on a deliberately wrong one (the messages are asserted, not only the failure)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from steplib import (
    ConfigError,
    StepOutput,
    TrainState,
    accumulate,
    clip,
    make_train_step,
    warmup_cosine,
)
from steplib.data import resumable_loader
from steplib.testing import (
    HOST_READS,
    assert_accumulation_exact,
    assert_no_host_sync,
    assert_ranks_in_sync,
    assert_steps_equivalent,
    concat_batches,
    reference_loop,
    run_ranks,
    verify_resume,
)
from tests.reference import make_batches, mean_loss, tiny_model, token_loss

ROOT = Path(__file__).resolve().parents[1]


def _build(loss_fn: Any = mean_loss, *, dropout: float = 0.0, k: int = 1):
    """A factory of (step, state): a small MLP, SGD with momentum, a warmup-cosine schedule."""

    def build() -> tuple[Any, TrainState]:
        model = tiny_model(0, dropout=dropout)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=2, total=12))
        step = make_train_step(loss_fn)
        step = accumulate(step, k) if k > 1 else step
        return step, TrainState.create(model=model, optimizer=opt, scheduler=sched)

    return build


def _hand_written(*, zero_grad: bool):
    """A user's own step function: forward, backward, update, (zero_grad), scheduler."""

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        loss = mean_loss(state.model, batch)
        loss.backward()
        state.optimizer.step()
        if zero_grad:
            state.optimizer.zero_grad(set_to_none=True)
        if state.scheduler is not None:
            state.scheduler.step()
        return state.replace(step=state.step + 1), types.SimpleNamespace(loss=loss.detach())

    return step


def _build_hand_written(*, zero_grad: bool):
    def build() -> tuple[Any, TrainState]:
        _, state = _build(dropout=0.2)()
        return _hand_written(zero_grad=zero_grad), state

    return build


# --- assert_steps_equivalent -----------------------------------------------------------------


def test_steps_equivalent_passes_for_a_hand_written_step_bit_for_bit() -> None:
    # Dropout too: both runs start from the same seeded generators.
    assert_steps_equivalent(
        _build(dropout=0.2), _build_hand_written(zero_grad=True), make_batches(5)
    )


def test_steps_equivalent_names_update_parameter_and_difference_when_grads_are_not_zeroed() -> None:
    with pytest.raises(AssertionError) as failure:
        assert_steps_equivalent(
            _build(dropout=0.2), _build_hand_written(zero_grad=False), make_batches(5)
        )
    message = str(failure.value)
    # Update 1 is equal (gradients start at None); update 2 adds the stale gradient. Its loss
    # is still equal (computed before the update), so the first difference is a parameter.
    assert "diverged first at update 2" in message
    assert "the call on batches[1] in the first run" in message
    assert "parameter '0.weight' differs: max abs difference" in message
    assert "more entries differ here" in message


def test_steps_equivalent_reports_different_initial_weights_before_any_update() -> None:
    def other_init() -> tuple[Any, TrainState]:
        step, state = _build()()
        with torch.no_grad():
            state.model[0].bias.add_(0.5)
        return step, state

    with pytest.raises(AssertionError, match=r"before any update: parameter '0.bias' differs"):
        assert_steps_equivalent(_build(), other_init, make_batches(2))


def test_steps_equivalent_tolerances_and_update_counts() -> None:

    def stops_updating() -> tuple[Any, TrainState]:
        step, state = _build()()

        def wrapped(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
            if state.step >= 2:  # a buggy wrapper that stops updating after 2 updates
                return state, types.SimpleNamespace(loss=torch.zeros(()), did_update=False)
            return step(state, batch)

        return wrapped, state

    with pytest.raises(AssertionError, match=r"the number of updates differs: A made 3 and B"):
        assert_steps_equivalent(_build(), stops_updating, make_batches(3))
    # A loss scaled by (1 + 1e-7) differs in the last bits only: within atol, not exactly.
    scaled = _build(lambda m, b: mean_loss(m, b) * (1 + 1e-7))
    assert_steps_equivalent(_build(), scaled, make_batches(3), atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match=r"at update 1 .*: the loss differs"):
        assert_steps_equivalent(_build(), scaled, make_batches(3))


def test_steps_equivalent_has_separate_tolerances_for_the_loss_and_the_parameters() -> None:
    # issue 28: one tolerance for both. A constant added to the loss moves the loss, not the
    # gradient: the parameters stay bit-equal while the losses are 1e-3 apart.
    shifted = _build(lambda m, b: mean_loss(m, b) + 1e-3)
    assert_steps_equivalent(_build(), shifted, make_batches(3), loss_atol=2e-3)
    with pytest.raises(AssertionError, match=r"at update 1 .*: the loss differs"):
        assert_steps_equivalent(_build(), shifted, make_batches(3), param_atol=2e-3)

    # The other way round: a step that nudges a weight after its update moves the parameters,
    # while the loss of the update (computed before it) is equal.
    def nudged() -> tuple[Any, TrainState]:
        step, state = _build()()

        def wrapped(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
            state, out = step(state, batch)
            with torch.no_grad():
                next(state.model.parameters()).add_(1e-5)  # 0.weight
            return state, out

        return wrapped, state

    with pytest.raises(AssertionError, match=r"at update 1 .*: parameter '0.weight' differs"):
        assert_steps_equivalent(_build(), nudged, make_batches(1), loss_atol=1.0, param_atol=1e-9)
    assert_steps_equivalent(_build(), nudged, make_batches(1), loss_atol=0.0, param_atol=1e-3)
    assert_accumulation_exact(
        _build(token_loss), make_batches(4), 2, loss_atol=1e-6, param_atol=1e-6
    )
    with pytest.raises(ConfigError, match=r"param_rtol=\.\.\.\) received -1"):
        assert_steps_equivalent(_build(), _build(), make_batches(1), param_rtol=-1)


# --- assert_accumulation_exact ---------------------------------------------------------------


def test_accumulation_exact_passes_for_a_token_weighted_loss_with_unequal_counts() -> None:
    micro = make_batches(7, [1, 5, 2, 3, 6, 1, 4])  # windows 3, 3 and a shorter 1
    assert_accumulation_exact(_build(token_loss), micro, 3)


def test_accumulation_exact_catches_per_micro_batch_averaging() -> None:
    def masked_mean(model: Any, batch: Any) -> torch.Tensor:
        loss_sum, count = token_loss(model, batch)
        return loss_sum / count  # the mean over THIS micro-batch's targets: the classic bug

    # Equal sizes (6 samples each), but the masks keep different numbers of targets.
    with pytest.raises(AssertionError) as failure:
        assert_accumulation_exact(_build(masked_mean), make_batches(6), 3)
    message = str(failure.value)
    assert "diverged first at update 1" in message
    assert "batches[0:3] concatenated" in message
    assert "the loss differs" in message
    assert "per-token vs per-micro-batch averaging" in message
    assert "equal numbers of samples ([6, 6, 6])" in message
    assert "return (loss_per_target * mask).sum(), mask.sum()" in message


def test_accumulation_exact_mean_loss_is_exact_only_while_counts_are_equal() -> None:
    # The typical symptom: a plain mean passes with equal micro-batches ...
    assert_accumulation_exact(_build(mean_loss), make_batches(4, 4), 2)
    # ... and fails as soon as their sizes differ, naming the sizes.
    with pytest.raises(AssertionError, match=r"averaging.*hold \[1, 5\] samples"):
        assert_accumulation_exact(_build(mean_loss), make_batches(4, [1, 5, 2, 2]), 2)


def test_concat_batches_joins_nested_layouts_and_refuses_what_it_cannot() -> None:
    a = {"x": torch.zeros(2, 3), "pair": (torch.zeros(2), torch.ones(2))}
    b = {"x": torch.ones(1, 3), "pair": (torch.ones(1), torch.zeros(1))}
    joined = concat_batches([a, b])
    assert joined["x"].shape == (3, 3) and isinstance(joined["pair"], tuple)
    assert torch.equal(joined["pair"][0], torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ConfigError, match="concat="):
        concat_batches([("text", torch.zeros(1)), ("more", torch.zeros(1))])


# --- assert_no_host_sync ---------------------------------------------------------------------


def test_no_host_sync_passes_for_steplib_steps_and_returns_the_state() -> None:
    step, state = _build(token_loss, dropout=0.1, k=3)()
    step = clip(step, max_norm=1.0)
    final = assert_no_host_sync(step, state, make_batches(7, [2, 3, 1, 4, 2, 2, 3]))
    assert (final.step, final.micro_step) == (3, 7)  # the flush closed the last window


def syncing_loss(model: Any, batch: Any) -> tuple[torch.Tensor, int]:
    loss_sum, count = token_loss(model, batch)
    return loss_sum, int(count.item())  # the host read the test expects to be named


def test_no_host_sync_names_the_users_line_and_restores_torch() -> None:
    _, state = _build()()
    before = {name: vars(torch.Tensor).get(name) for name in HOST_READS}
    with pytest.raises(AssertionError) as failure:
        assert_no_host_sync(make_train_step(syncing_loss), state, make_batches(2))
    message = str(failure.value)
    line = syncing_loss.__code__.co_firstlineno + 2
    assert "Tensor.item() read a tensor on the host during the call on batches[0]" in message
    assert f"At {__file__}:{line} in syncing_loss: `return loss_sum, int(count.item())" in message
    # Everything is put back, also after a failure.
    assert {name: vars(torch.Tensor).get(name) for name in HOST_READS} == before
    assert torch.ones(()).item() == 1.0 and bool(torch.ones(()))


def test_no_host_sync_reports_a_read_the_step_swallowed_and_reads_inside_torch() -> None:
    def hiding_loss(model: Any, batch: Any) -> torch.Tensor:
        loss = mean_loss(model, batch)
        try:
            if loss > 100:  # Tensor.__bool__: a host read
                print("large loss")
        except Exception:
            pass
        return loss

    _, state = _build()()
    with pytest.raises(AssertionError, match=r"Tensor.__bool__\(\).*caught the error and went on"):
        assert_no_host_sync(make_train_step(hiding_loss), state, make_batches(1))

    # torch's own Adam reads its CPU step counter: the message says it is torch's, and the fix.
    model = tiny_model(0)
    adam = TrainState.create(model=model, optimizer=torch.optim.Adam(model.parameters()))
    with pytest.raises(AssertionError) as failure:
        assert_no_host_sync(make_train_step(mean_loss), adam, make_batches(1))
    message = str(failure.value)
    assert f"{os.sep}torch{os.sep}optim{os.sep}" in message
    assert "capturable=True or fused=True" in message


def test_no_host_sync_catches_the_comparisons_that_answer_a_python_bool() -> None:
    # Before, torch.equal / allclose passed on the CPU: on a GPU each waits for the device.
    def comparing(compare: Any) -> Any:
        def loss_fn(model: Any, batch: Any) -> torch.Tensor:
            loss = mean_loss(model, batch)
            return loss * 0 if compare(loss) else loss

        return loss_fn

    _, state = _build()()
    functions = (torch.equal, torch.allclose, torch.is_nonzero)
    cases = {
        r"torch\.equal\(\)": lambda loss: torch.equal(loss, loss.detach()),
        r"Tensor\.allclose\(\)": lambda loss: loss.allclose(torch.zeros(())),
        r"torch\.is_nonzero\(\)": lambda loss: torch.is_nonzero(loss > 100),
    }
    for read, compare in cases.items():
        with pytest.raises(AssertionError, match=read + r" read a tensor on the host"):
            assert_no_host_sync(make_train_step(comparing(compare)), state, make_batches(1))
    assert (torch.equal, torch.allclose, torch.is_nonzero) == functions  # put back
    assert torch.equal(torch.ones(2), torch.ones(2)) and torch.ones(2).allclose(torch.ones(2))


# --- verify_resume ---------------------------------------------------------------------------


def test_verify_resume_passes_with_dropout_accumulation_and_a_schedule(tmp_path: Path) -> None:
    # 10 micro-batches, windows of 3: the run closes a shorter last window on the last batch.
    verify_resume(_build(dropout=0.25, k=3), make_batches(10), save_at=2)
    # The checkpoint stays where url= says.
    verify_resume(_build(dropout=0.25), make_batches(6), save_at=3, url=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]


def test_verify_resume_passes_with_skips_decided_on_the_device() -> None:
    """A fused optimizer with skip_nonfinite keeps its LambdaLR's position on the device; the
    check settles the scheduler before comparing it."""
    from steplib import skip_nonfinite

    def build() -> tuple[Any, TrainState]:
        model = tiny_model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup=2, total=12))
        step = skip_nonfinite(make_train_step(mean_loss))
        return step, TrainState.create(model=model, optimizer=opt, scheduler=sched)

    batches = make_batches(8)
    x, y, mask = batches[2]
    batches[2] = (x * float("inf"), y, mask)  # a skipped update before the save
    verify_resume(build, batches, save_at=4)


def _loader_factory():
    gen = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(20, 8, generator=gen), torch.randn(20, 3, generator=gen))
    return lambda: resumable_loader(dataset, batch_size=4, shuffle=True, seed=7)


def _xy_loss(model: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).view(-1, 3), y)


def test_verify_resume_with_a_shuffling_loader_across_epochs() -> None:
    # 5 batches per epoch; saved mid-epoch 2, resumed into epoch 3.
    verify_resume(_build(_xy_loss, dropout=0.25), _loader_factory(), save_at=7, max_epochs=3)


def test_verify_resume_names_lost_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint mechanism that forgets the random number generators.
    monkeypatch.setattr("steplib.checkpoint.restore.restore_rng", lambda saved: None)
    with pytest.raises(AssertionError) as failure:
        verify_resume(_build(dropout=0.25), make_batches(6), save_at=3)
    message = str(failure.value)
    assert "resumed from the checkpoint saved at update 3" in message
    assert "at call 4 of the step (micro_step 4, step 4 after it" in message
    assert "the 1st call after the resume: the loss differs" in message
    assert "same batch and started from the same parameters" in message
    assert "RNG states (dropout, random augmentation) were not restored" in message


def test_verify_resume_names_a_lost_data_position(monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint mechanism that forgets where the data was: the loader starts over.
    monkeypatch.setattr("steplib.checkpoint.restore.restore_position", lambda data, pos: False)
    with pytest.raises(AssertionError) as failure:
        verify_resume(_build(_xy_loss), _loader_factory(), save_at=2)
    message = str(failure.value)
    assert "the 1st call after the resume: the loss differs" in message
    assert "fed another batch" in message and "data position" in message


def test_verify_resume_refuses_what_it_cannot_verify() -> None:
    with pytest.raises(ConfigError, match=r"made only 3 updates .* never reached update 5"):
        verify_resume(_build(), make_batches(3), save_at=5)
    with pytest.raises(ConfigError, match="last update"):
        verify_resume(_build(), make_batches(3), save_at=3)
    with pytest.raises(ConfigError, match="A loader object itself cannot be rebuilt"):
        verify_resume(_build(_xy_loss), _loader_factory()(), save_at=1)
    model = tiny_model(0)
    shared = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    with pytest.raises(ConfigError, match="returned the same model object"):
        verify_resume(lambda: (make_train_step(mean_loss), shared), make_batches(3), save_at=1)


# --- assert_ranks_in_sync (2 processes over gloo) ----------------------------------------------


def _perturbed_rank(rank: int, world: int) -> list[str]:
    model = tiny_model(0)
    messages = []
    mean_loss(model, make_batches(1)[0]).backward()  # same batch on both ranks: same grads
    assert_ranks_in_sync(model)  # passes: same seed, same gradients
    if rank == 1:
        model[3].weight.grad = None  # type: ignore[index]
    for change in ("grad", "value"):
        if change == "value" and rank == 1:
            with torch.no_grad():
                model[3].weight[0, 0] += 1e-4  # type: ignore[index]
        try:
            assert_ranks_in_sync(model, grads=change == "grad")
        except AssertionError as err:
            messages.append(str(err))
    return messages


def test_ranks_in_sync_names_the_parameter_and_the_ranks() -> None:
    results = run_ranks(_perturbed_rank)
    assert results[0] == results[1]  # every rank raises the same error
    grad_message, value_message = results[0]
    assert "parameter '3.weight' differs across ranks (a gradient on some ranks only)" in (
        grad_message
    )
    assert "parameter '3.weight' differs across ranks (its values)" in value_message
    assert "rank 0: value sum" in value_message and "rank 1: value sum" in value_message


# --- reference_loop --------------------------------------------------------------------------


def test_reference_loop_equals_make_train_step_bit_for_bit() -> None:
    batches = make_batches(6)
    model = tiny_model(0, dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(5)
    records = reference_loop(model, opt, batches=batches, loss_fn=mean_loss, max_norm=1.0)

    mine = tiny_model(0, dropout=0.2)
    state = TrainState.create(
        model=mine, optimizer=torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    )
    step = clip(make_train_step(mean_loss), max_norm=1.0)
    torch.manual_seed(5)
    outs: list[StepOutput] = []
    for batch in batches:
        state, out = step(state, batch)
        outs.append(out)
    for got, want in zip(mine.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
    assert all(torch.equal(o.loss, r.loss) for o, r in zip(outs, records, strict=True))
    for o, r in zip(outs, records, strict=True):
        assert o.grad_norm is not None and r.grad_norm is not None
        assert torch.equal(o.grad_norm, r.grad_norm)


def test_reference_loop_accumulates_token_weighted_with_a_shorter_last_window() -> None:
    micro = make_batches(5, [3, 1, 4, 2, 5])
    model = tiny_model(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    double = [(x.double(), y.double(), m) for x, y, m in micro]
    records = reference_loop(model, opt, batches=double, loss_fn=token_loss, accumulation=3)
    assert [int(r.num_targets) for r in records] == [
        int(sum(m.sum() for _, _, m in micro[:3])),
        int(sum(m.sum() for _, _, m in micro[3:])),
    ]
    ref = tiny_model(0).double()
    ref_state = TrainState.create(model=ref, optimizer=torch.optim.SGD(ref.parameters(), lr=0.1))
    step = accumulate(make_train_step(token_loss), 3)
    for i, batch in enumerate(double):
        ref_state, _ = step(ref_state, batch, close_window=i == len(double) - 1)
    for got, want in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# --- the pytest plugin -----------------------------------------------------------------------

_PLUGIN_TEST = """
import torch
from steplib.testing import assert_ranks_in_sync


def test_fixtures(tmp_checkpoint_dir, gloo_ranks):
    assert tmp_checkpoint_dir.endswith("checkpoints")

    def same_model(rank, world):
        torch.manual_seed(0)
        assert_ranks_in_sync(torch.nn.Linear(2, 2))
        return rank

    assert gloo_ranks(same_model) == [0, 1]
"""


@pytest.mark.slow  # a child pytest: one more import of torch and steplib
def test_pytest_plugin_provides_the_fixtures(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(_PLUGIN_TEST))
    installed = any(
        ep.value == "steplib.testing.plugin"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    # Once the entry point is installed, pytest loads the plugin itself; naming it again
    # with -p would register the module twice.
    plugin = [] if installed else ["-p", "steplib.testing.plugin"]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "no:cacheprovider", *plugin],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert "1 passed" in child.stdout


def test_steps_equivalent_compares_buffers_a_stray_forward_moves() -> None:
    # A step that runs the model once more per batch (a check, a log) trains the same
    # parameters, but BatchNorm's running statistics move twice: the evaluated model differs.
    # Only parameters and the optimizer were compared, so the helper said "equivalent".
    def build(extra_forward: bool) -> Any:
        def factory() -> tuple[Any, TrainState]:
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3),
                torch.nn.Flatten(0),
            )  # fmt: skip
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
                if extra_forward:
                    with torch.no_grad():
                        model(batch[0])
                return mean_loss(model, batch)

            return make_train_step(loss_fn), TrainState.create(model=model, optimizer=opt)

        return factory

    assert_steps_equivalent(build(False), build(False), make_batches(3))
    with pytest.raises(AssertionError, match=r"at update 1 .*buffer '1.running_mean' differs"):
        assert_steps_equivalent(build(False), build(True), make_batches(3))


def test_reference_loop_makes_no_update_on_a_window_of_no_targets_as_the_step() -> None:
    # It stepped AdamW on zero gradients (weight decay and momentum moved the parameters) and
    # its scheduler, where the step makes no update: a comparison failed on a correct step.
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, int]) -> tuple[Any, int]:
        x, count = batch
        return model(x).pow(2).sum() * min(count, 1), count

    batches = [(torch.ones(2, 3), 2), (torch.ones(2, 3), 0), (torch.ones(2, 3), 2)]
    model, opt, sched = build()
    records = reference_loop(model, opt, batches=batches, loss_fn=loss_fn, scheduler=sched)
    assert [r.did_update for r in records] == [True, False, True]
    twin, twin_opt, twin_sched = build()
    state = TrainState.create(model=twin, optimizer=twin_opt, scheduler=twin_sched)
    step = make_train_step(loss_fn)
    for batch in batches:
        state, _ = step(state, batch)
    assert sched.last_epoch == twin_sched.last_epoch == 2
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)

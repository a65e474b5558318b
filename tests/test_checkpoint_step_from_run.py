"""The checkpoint handlers take the step(s) from the run, as they take its loader and handlers:
``checkpoint_every`` records the composition of what ``run`` calls and ``resume_from`` checks
it, without ``step=`` named a second time (before, a run that did not repeat it was saved
unfingerprinted and resumed under another composition in silence)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from steplib import (
    ConfigError,
    Events,
    TrainState,
    accumulate,
    checkpoint_every,
    clip,
    make_train_step,
    resume_from,
    run,
    skip_nonfinite,
)
from steplib.checkpoint import latest, list_checkpoints, load
from steplib.step import compile_step
from tests.checkpoint_helpers import make_state, memory_dir
from tests.reference import make_batches, mean_loss
from tests.test_several_optimizers import _nets, _state, d_loss, g_loss

__all__ = ["memory_dir"]


def test_a_resume_under_another_composition_is_refused_without_naming_the_step(
    memory_dir: str,
) -> None:
    saved_with = clip(accumulate(make_train_step(mean_loss), 2), max_norm=1.0)
    run(saved_with, make_state(), make_batches(4), events=[checkpoint_every(memory_dir, epochs=1)])
    other = accumulate(make_train_step(mean_loss), 4)  # the counters would mean another thing
    with pytest.raises(ConfigError, match=r"accumulate k=2 in the checkpoint, 4 now"):
        run(other, make_state(), make_batches(4), events=[resume_from(memory_dir)])
    resumed = run(saved_with, make_state(), make_batches(4), events=[resume_from(memory_dir)])
    assert resumed.step == 4  # the same composition resumes (at 2, for its next epoch)


def test_several_steps_are_recorded_by_name_and_their_order_checked(memory_dir: str) -> None:
    batches = [(torch.randn(6, 2), torch.randn(6, 4)) for _ in range(2)]
    steps = {
        "D": make_train_step(d_loss, optimizer="D"),
        "G": make_train_step(g_loss, optimizer="G"),
    }
    run(steps, _state(*_nets()), batches, events=[checkpoint_every(memory_dir, every=1)])
    # Each step's loss by its name, as the logs name it (before: the last step's as "loss").
    recorded = list_checkpoints(memory_dir)[-1].metrics
    assert sorted(recorded) == ["D/loss", "G/loss"]
    swapped = {"G": steps["G"], "D": steps["D"]}
    with pytest.raises(ConfigError, match="trained by the step"):
        run(swapped, _state(*_nets()), batches, events=[resume_from(memory_dir)])


class _OwnStep:
    """A step of the user's own: what ``run`` needs (a call and ``flush``), no composition."""

    def __init__(self) -> None:
        self.inner = make_train_step(mean_loss)

    def __call__(self, state: TrainState, batch: Any, *, close_window: bool = False) -> Any:
        return self.inner(state, batch, close_window=close_window)

    def flush(self, state: TrainState) -> Any:
        return self.inner.flush(state)


def test_a_step_of_the_users_own_is_saved_without_a_composition(memory_dir: str) -> None:
    events = Events(checkpoint_every(memory_dir, every=2))
    state = run(_OwnStep(), make_state(), make_batches(4), events=events)
    url = latest(memory_dir)
    assert url is not None
    # No fingerprint to compare: a Step loads it, as a checkpoint saved by hand without step=.
    assert load(url, make_state(), step=make_train_step(mean_loss)).step == state.step


def _backend_of_a_new_process() -> Any:
    """The same backend as a new process defines it: the same function at another address."""

    def eager_graphs(graph: Any, inputs: Any) -> Any:
        return graph.forward

    return eager_graphs


def test_a_compiled_step_with_a_backend_function_resumes_in_a_new_process(
    memory_dir: str,
) -> None:
    # A setting JSON cannot hold was recorded as its repr, with the function's address: every
    # resume in a new process was refused as "trained by another step" (compile_step's
    # documented backend=callable, a Part of the user's whose settings hold a function).
    def compiled() -> Any:
        return compile_step(make_train_step(mean_loss), backend=_backend_of_a_new_process())

    run(compiled(), make_state(), make_batches(4), events=[checkpoint_every(memory_dir, epochs=1)])
    resumed = run(compiled(), make_state(), make_batches(4), events=[resume_from(memory_dir)])
    assert resumed.step == 8  # resumed at 4, the end of its epoch, then one more epoch
    other = compile_step(make_train_step(mean_loss), backend="aot_eager")
    with pytest.raises(ConfigError, match="trained by the step"):
        run(other, make_state(), make_batches(4), events=[resume_from(memory_dir)])


def test_a_resume_may_raise_max_consecutive_as_the_too_many_skips_error_says(
    memory_dir: str,
) -> None:
    # TooManySkipsError names the fix "raise max_consecutive"; the limit was part of the
    # recorded composition, so resuming the run under a higher one was refused. It changes no
    # number (as amp_wrap's min_loss_scale, left out of the composition for that reason).
    def limited(n: int) -> Any:
        return skip_nonfinite(make_train_step(mean_loss), max_consecutive=n)

    run(limited(3), make_state(), make_batches(4), events=[checkpoint_every(memory_dir, epochs=1)])
    resumed = run(limited(20), make_state(), make_batches(4), events=[resume_from(memory_dir)])
    assert resumed.step == 8
    with pytest.raises(ConfigError, match="trained by the step"):  # no skipping: other numbers
        run(
            make_train_step(mean_loss),
            make_state(),
            make_batches(4),
            events=[resume_from(memory_dir)],
        )

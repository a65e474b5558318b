"""Law 5: wrappers commute where the semantics allow (clipping always sees unscaled gradients),
and a composition that cannot be right is refused when the step is built, with the fix."""

from __future__ import annotations

import itertools

import pytest
import torch

from steplib import (
    ConfigError,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    skip_nonfinite,
)
from tests.reference import make_batches, tiny_model, token_loss


def _train(wrappers) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = tiny_model(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState.create(model=model, optimizer=opt, scaler=scaler)
    step = make_train_step(token_loss)
    for wrap in wrappers:
        step = wrap(step)
    norms = []
    for batch in make_batches(8, [3, 1, 4, 1, 5, 2, 6, 5]):
        state, out = step(state, batch)
        if out.grad_norm is not None:
            norms.append(out.grad_norm)
    return [p.detach().clone() for p in model.parameters()], norms


WRAPPERS = {
    "clip": lambda s: clip(s, max_norm=0.5),
    "amp": lambda s: amp_wrap(s, dtype=torch.float16),
    "accumulate": lambda s: accumulate(s, 2),
    "skip": lambda s: skip_nonfinite(s),
}


def test_law5_clip_amp_equals_amp_clip() -> None:
    a = _train([WRAPPERS["amp"], WRAPPERS["clip"]])  # clip(amp_wrap(s))
    b = _train([WRAPPERS["clip"], WRAPPERS["amp"]])  # amp_wrap(clip(s))
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(x, y)


def test_law5_every_order_of_the_builtin_wrappers_gives_the_same_step() -> None:
    results = [_train([WRAPPERS[n] for n in order]) for order in itertools.permutations(WRAPPERS)]
    first_params, first_norms = results[0]
    assert len(first_norms) == 4  # 8 micro-batches, 2 per update
    for params, norms in results[1:]:
        for x, y in zip(first_params + first_norms, params + norms, strict=True):
            assert torch.equal(x, y)


def test_law5_clip_sees_unscaled_gradients() -> None:
    """With a scale of 2**12, a clip on scaled gradients would report a norm 4096x too big."""
    _, scaled_norms = _train([WRAPPERS["amp"], WRAPPERS["clip"]])
    _, plain_norms = _train([WRAPPERS["clip"]])
    for scaled, plain in zip(scaled_norms, plain_norms, strict=True):
        torch.testing.assert_close(scaled, plain, rtol=1e-2, atol=1e-3)  # fp16 vs fp32 forward


@pytest.mark.parametrize(
    ("build", "fix"),
    [
        (lambda s: accumulate(accumulate(s, 2), 4), "Apply it once"),
        (lambda s: clip(clip(s, max_norm=1.0), max_value=0.5), "Apply it once"),
        (lambda s: amp_wrap(amp_wrap(s), dtype=torch.float16), "Apply it once"),
        (lambda s: skip_nonfinite(skip_nonfinite(s)), "Apply it once"),
    ],
)
def test_law5_impossible_composition_is_refused_at_build_time(build, fix) -> None:
    with pytest.raises(ConfigError, match="applied twice") as err:
        build(make_train_step(token_loss))
    assert fix in str(err.value)

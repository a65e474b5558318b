"""Every bad input is refused when the step or state is built (or at the first call, when only
the call can know), with a message saying what was received, why it is wrong and the fix."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from steplib import (
    ConfigError,
    LossFnError,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    skip_nonfinite,
)
from steplib.schedules import warmup_cosine


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _state(**kwargs) -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainState.create(model=model, optimizer=opt, **kwargs)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


# --- accumulate -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -2, 2.5, "4", True])
def test_accumulate_refuses_k_that_is_not_a_positive_int(k):
    with pytest.raises(ConfigError) as info:
        accumulate(make_train_step(_mse), k)
    message = str(info.value)
    assert f"received k={k!r} (type {type(k).__name__})" in message
    assert "must be an int >= 1" in message
    assert "accumulate(step, 4)" in message


def test_accumulate_accepts_k_of_one():
    assert accumulate(make_train_step(_mse), 1).plan.window == 1


# --- clip -------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["max_norm", "max_value"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1.0"])
def test_clip_refuses_a_limit_that_is_not_a_finite_positive_number(label, value):
    with pytest.raises(ConfigError) as info:
        clip(make_train_step(_mse), **{label: value})
    message = str(info.value)
    assert f"clip({label}=...) received {value!r}" in message
    assert "finite number > 0" in message
    assert f"clip(step, {label}=1.0)" in message


@pytest.mark.parametrize("value", [0, 0.0])
def test_clip_of_zero_says_how_to_not_clip(value):
    """DETR clips only `if max_norm > 0` (--clip_max_norm 0: no clipping); a port passing its
    0 on was told only to pass a number > 0."""
    with pytest.raises(ConfigError) as info:
        clip(make_train_step(_mse), max_norm=value)
    message = str(info.value)
    assert "does not turn clipping off" in message
    assert "step = clip(step, max_norm=m) if m > 0 else step" in message


def test_clip_without_any_limit_is_refused():
    with pytest.raises(ConfigError) as info:
        clip(make_train_step(_mse))
    message = str(info.value)
    assert "neither max_norm nor max_value" in message
    assert "clip nothing" in message
    assert "clip(step, max_norm=1.0)" in message


@pytest.mark.parametrize("norm_type", [0, -2.0, math.nan, "2", True])
def test_clip_refuses_a_bad_norm_type(norm_type):
    with pytest.raises(ConfigError) as info:
        clip(make_train_step(_mse), max_norm=1.0, norm_type=norm_type)
    message = str(info.value)
    assert f"clip(norm_type=...) received {norm_type!r}" in message
    assert "number > 0 or math.inf" in message


def test_clip_accepts_the_infinity_norm():
    step = clip(make_train_step(_mse), max_norm=1.0, norm_type=math.inf)
    assert step.describe()[-1]["norm_type"] == math.inf


# --- amp_wrap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, "bf16"])
def test_amp_wrap_refuses_a_dtype_other_than_bfloat16_or_float16(dtype):
    with pytest.raises(ConfigError) as info:
        amp_wrap(make_train_step(_mse), dtype=dtype)
    message = str(info.value)
    assert f"amp_wrap(dtype=...) received {dtype!r}" in message
    assert "torch.bfloat16" in message and "torch.float16" in message
    assert "do not wrap the step" in message


def test_float16_without_a_scaler_fails_at_the_first_call_with_the_fix():
    step = amp_wrap(make_train_step(_mse), dtype=torch.float16)
    state = _state()
    with pytest.raises(ConfigError) as info:
        step(state, _batch())
    message = str(info.value)
    assert "needs a GradScaler" in message
    assert "scaler=torch.amp.GradScaler('cpu')" in message
    assert "dtype=torch.bfloat16" in message
    assert all(p.grad is None for p in state.model.parameters())


def test_float16_with_a_disabled_scaler_is_refused_at_the_first_call_with_the_fix():
    # GradScaler(enabled=False), or GradScaler('cuda') made without CUDA (torch disables it
    # with a warning), scales nothing: float16 gradients below 6e-8 flushed to zero, and a
    # loss of 1e-7's size trained no parameter at all, in silence.
    step = amp_wrap(make_train_step(_mse), dtype=torch.float16)
    state = _state(scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ConfigError) as info:
        step(state, _batch())
    message = str(info.value)
    assert "needs a GradScaler" in message and "a disabled GradScaler" in message
    assert "scaler=torch.amp.GradScaler('cpu')" in message
    assert "dtype=torch.bfloat16" in message
    assert all(p.grad is None for p in state.model.parameters())


# --- loss_fn results --------------------------------------------------------------------------


def _call_with(result_fn):
    step = make_train_step(lambda model, batch: result_fn(model, batch))
    step(_state(), _batch())


def test_a_loss_fn_returning_a_float_is_refused():
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: 1.5)
    message = str(info.value)
    assert "loss_fn returned a loss of 1.5 (type float)" in message
    assert "not loss.item()" in message and "a scalar loss tensor" in message


def test_a_loss_fn_returning_loss_item_in_a_tuple_is_told_to_return_the_tensor():
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (_mse(m, b).item(), 3))
    message = str(info.value)
    assert "a loss of 0." in message and "(type float), not a tensor" in message
    assert "not loss.item()" in message


def test_a_loss_fn_returning_a_non_scalar_tensor_is_refused():
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (m(b[0]) - b[1]) ** 2)
    message = str(info.value)
    assert "a loss of shape (3, 1)" in message
    assert "return loss.mean()" in message


def test_nanogpt_style_logits_and_loss_are_read_as_a_tuple_and_told_to_return_the_loss():
    def nanogpt_loss_fn(model, batch):
        logits = model(batch[0]).unsqueeze(1).expand(3, 4, 1)  # (B, T, V), as nanoGPT's
        return logits, _mse(model, batch)  # nanoGPT's model(x, y) returns (logits, loss)

    with pytest.raises(LossFnError) as info:
        _call_with(nanogpt_loss_fn)
    message = str(info.value)
    assert "read as (loss_sum, num_targets)" in message
    assert "shape (3, 4, 1)" in message
    assert "`logits, loss = model(x, y); return loss`" in message
    assert "loss.mean()" not in message  # the mean of the logits would be the wrong fix


def test_a_non_scalar_first_item_of_a_loss_and_aux_tuple_says_how_it_was_read():
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: ((m(b[0]) - b[1]) ** 2, {"err": torch.ones(())}))
    message = str(info.value)
    assert "a tuple of 2 items, read as (loss, aux)" in message
    assert "shape (3, 1)" in message and "loss.mean()" in message


def test_a_loss_computed_without_grad_is_refused():
    def no_grad_loss(model, batch):
        with torch.no_grad():
            return _mse(model, batch)

    with pytest.raises(LossFnError) as info:
        _call_with(no_grad_loss)
    message = str(info.value)
    assert "does not require grad" in message
    assert "torch.no_grad()" in message


@pytest.mark.parametrize(
    ("aux", "fragment"),
    [
        (["not", "a", "dict"], "aux=['not', 'a', 'dict'] (type list); it must be a dict"),
        ({"acc": 0.5}, "aux['acc']=0.5 (type float); aux must map str names to tensors"),
        ({1: torch.ones(())}, "aux[1]="),
    ],
)
def test_a_three_tuple_with_a_bad_aux_is_refused(aux, fragment):
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), 3, aux))
    assert fragment in str(info.value)


@pytest.mark.parametrize("count", [[3], "3", True])
def test_num_targets_of_the_wrong_type_is_refused(count):
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    message = str(info.value)
    assert f"num_targets={count!r}" in message
    assert "int or a 0-dim tensor" in message
    assert "labels.numel()" in message


@pytest.mark.parametrize(
    ("count", "fragment"),
    [
        (torch.tensor([1, 2, 3]), "shape (3,) and dtype torch.int64"),
        (torch.tensor(True), "shape () and dtype torch.bool"),
    ],
)
def test_num_targets_as_a_non_scalar_or_bool_tensor_is_refused(count, fragment):
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    message = str(info.value)
    assert fragment in message
    assert "0-dim numeric tensor" in message
    assert "mask.sum()" in message


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16]
)
def test_num_targets_in_a_dtype_that_cannot_count_a_window_is_refused(dtype):
    # Summed over a window in its own dtype, 2049 + 2050 float16 targets count as 4096 and
    # int8 counts wrap around: the gradient would be divided by a wrong count, in silence.
    count = torch.tensor(100, dtype=dtype)
    with pytest.raises(LossFnError) as info:
        _call_with(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    message = str(info.value)
    assert f"dtype {dtype}" in message
    assert "mask.sum(dtype=torch.int64)" in message


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64])
def test_num_targets_in_a_dtype_wide_enough_to_count_is_accepted(dtype):
    count = torch.tensor(3, dtype=dtype)
    step = make_train_step(lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum"), count))
    _, out = step(_state(), _batch())
    assert bool(out.did_update) and out.num_targets.dtype == dtype


def test_a_refused_loss_fn_result_leaves_the_state_unchanged():
    state = _state()
    step = make_train_step(lambda m, b: (m(b[0]) - b[1]) ** 2)
    with pytest.raises(LossFnError):
        step(state, _batch())
    assert (state.step, state.micro_step, state.window.size) == (0, 0, 0)


# --- make_train_step --------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", [3, "mse", None])
def test_make_train_step_refuses_a_non_callable(loss_fn):
    with pytest.raises(ConfigError) as info:
        make_train_step(loss_fn)
    message = str(info.value)
    assert f"received loss_fn={loss_fn!r}" in message
    assert "not callable" in message
    assert "def loss_fn(model, batch)" in message


def _one_arg(model):
    return model


def _four_args(model, batch, step, extra):  # three is loss_fn(model, batch, step)
    return model


def _keyword_only(*, model, batch):
    return model


@pytest.mark.parametrize("loss_fn", [_one_arg, _four_args, _keyword_only])
def test_make_train_step_refuses_a_function_that_cannot_take_model_and_batch(loss_fn):
    with pytest.raises(ConfigError) as info:
        make_train_step(loss_fn)
    message = str(info.value)
    assert f"loss_fn {loss_fn.__name__!r} cannot be called as loss_fn(model, batch)" in message
    assert "exactly two positional parameters" in message


def test_make_train_step_accepts_defaults_and_varargs():
    def with_default(model, batch, scale=1.0):
        return model

    def varargs(*args):
        return args

    assert make_train_step(with_default).loss_fn is with_default
    assert make_train_step(varargs).loss_fn is varargs


# --- TrainState.create ------------------------------------------------------------------------


def test_create_refuses_a_model_that_is_not_a_module():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=model.state_dict(), optimizer=opt)
    message = str(info.value)
    assert "TrainState.create(model=...) received" in message
    assert "not a torch.nn.Module" in message
    assert "model=MyNet()" in message


def test_create_refuses_a_model_without_parameters():
    other = nn.Linear(4, 1)
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=nn.ReLU(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert "a model (ReLU) with no parameters" in str(info.value)


def test_create_refuses_an_optimizer_that_is_not_an_optimizer():
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=nn.Linear(4, 1), optimizer="sgd")  # type: ignore[arg-type]
    message = str(info.value)
    assert "TrainState.create(optimizer=...) received 'sgd' (type str)" in message
    assert "torch.optim.AdamW(model.parameters())" in message


def test_create_refuses_an_optimizer_over_another_models_parameters():
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    message = str(info.value)
    assert "2 parameter(s) that are not parameters of the model (Linear)" in message
    assert "optimizer=torch.optim.AdamW(model.parameters(), ...)" in message


def test_create_refuses_trainable_parameters_that_no_optimizer_updates():
    # Their gradients pile up (opt.zero_grad clears the optimizer's alone); an add_param_group
    # later would apply every one of them in a single update.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))
    message = str(info.value)
    assert "model has 2 trainable parameter(s) that no optimizer updates (0.weight, 0.bias)" in (
        message
    )
    assert "optimizer=torch.optim.AdamW(model.parameters())" in message
    assert "model.get_submodule('0').requires_grad_(False)" in message


def test_create_accepts_an_optimizer_over_a_subset_when_the_rest_is_frozen():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    assert TrainState.create(model=model, optimizer=opt).optimizer is opt


def test_an_update_refuses_a_parameter_unfrozen_outside_every_optimizer():
    # The optimizer was built over what was trainable then (weight_decay_groups does that);
    # unfrozen later, the body would silently not train, its gradients piling up.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model[1].parameters()))
    step = accumulate(make_train_step(lambda m, b: m(b).pow(2).mean()), 2)
    for _ in range(2):
        state, out = step(state, torch.ones(2, 4))
    assert out.did_update
    model[0].requires_grad_(True)
    state, _ = step(state, torch.ones(2, 4))  # inside the window: nothing is applied yet
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"update 2: model has 2 trainable parameter\(s\)"):
        step(state, torch.ones(2, 4))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_create_says_a_schedule_function_is_not_a_scheduler_and_shows_lambdalr():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=model, optimizer=opt, scheduler=warmup_cosine(warmup=2, total=9))
    message = str(info.value)
    assert "the function that warmup_cosine(...) returns: a schedule function" in message
    assert "LambdaLR(optimizer, warmup_cosine(...))" in message
    assert "not bound" not in message


def test_create_refuses_a_plateau_scheduler_that_the_step_could_not_feed():
    # Accepted before, it failed at the first update: ReduceLROnPlateau.step() needs a value.
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    fix = r"scheduler=None.*Scheduler\(plateau, metric=evaluator\)"
    with pytest.raises(ConfigError, match=r"received a ReduceLROnPlateau.*" + fix):
        TrainState.create(model=model, optimizer=opt, scheduler=plateau)
    state = TrainState.create(model=model, optimizer=opt)
    with pytest.raises(ConfigError, match=r"TrainState.replace\(scheduler=...\) received a Red"):
        state.replace(scheduler=plateau)


def test_create_refuses_an_optimizer_whose_step_needs_a_closure():
    # LBFGS re-evaluates the loss through a closure: a steplib step calls optimizer.step()
    # once, without one. Accepted before, the first update failed inside torch with
    # "LBFGS.step() missing 1 required positional argument: 'closure'".
    model = nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    fix = r"first-order optimizer.*optimizer.step\(closure\)"
    needs = r"received LBFGS, whose step\(\) needs a closure.*"
    with pytest.raises(ConfigError, match=needs + fix):
        TrainState.create(model=model, optimizer=lbfgs)
    with pytest.raises(ConfigError, match=r"optimizer\['D'\]=...\) received LBFGS"):
        TrainState.create(model=model, optimizer={"D": lbfgs})
    scheduled = torch.optim.SGD(model.parameters())  # a scheduler wraps step: still accepted
    torch.optim.lr_scheduler.LambdaLR(scheduled, lambda s: 1.0)
    TrainState.create(model=model, optimizer=scheduled)


def test_create_refuses_a_scheduler_bound_to_another_optimizer():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stray = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(stray, lambda s: 1.0)
    with pytest.raises(ConfigError) as info:
        TrainState.create(model=model, optimizer=opt, scheduler=sched)
    message = str(info.value)
    assert "the scheduler (LambdaLR) is not bound to this optimizer" in message
    assert "scheduler=LambdaLR(optimizer, ...)" in message


@pytest.mark.parametrize("scaler", ["fp16", torch.ones(())])
def test_create_refuses_a_scaler_that_is_not_a_grad_scaler(scaler):
    with pytest.raises(ConfigError) as info:
        _state(scaler=scaler)
    message = str(info.value)
    assert "TrainState.create(scaler=...) received" in message
    assert "torch.amp.GradScaler" in message


# --- wrappers applied twice, or to a non-Step -------------------------------------------------


@pytest.mark.parametrize(
    ("wrap", "name", "first", "second"),
    [
        (lambda s, v: accumulate(s, v), "accumulate", 2, 4),
        (lambda s, v: clip(s, max_norm=v), "clip", 1.0, 0.5),
        (lambda s, v: amp_wrap(s, dtype=v), "amp_wrap", torch.bfloat16, torch.float16),
        (lambda s, v: skip_nonfinite(s, max_consecutive=v), "skip_nonfinite", 3, 5),
    ],
)
def test_a_wrapper_applied_twice_is_refused_with_the_fix(wrap, name, first, second):
    once = wrap(make_train_step(_mse), first)
    with pytest.raises(ConfigError) as info:
        wrap(once, second)
    message = str(info.value)
    assert f"{name} was applied twice" in message
    assert str(first) in message and str(second) in message
    assert "Apply it once with the settings you want" in message


def test_a_wrapper_applied_twice_is_refused_even_with_others_between():
    inner = clip(accumulate(make_train_step(_mse), 2), max_norm=1.0)
    with pytest.raises(ConfigError, match="accumulate was applied twice"):
        accumulate(inner, 4)


@pytest.mark.parametrize(
    ("wrap", "name"),
    [
        (lambda s: accumulate(s, 2), "accumulate"),
        (lambda s: clip(s, max_norm=1.0), "clip"),
        (lambda s: amp_wrap(s, dtype=torch.bfloat16), "amp_wrap"),
        (lambda s: skip_nonfinite(s), "skip_nonfinite"),
    ],
)
def test_a_wrapper_given_a_plain_function_is_refused(wrap, name):
    with pytest.raises(ConfigError) as info:
        wrap(_mse)
    message = str(info.value)
    assert f"{name}() expects a Step, got <function _mse" in message
    assert f"step = make_train_step(loss_fn); step = {name}(step, ...)" in message


def test_wrapping_never_changes_the_step_it_was_given():
    base = make_train_step(_mse)
    accumulate(clip(base, max_norm=1.0), 4)
    assert (base.plan.window, base.parts, base.applied) == (1, (), ())

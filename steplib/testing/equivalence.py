"""``assert_steps_equivalent`` and ``assert_accumulation_exact``: two runs from the same weights,
compared after every update, with a message that says where they parted first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from steplib.errors import ConfigError, describe
from steplib.seeding import capture_rng
from steplib.step.accumulate import accumulate
from steplib.testing.runs import (
    Build,
    Call,
    Divergence,
    Run,
    Tolerance,
    build_seeded,
    check_separate,
    first_divergence,
    first_divergence_after_update,
    global_rng_kept,
    list_calls,
    optimizer_values,
    parameter_values,
    seed_all,
    tolerance,
)

_ORDER = "after every update: the loss, then every parameter and buffer, then the optimizer state"


def assert_steps_equivalent(
    build_a: Build,
    build_b: Build,
    batches: Iterable[Any],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    loss_atol: float | None = None,
    loss_rtol: float | None = None,
    param_atol: float | None = None,
    param_rtol: float | None = None,
    seed: int = 0,
) -> None:
    """Assert that two steps train alike: same batches, same initial weights, same updates.

    Both factories run after ``seed_all(seed)`` (torch, numpy, ``random``), and both runs start
    from the same seeded generators, so dropout draws the same masks in both. The runs advance
    in lockstep, one update at a time (each with its own copy of the global generators), and
    are compared before the first update and after every update: the loss reported by the
    update, every parameter and buffer (by position; named as in A's model), and the optimizer's
    hyperparameters and per-parameter state. A step with ``flush`` is flushed after the last
    batch, so a last, shorter window counts.

    Args:
        build_a: ``() -> (step, state)``; ``step(state, batch) -> (state, out)`` where ``out``
            has ``.loss`` (and ``.did_update`` when not every call updates). A hand-written
            step function is fine.
        build_b: the same for the other step. Each call of a factory must create a new model
            and optimizer.
        batches: the batches both steps are fed, in order (iterated once, kept in a list).
        atol: absolute tolerance; 0 with ``rtol=0`` means bit-for-bit equality.
        rtol: relative tolerance.
        loss_atol: absolute tolerance of the losses (default: ``atol``).
        loss_rtol: relative tolerance of the losses (default: ``rtol``).
        param_atol: of the parameters and optimizer state (default: ``atol``).
        param_rtol: of the parameters and optimizer state (default: ``rtol``).
        seed: the seed of the global generators before each build and before each run.

    Raises:
        AssertionError: the runs diverged. The message names the first point (``update 0`` is
            before any update), the call that made the update (``batches[i]``), the first
            quantity that differs (the loss, ``parameter '0.weight'``, ``optimizer state
            'momentum_buffer' of parameter ...``), how far apart it is, and how many more
            entries differ there.
        ConfigError: a factory returned something other than ``(step, state)``, both runs
            share a model or optimizer, or a tolerance is not a number >= 0.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> def build():
        ...     model = torch.nn.Linear(3, 1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     step = make_train_step(lambda m, b: m(b).pow(2).mean())
        ...     return step, TrainState.create(model=model, optimizer=opt)
        >>> assert_steps_equivalent(build, build, [torch.ones(4, 3)] * 3)
        >>> assert_steps_equivalent(build, build, [torch.ones(4, 3)] * 3,
        ...                         loss_atol=1e-7, param_atol=1e-6)
    """
    caller = "assert_steps_equivalent"
    tol = tolerance(
        caller, atol, rtol, loss_atol=loss_atol, loss_rtol=loss_rtol,
        param_atol=param_atol, param_rtol=param_rtol,
    )  # fmt: skip
    batches = list(batches)
    with global_rng_kept():
        step_a, state_a = build_seeded(build_a, seed, caller)
        step_b, state_b = build_seeded(build_b, seed, caller)
        check_separate([state_a, state_b], caller, "build_a and build_b")
        seed_all(seed)
        start = capture_rng()
        parted = _lockstep_by_update(
            Run(list_calls(step_a, state_a, batches), start),
            Run(list_calls(step_b, state_b, batches), start),
            (state_a, state_b),
            tol,
            names=("A", "B"),
            caller=caller,
        )
    if parted is None:
        return
    where = _where(parted, _on(len(batches)), _on(len(batches)))
    raise AssertionError(
        f"{caller}: A ({_name(build_a)}) and B ({_name(build_b)}) diverged first {where}: "
        f"{parted.divergence}. Compared {_ORDER}; everything before this point agreed."
        + _hint_initial(parted)
    )


def assert_accumulation_exact(
    build: Build,
    batches: Sequence[Any],
    k: int,
    *,
    concat: Callable[[Sequence[Any]], Any] | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-6,
    loss_atol: float | None = None,
    loss_rtol: float | None = None,
    param_atol: float | None = None,
    param_rtol: float | None = None,
    seed: int = 0,
) -> None:
    """Assert that ``accumulate(step, k)`` over k micro-batches equals one step over their
    concatenation (law 2): the test of a token-weighted ``loss_fn``.

    ``batches`` is cut into windows of ``k`` micro-batches (the last may be shorter: it is
    flushed and must equal one step over what it held). Run A trains ``accumulate(step, k)``
    on the micro-batches; run B trains the unaccumulated step on each window concatenated.
    They are compared after every update as in :func:`assert_steps_equivalent`.

    The model must compute the same thing on a batch split in k: no dropout (k small masks
    are not one big mask) and no batch statistics (BatchNorm in train mode).

    Args:
        build: ``() -> (step, state)`` for the UNaccumulated step (e.g.
            ``make_train_step(loss_fn)``, possibly clipped); called once per run.
        batches: the micro-batches, in order.
        k: micro-batches per update, an int >= 1.
        concat: ``concat(micro_batches) -> batch``; the default, :func:`concat_batches`,
            concatenates tensors (also inside tuples, lists and dicts) along dim 0.
        atol: absolute tolerance (summing in another order rounds differently).
        rtol: relative tolerance.
        loss_atol: absolute tolerance of the losses (default: ``atol``).
        loss_rtol: relative tolerance of the losses (default: ``rtol``).
        param_atol: of the parameters and optimizer state (default: ``atol``).
        param_rtol: of the parameters and optimizer state (default: ``rtol``).
        seed: the seed of the global generators before each build and before each run.

    Raises:
        AssertionError: the runs diverged: where, and what. When ``loss_fn`` returned a plain
            scalar (a mean over its micro-batch), the message says that this is per-token vs
            per-micro-batch averaging and how to return ``(loss_sum, num_targets)`` instead.
        ConfigError: bad ``k`` or ``batches``, or a ``build`` that is not ``(step, state)``.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> def loss_fn(model, batch):       # token-weighted: (sum, count)
        ...     x, y = batch
        ...     return (model(x) - y).pow(2).sum(), y.numel()
        >>> def build():
        ...     model = torch.nn.Linear(3, 1).double()
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     return make_train_step(loss_fn), TrainState.create(model=model, optimizer=opt)
        >>> micro = [(torch.randn(n, 3).double(), torch.randn(n, 1).double()) for n in (1, 4, 2)]
        >>> assert_accumulation_exact(build, micro, 3)
    """
    caller = "assert_accumulation_exact"
    tol = tolerance(
        caller, atol, rtol, loss_atol=loss_atol, loss_rtol=loss_rtol,
        param_atol=param_atol, param_rtol=param_rtol,
    )  # fmt: skip
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{caller}: k={describe(k)}; pass the micro-batches per update, >= 1.")
    batches = list(batches)
    if not batches:
        raise ConfigError(f"{caller}: batches is empty; pass at least k={k} micro-batches.")
    join = concat if concat is not None else concat_batches
    windows = [batches[i : i + k] for i in range(0, len(batches), k)]
    with global_rng_kept():
        step_a, state_a = build_seeded(build, seed, caller)
        step_b, state_b = build_seeded(build, seed, caller)
        check_separate([state_a, state_b], caller, "build")
        joined = [join(window) for window in windows]
        seed_all(seed)
        start = capture_rng()
        names = (f"accumulate(step, {k})", "the concatenated batch")
        parted = _lockstep_by_update(
            Run(list_calls(accumulate(step_a, k), state_a, batches), start),
            Run(list_calls(step_b, state_b, joined), start),
            (state_a, state_b),
            tol,
            names=names,
            caller=caller,
        )
    if parted is None:
        return
    where = _where(parted, _on(len(batches)), lambda i: _window(windows, i, k))
    raise AssertionError(
        f"{caller}: {names[0]} over micro-batches and one step over each window of {k} "
        f"concatenated diverged first {where}: {parted.divergence}. Compared {_ORDER}."
        + (_hint_averaging(parted, windows, k) if parted.update > 0 else _hint_initial(parted))
    )


def concat_batches(batches: Sequence[Any]) -> Any:
    """One batch holding ``batches`` in order: tensors are concatenated along dim 0, tuples,
    lists, named tuples and dicts element by element.

    It is the default ``concat=`` of :func:`assert_accumulation_exact`: the one batch that
    a window of micro-batches must train like.

    Args:
        batches: a non-empty sequence of batches of one layout (the first batch's structure
            and container types are used for the result).

    Returns:
        A batch of the same structure as ``batches[0]``, each tensor the concatenation of the
        corresponding tensors of ``batches``.

    Raises:
        ConfigError: a leaf that is not a tensor with at least one dimension (pass your own
            ``concat=`` to :func:`assert_accumulation_exact` for such layouts).

    Example:
        >>> import torch
        >>> batch = concat_batches([{"x": torch.zeros(2, 3)}, {"x": torch.ones(1, 3)}])
        >>> batch["x"].shape
        torch.Size([3, 3])
        >>> inputs, target = concat_batches([(torch.zeros(2, 3), torch.tensor([0, 1])),
        ...                                  (torch.ones(1, 3), torch.tensor([2]))])
        >>> target
        tensor([0, 1, 2])
    """
    first = batches[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(list(batches))
    if isinstance(first, Mapping):
        return type(first)({key: concat_batches([b[key] for b in batches]) for key in first})  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # a named tuple
        return type(first)(*(concat_batches([b[i] for b in batches]) for i in range(len(first))))
    if isinstance(first, tuple | list):
        return type(first)(concat_batches([b[i] for b in batches]) for i in range(len(first)))
    raise ConfigError(
        f"concat_batches cannot concatenate {describe(first)}: only tensors with a batch "
        "dimension (also inside tuples, lists and dicts) are joined along dim 0. Pass your own: "
        "assert_accumulation_exact(..., concat=lambda micro: MyBatch.join(micro))."
    )


@dataclasses.dataclass(frozen=True)
class _Parted:
    """Where two runs parted: the update (0 = before any) and the calls that made it."""

    update: int
    a: Call | None
    b: Call | None
    divergence: Divergence


def _lockstep_by_update(
    run_a: Run,
    run_b: Run,
    initial: tuple[Any, Any],
    tol: Tolerance,
    *,
    names: tuple[str, str],
    caller: str,
) -> _Parted | None:
    state_a, state_b = initial
    atol, rtol = tol.params
    found = first_divergence(
        parameter_values(state_a) + optimizer_values(state_a),
        parameter_values(state_b) + optimizer_values(state_b),
        atol=atol,
        rtol=rtol,
        names=names,
    )
    if found is not None:
        return _Parted(0, None, None, found)
    update = 0
    while True:
        a, b = run_a.next_update(), run_b.next_update()
        if a is None and b is None:
            return None
        update += 1
        if a is None or b is None:
            for run in (run_a, run_b):  # count every update of the longer run
                while run.next_update() is not None:
                    pass
            detail = f"{names[0]} made {run_a.updates} and {names[1]} made {run_b.updates}"
            return _Parted(update, a, b, Divergence("the number of updates", detail))
        found = first_divergence_after_update(a, b, tol, names, caller)
        if found is not None:
            return _Parted(update, a, b, found)


def _on(count: int) -> Callable[[int], str]:
    return lambda i: f"the call on batches[{i}]" if i < count else "the flush after the last batch"


def _window(windows: list[list[Any]], index: int, k: int) -> str:
    start = index * k
    return f"batches[{start}:{start + len(windows[index])}] concatenated"


def _where(
    parted: _Parted, describe_a: Callable[[int], str], describe_b: Callable[[int], str]
) -> str:
    if parted.update == 0:
        return "before any update"
    a = "no such update" if parted.a is None else describe_a(parted.a.index)
    b = "no such update" if parted.b is None else describe_b(parted.b.index)
    return f"at update {parted.update} (made by {a} in the first run; by {b} in the second)"


def _name(build: Any) -> str:
    return str(getattr(build, "__qualname__", None) or type(build).__name__)


def _hint_initial(parted: _Parted) -> str:
    if parted.update != 0:
        return ""
    return (
        " The runs start from different values: both builds run right after "
        "torch.manual_seed(seed), so create the model the same way in both (same modules in "
        "the same order, no weights loaded from elsewhere), and the optimizer with the same "
        "settings."
    )


def _hint_averaging(parted: _Parted, windows: list[list[Any]], k: int) -> str:
    assert parted.a is not None and parted.b is not None
    window = windows[parted.update - 1] if parted.update <= len(windows) else []
    count_a = float(parted.a.out.num_targets)
    count_b = float(parted.b.out.num_targets)
    if not (count_b == 1 and count_a == len(window) > 1):
        return (
            f" The window's target counts were {count_a:g} (accumulated) and {count_b:g} "
            "(concatenated). Check that loss_fn returns the SUM of the per-target losses and "
            "the number of targets in it, (loss_sum, num_targets), and that the model computes "
            "the same on a batch split in pieces (no dropout, no BatchNorm batch statistics)."
        )
    sizes = [_leading_size(batch) for batch in window]
    if None not in sizes and len(set(sizes)) > 1:
        held = f"the micro-batches of this window hold {sizes} samples"
    else:
        held = (
            f"the micro-batches of this window hold equal numbers of samples ({sizes}): if "
            "loss_fn averages over targets whose number varies inside them (masked or padded "
            "tokens), that is the difference; if not, it is rounding and atol/rtol are too "
            "tight"
        )
    return (
        " This is the symptom of per-token vs per-micro-batch averaging: loss_fn returned a "
        f"plain scalar, a mean over its own micro-batch, so accumulate(step, {k}) gives every "
        "micro-batch the same weight, while the concatenated batch gives every target the same "
        "weight. They "
        f"agree only when every micro-batch holds the same number of targets; here {held}. "
        "Return the sum and the count instead and steplib divides once per window by the "
        "total: return (loss_per_target * mask).sum(), mask.sum()."
    )


def _leading_size(batch: Any) -> int | None:
    """The size of dim 0 of the first tensor in ``batch`` (None: no such tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, Iterable) and not isinstance(items, str | bytes):
        for item in items:
            size = _leading_size(item)
            if size is not None:
                return size
    return None

"""The machinery the assertions share: seeded runs advanced in lockstep, and comparisons that
say where two runs parted. Internal; the public functions are in the sibling modules.

Why lockstep rather than "run A, then run B, then compare": comparing the live tensors of two
runs after each update needs one model's worth of memory per run, not one per update. Each
:class:`Run` draws from its own copy of the global generators (swapped in around each call), so
two runs interleaved in one process see exactly the random numbers each would see alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import torch

from steplib.errors import ConfigError, describe, non_negative
from steplib.seeding import RngState, capture_rng, restore_rng

try:  # numpy is optional, as in steplib.seeding
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the dev extra
    np = None  # type: ignore[assignment]

Build = Callable[[], tuple[Any, Any]]  # () -> (step, state)
Calls = Generator[tuple[Any, Any], None, Any]  # (state, output) after every call of a step


def seed_all(seed: int) -> None:
    """Seed every global generator a step may draw from: torch (CPU and CUDA), numpy, random."""
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


@contextlib.contextmanager
def global_rng_kept() -> Iterator[None]:
    """Give the global generators back as they were: a test helper must not shift the random
    numbers of whatever the test does after it."""
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)


def build_seeded(build: Build, seed: int, caller: str) -> tuple[Any, Any]:
    """``build()`` after seeding, checked to be a ``(step, state)`` pair."""
    seed_all(seed)
    built = build()
    if not (isinstance(built, tuple) and len(built) == 2 and callable(built[0])):
        raise ConfigError(
            f"{caller}: build() returned {describe(built)}; it must return (step, state), "
            "e.g. def build(): ...; return make_train_step(loss_fn), TrainState.create(...)."
        )
    state = built[1]
    if not isinstance(getattr(state, "model", None), torch.nn.Module) or not isinstance(
        getattr(state, "optimizer", None), torch.optim.Optimizer
    ):
        raise ConfigError(
            f"{caller}: build() returned a state {describe(state)} without a .model and an "
            ".optimizer; return TrainState.create(model=..., optimizer=...) as the state."
        )
    return built


def check_separate(states: Sequence[Any], caller: str, what: str) -> None:
    """Refuse runs that share a model or an optimizer: they would train one object twice."""
    for field in ("model", "optimizer"):
        objects = [getattr(s, field) for s in states]
        if len({id(o) for o in objects}) < len(objects):
            raise ConfigError(
                f"{caller}: {what} returned the same {field} object more than once, so the runs "
                f"would train one {field} together. Create the {field} inside build(), so that "
                "every call returns a new one."
            )


def is_update(out: Any) -> bool:
    """Whether a call closed an accumulation window (an update, applied or skipped). An output
    without ``did_update`` (a hand-written step) counts every call as an update."""
    did = getattr(out, "did_update", None)
    if did is None:
        return True
    return bool(did) or bool(getattr(out, "skipped", False))


def list_calls(step: Any, state: Any, batches: Iterable[Any]) -> Calls:
    """One pass of ``step`` over ``batches``, then ``step.flush`` (when the step has one) so
    that a last, shorter window is updated too."""
    for batch in batches:
        state, out = step(state, batch)
        yield state, out
    flush = getattr(step, "flush", None)
    if callable(flush):
        state, out = flush(state)
        if out is not None:
            yield state, out


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a step in a :class:`Run`: its 0-based index, what it returned, and whether
    it closed a window."""

    index: int
    state: Any
    out: Any
    update: bool


class Run:
    """A training run advanced one call (or one update) at a time, with its own global RNG."""

    def __init__(self, calls: Calls, rng: RngState) -> None:
        self._calls = calls
        self._rng = rng
        self.count = 0  # calls made so far
        self.updates = 0
        self.final: Any = None  # what the calls generator returned (iterate's final state)

    def next_call(self) -> Call | None:
        restore_rng(self._rng)
        try:
            state, out = next(self._calls)
        except StopIteration as done:
            self.final = done.value
            return None
        finally:
            self._rng = capture_rng()
        call = Call(self.count, state, out, is_update(out))
        self.count += 1
        self.updates += call.update
        return call

    def next_update(self) -> Call | None:
        call = self.next_call()
        while call is not None and not call.update:
            call = self.next_call()
        return call


# ---------------------------------------------------------------------------------------------
# Comparisons. A "value list" is [(label, value)] in a fixed order; two runs are compared entry
# by entry, and the first entry that differs is reported with how far apart it is.
# ---------------------------------------------------------------------------------------------

Values = list[tuple[str, Any]]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first entry that differs at one point of two runs, and how many more differ there."""

    label: str
    detail: str
    more: int = 0

    def __str__(self) -> str:
        more = f"; {self.more} more entr{'y' if self.more == 1 else 'ies'} differ here" * bool(
            self.more
        )
        return f"{self.label} differs: {self.detail}{more}"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``(atol, rtol)`` for the losses and for the parameters (and the optimizer state)."""

    loss: tuple[float, float]
    params: tuple[float, float]


def tolerance(caller: str, atol: float, rtol: float, **given: float | None) -> Tolerance:
    """The tolerances of ``caller``: ``loss_atol``, ``loss_rtol``, ``param_atol`` and
    ``param_rtol`` where given, else ``atol`` / ``rtol`` (one tolerance for everything).

    A loss is one number rounded once per update, the parameters are many summed over all the
    updates so far: they rarely need the same tolerance.

    Raises:
        ConfigError: a tolerance that is not a finite number >= 0.
    """
    for label, value in {"atol": atol, "rtol": rtol, **given}.items():
        if value is not None:
            non_negative(caller, label, value)

    def pick(label: str, default: float) -> float:
        value = given.get(label)
        return default if value is None else value

    return Tolerance(
        loss=(pick("loss_atol", atol), pick("loss_rtol", rtol)),
        params=(pick("param_atol", atol), pick("param_rtol", rtol)),
    )


def parameter_values(state: Any) -> Values:
    """Every parameter, then every buffer (BatchNorm's running statistics: trained state too,
    which a step that runs the model once too often moves while the parameters agree)."""
    values = [(f"parameter {name!r}", p.detach()) for name, p in state.model.named_parameters()]
    return values + [(f"buffer {name!r}", b) for name, b in state.model.named_buffers()]


def optimizer_values(state: Any) -> Values:
    """The optimizer's hyperparameters (the LR a scheduler sets) and its per-parameter state,
    labelled by the parameter's name in the model."""
    optimizer = state.optimizer
    names = {id(p): name for name, p in state.model.named_parameters()}
    values: Values = [("the optimizer's type", type(optimizer).__name__)]
    for g, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            if key != "params" and _hyperparameter(group[key]):
                values.append((f"optimizer param_groups[{g}][{key!r}]", group[key]))
        for i, p in enumerate(group["params"]):
            name = names.get(id(p), f"#{i} of group {g}")
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                values.append((f"optimizer state {key!r} of parameter {name!r}", value))
    return values


def _hyperparameter(value: Any) -> bool:
    """A number that shapes the update (lr, momentum, betas, ...); implementation switches
    (``foreach``, ``fused``: bools or None) are not compared."""
    if isinstance(value, tuple):
        return all(_hyperparameter(v) for v in value)
    return isinstance(value, int | float | torch.Tensor) and not isinstance(value, bool)


def loss_value(out: Any, caller: str) -> Values:
    loss = getattr(out, "loss", None)
    if loss is None:
        raise ConfigError(
            f"{caller}: the step returned an output without .loss ({describe(out)}); return "
            "(state, StepOutput) as steplib steps do, or an object with a .loss tensor."
        )
    return [("the loss", loss.detach() if isinstance(loss, torch.Tensor) else loss)]


def first_divergence(
    a: Values, b: Values, *, atol: float, rtol: float, names: tuple[str, str]
) -> Divergence | None:
    """The first entry of ``a`` and ``b`` (matched by position) that differs, or ``None``."""
    if len(a) != len(b):
        labels_a, labels_b = [label for label, _ in a], [label for label, _ in b]
        longer = labels_a if len(a) > len(b) else labels_b
        extra = next(
            (x for x, y in zip(labels_a, labels_b, strict=False) if x != y),
            longer[min(len(a), len(b))],
        )
        return Divergence(
            "the set of compared entries",
            f"{names[0]} has {len(a)} and {names[1]} has {len(b)} (first unmatched: {extra})",
        )
    found: Divergence | None = None
    more = 0
    for (label, x), (label_b, y) in zip(a, b, strict=True):
        detail = value_difference(x, y, atol=atol, rtol=rtol, names=names)
        if detail is None:
            continue
        if found is None:
            if label_b != label:
                label = f"{label} (in {names[1]}: {label_b})"
            found = Divergence(label, detail)
        else:
            more += 1
    return None if found is None else dataclasses.replace(found, more=more)


def value_difference(
    x: Any, y: Any, *, atol: float, rtol: float, names: tuple[str, str]
) -> str | None:
    """How ``x`` and ``y`` differ beyond the tolerance, in words; ``None`` when they agree.

    With ``atol=rtol=0`` this is exact equality (NaN equals NaN: a run that is NaN in the same
    places as the other agrees with it).
    """
    a, b = names
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return (
                f"shape {tuple(x.shape)} {x.dtype} in {a} vs shape {tuple(y.shape)} {y.dtype} "
                f"in {b}"
            )
        y = y.to(x.device)
        if x.is_floating_point() or x.is_complex():
            close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        else:
            close = x == y
        if bool(close.all()):
            return None
        gap = (x.double() - y.double()).abs().masked_fill(close, 0)
        if x.ndim == 0:
            gap_text = f"abs difference {gap.item():.3g}"
            return f"{x.item():.9g} in {a} vs {y.item():.9g} in {b} ({gap_text})"
        worst = int(gap.nan_to_num(math.inf).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), x.shape))
        return (
            f"max abs difference {gap.flatten()[worst].item():.3g} at index {index} "
            f"({x.flatten()[worst].item():.9g} in {a} vs {y.flatten()[worst].item():.9g} in {b}), "
            f"{int((~close).sum())} of {x.numel()} elements differ (atol={atol}, rtol={rtol})"
        )
    numbers = (int, float)
    if isinstance(x, numbers) and isinstance(y, numbers) and not isinstance(x, bool):
        if math.isclose(x, y, rel_tol=rtol, abs_tol=atol) or (math.isnan(x) and math.isnan(y)):
            return None
        return f"{x!r} in {a} vs {y!r} in {b} (abs difference {abs(x - y):.3g})"
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
        if type(x) is type(y):
            return f"{x!r} in {a} vs {y!r} in {b}"
        return f"{describe(x)} in {a} vs {describe(y)} in {b}"
    return None


def first_divergence_after_update(
    a: Call, b: Call, tol: Tolerance, names: tuple[str, str], caller: str
) -> Divergence | None:
    """The first entry of two runs' calls that differs after an update: the loss (at the loss
    tolerance), then the parameters and optimizer state (at theirs); ``None`` if none."""
    loss = first_divergence(
        loss_value(a.out, caller), loss_value(b.out, caller), atol=tol.loss[0],
        rtol=tol.loss[1], names=names,
    )  # fmt: skip
    params = first_divergence(
        state_values(a.state), state_values(b.state), atol=tol.params[0],
        rtol=tol.params[1], names=names,
    )  # fmt: skip
    if loss is None or params is None:
        return loss or params
    return dataclasses.replace(loss, more=loss.more + 1 + params.more)


def state_values(state: Any) -> Values:
    return parameter_values(state) + optimizer_values(state)

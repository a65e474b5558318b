"""``verify_resume``: an interrupted run (save, rebuild from scratch, load, continue) must equal
the uninterrupted one bit for bit (law 9), and a failure says what the checkpoint missed."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from steplib.checkpoint import load, save
from steplib.data import resumable_loader
from steplib.errors import ConfigError, describe
from steplib.loop import iterate
from steplib.loop_checks import limits_reached
from steplib.seeding import capture_rng
from steplib.testing.runs import (
    Build,
    Call,
    Calls,
    Divergence,
    Run,
    Values,
    build_seeded,
    check_separate,
    first_divergence,
    global_rng_kept,
    loss_value,
    optimizer_values,
    parameter_values,
    seed_all,
)

_CALLER = "verify_resume"
_SCRAMBLE = 0x5EED  # added to the seed: generators that a resume forgets are left elsewhere
_NAMES = ("the uninterrupted run", "the resumed run")


def verify_resume(
    build: Build,
    batches: Sequence[Any] | Callable[[], Iterable[Any]],
    *,
    save_at: int,
    url: str | None = None,
    max_steps: int | None = None,
    max_epochs: int | None = None,
    seed: int = 0,
) -> None:
    """Assert that a run interrupted after update ``save_at`` and resumed from a checkpoint
    equals the uninterrupted run bit for bit (law 9).

    Two runs are driven by :func:`steplib.iterate`, in lockstep and each with its own global
    generators, from ``build()`` after ``seed_all(seed)``:

    * uninterrupted: from start to end;
    * interrupted: to update ``save_at``; ``steplib.checkpoint.save(state, url, data=loader,
      step=step)``; then everything is rebuilt from scratch (``build()`` again and a new
      loader: new objects, nothing shared), the global generators are scrambled (a resume that
      does not restore them fails), ``load(...)`` and the run continues to the end.

    After every call the counters and the loss are compared, after every update also every
    parameter and buffer, the optimizer (hyperparameters and state), the scheduler, the scaler and
    ``state.extras``; and the counters of the final states.

    Data: ``batches`` is either a list of batches (fed in order, one pass per epoch; its
    position is checkpointed like a loader's) or a zero-argument factory returning a fresh
    stateful loader, e.g. ``lambda: steplib.data.resumable_loader(dataset, batch_size=8,
    seed=0)``: called once per run, so the resumed run gets a new loader and only the
    checkpoint tells it where to continue. Pass a factory, not a loader object.

    Args:
        build: ``() -> (step, state)`` (a steplib ``Step`` and its ``TrainState``), creating a
            new model, optimizer, scheduler and scaler on every call.
        batches: a list of batches, or a factory of a stateful loader (see above).
        save_at: the update after which the interrupted run saves, >= 1 and before the last.
        url: the directory (local path or fsspec URL) to save into; a temporary directory,
            removed afterwards, when ``None``. The checkpoint is left in ``url`` when given.
        max_steps: stop both runs after this many updates, as in ``steplib.run``.
        max_epochs: stop both runs after this many epochs; one epoch when neither is given.
        seed: the seed of the global generators before each build and each run.

    Raises:
        AssertionError: the runs differ. The message names the first call that differs
            (before or after the resume, and how long after), what differs (a counter, the
            loss, ``parameter '0.weight'``, an optimizer/scheduler/scaler entry) and the likely
            missing piece: a different batch means the data position was lost; the same batch
            and parameters with another loss means the RNG states were lost.
        ConfigError: a bad ``save_at`` (not reached, or the last update), ``batches`` that is
            a loader object or makes a loader without ``state_dict``, or a ``build`` that
            returns shared objects.

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step
        >>> def build():
        ...     model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ...     step = make_train_step(lambda m, b: m(b).pow(2).mean())
        ...     return step, TrainState.create(model=model, optimizer=opt)
        >>> verify_resume(build, [torch.randn(2, 3) for _ in range(6)], save_at=3)
    """
    if isinstance(save_at, bool) or not isinstance(save_at, int) or save_at < 1:
        raise ConfigError(
            f"{_CALLER}(save_at=...) received {describe(save_at)}; pass the update after which "
            "to checkpoint, an int >= 1 and less than the run's number of updates."
        )
    make_data = _data_factory(batches)
    limits = _Limits(max_steps, 1 if max_steps is None and max_epochs is None else max_epochs)
    with global_rng_kept(), _directory(url) as directory:
        step, state = build_seeded(build, seed, _CALLER)
        feed = _Feed(make_data())
        leg = _Interrupted(build, make_data, save_at, directory, limits, seed, state)
        first_step, first_state = build_seeded(build, seed, _CALLER)
        check_separate([state, first_state], _CALLER, "build")
        seed_all(seed)
        start = capture_rng()
        uninterrupted = Run(limits.iterate(step, state, feed), start)
        interrupted = Run(leg.calls(first_step, first_state), start)
        parted = _lockstep_by_call(uninterrupted, interrupted, feed, leg)
    if parted is not None:
        raise AssertionError(_message(parted, leg, save_at))


@dataclasses.dataclass(frozen=True)
class _Limits:
    """When both runs stop, as in ``steplib.run``."""

    max_steps: int | None
    max_epochs: int | None

    def iterate(self, step: Any, state: Any, data: Any) -> Calls:
        return iterate(step, state, data, max_steps=self.max_steps, max_epochs=self.max_epochs)

    def __str__(self) -> str:
        return f"max_steps={self.max_steps}, max_epochs={self.max_epochs}"


@dataclasses.dataclass(frozen=True)
class _Parted:
    call: Call | None  # the uninterrupted run's call where they parted (None: at the end)
    divergence: Divergence
    same_batch: bool


class _Feed:
    """The data as the loop sees it, remembering the last batch (to tell a lost data position
    from lost random numbers). ``len()`` is the loader's: the loop closes the last window."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data
        self.last: Any = None

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data:
            self.last = batch
            yield batch

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]  # unsized: TypeError, as the loop expects


class _Interrupted:
    """The interrupted run as one stream of calls: first leg, save, rebuild, load, second leg."""

    def __init__(
        self,
        build: Build,
        make_data: Callable[[], Any],
        save_at: int,
        directory: str,
        limits: _Limits,
        seed: int,
        other: Any,
    ) -> None:
        self.build, self.make_data, self.save_at = build, make_data, save_at
        self.directory, self.limits, self.seed, self.other = directory, limits, seed, other
        self.feed: _Feed | None = None
        self.url: str | None = None
        self.resumed_at: int | None = None  # index of the first call after the resume
        self.count = 0

    def calls(self, step: Any, state: Any) -> Calls:
        data = self.make_data()
        self.feed = _Feed(data)
        first = self.limits.iterate(step, state, self.feed)
        for state, out in first:
            self.count += 1
            yield state, out
            if state.step >= self.save_at:
                break
        else:
            raise ConfigError(
                f"{_CALLER}(save_at={self.save_at}): the run made only {state.step} updates "
                f"({self.limits}), so it never reached update {self.save_at}. Pass a "
                "smaller save_at, or more batches or epochs."
            )
        self.url = save(state, self.directory, data=data, step=step)
        first.close()
        # A new process: new objects from build(), a new loader, and global generators left
        # wherever the new process had them. Only the checkpoint connects the two legs.
        step, fresh = build_seeded(self.build, self.seed, _CALLER)
        check_separate([state, fresh, self.other], _CALLER, "build")
        data = self.make_data()
        seed_all(self.seed + _SCRAMBLE)
        state = load(self.url, fresh, data=data, step=step)
        if limits_reached(state, self.limits.max_steps, self.limits.max_epochs):  # it would warn
            raise _nothing_to_verify(self.save_at)
        self.feed = _Feed(data)
        self.resumed_at = self.count
        return (yield from self.limits.iterate(step, state, self.feed))


def _lockstep_by_call(
    uninterrupted: Run, interrupted: Run, feed: _Feed, leg: _Interrupted
) -> _Parted | None:
    while True:
        a, b = uninterrupted.next_call(), interrupted.next_call()
        if a is None and b is None:
            break
        if a is None or b is None:
            for run in (uninterrupted, interrupted):
                while run.next_call() is not None:
                    pass
            detail = f"{uninterrupted.count} calls vs {interrupted.count} in the resumed run"
            return _Parted(a, Divergence("the number of step calls", detail), True)
        full = a.update or b.update
        found = _exact(_values(a, full), _values(b, full))
        if found is not None:
            same = leg.feed is not None and _same_batch(feed.last, leg.feed.last)
            return _Parted(a, found, same)
    if leg.resumed_at is not None and leg.resumed_at == interrupted.count:
        raise _nothing_to_verify(leg.save_at)
    found = _exact(_counters(uninterrupted.final), _counters(interrupted.final))
    return None if found is None else _Parted(None, found, True)


def _nothing_to_verify(save_at: int) -> ConfigError:
    return ConfigError(
        f"{_CALLER}(save_at={save_at}): that is the run's last update, so nothing runs after "
        "the resume and nothing is verified. Pass a smaller save_at."
    )


def _exact(a: Values, b: Values) -> Divergence | None:
    return first_divergence(a, b, atol=0.0, rtol=0.0, names=_NAMES)


def _values(call: Call, full: bool) -> Values:
    values = _counters(call.state) + loss_value(call.out, _CALLER)
    if not full:
        return values
    state = call.state
    values += parameter_values(state) + optimizer_values(state)
    for name in ("scheduler", "scaler"):
        obj = getattr(state, name)
        if obj is not None:
            values += [(f"{name} state {k!r}", v) for k, v in sorted(obj.state_dict().items())]
    return values + [(f"state.extras[{k!r}]", v) for k, v in sorted(state.extras.items())]


def _counters(state: Any) -> Values:
    names = ("step", "micro_step", "epoch", "skipped_updates")
    values = [(f"the counter state.{name}", getattr(state, name)) for name in names]
    return [*values, ("the counter state.window.size", state.window.size)]


def _message(parted: _Parted, leg: _Interrupted, save_at: int) -> str:
    saved = f"saved at update {save_at} into {leg.url}"
    if parted.call is None:
        where = "in the final state"
    else:
        s = parted.call.state
        where = (
            f"at call {parted.call.index + 1} of the step (micro_step {s.micro_step}, step "
            f"{s.step} after it in the uninterrupted run)"
        )
    if leg.resumed_at is None or (parted.call is not None and parted.call.index < leg.resumed_at):
        return (
            f"{_CALLER}: the two runs differ {where}, before any checkpoint was taken, so the "
            f"resume is not the cause: {parted.divergence}. build() or the run is not "
            "deterministic: both builds run right after torch.manual_seed(seed); avoid "
            "nondeterministic kernels and data that shuffles from the global generator."
        )
    after = ""
    if parted.call is not None:
        after = f", the {_ordinal(parted.call.index - leg.resumed_at + 1)} call after the resume"
    return (
        f"{_CALLER}: the run resumed from the checkpoint {saved} diverged from the "
        f"uninterrupted run {where}{after}: {parted.divergence}. {_hint(parted)}"
    )


def _hint(parted: _Parted) -> str:
    label = parted.divergence.label
    if label.startswith("the counter") or label == "the number of step calls":
        return (
            "The counters or the data position were not restored: resume with the state that "
            "load() returns, and pass the loader as data= to save() and load()."
        )
    if label == "the loss" and not parted.same_batch:
        return (
            "The resumed run was fed another batch here than the uninterrupted run: the data "
            "position (or the shuffle order of later epochs) was not restored. Use "
            "steplib.data.resumable_loader and pass it as data= to save() and load()."
        )
    if label == "the loss":
        return (
            "It was fed the same batch and started from the same parameters (equal after the "
            "last update), so its random numbers differ: the RNG states (dropout, random "
            "augmentation) were not restored. steplib's save/load keep torch's, CUDA's, numpy's "
            "and random's global generators; a torch.Generator of your own must be saved too "
            "(save(..., extras={'gen': ...}) with an object that has state_dict())."
        )
    return (
        "The loss matched but the state after the update differs: the optimizer state, the LR "
        "scheduler, the gradient scaler, state.extras or the open accumulation window's "
        "gradients were not restored exactly."
    )


def _data_factory(batches: Any) -> Callable[[], Any]:
    if isinstance(batches, Sequence) and not isinstance(batches, str | bytes):
        items = list(batches)
        # The list as a loader whose position is checkpointed like any other: each item is a
        # batch (batch_size=None), passed on as it is, in order.
        return lambda: resumable_loader(
            items, batch_size=None, shuffle=False, collate_fn=_as_is, seed=0
        )
    if not callable(batches):
        raise ConfigError(
            f"{_CALLER} received batches={describe(batches)}: pass a list of batches, or a "
            "factory that builds a fresh loader, e.g. lambda: resumable_loader(dataset, "
            "batch_size=8, seed=0). A loader object itself cannot be rebuilt from scratch "
            "for the resumed run."
        )

    def make() -> Any:
        data = batches()
        if not (callable(getattr(data, "state_dict", None)) and hasattr(data, "load_state_dict")):
            raise ConfigError(
                f"{_CALLER}: the batches factory returned {describe(data)}, which has no "
                "state_dict() / load_state_dict(), so its position cannot be checkpointed. "
                "Return steplib.data.resumable_loader(dataset, batch_size=..., seed=0)."
            )
        return data

    return make


def _as_is(batch: Any) -> Any:
    return batch


@contextlib.contextmanager
def _directory(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="steplib-verify-resume-") as directory:
        yield directory


def _same_batch(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.shape == y.shape
            and x.dtype == y.dtype
            and torch.equal(x, y.to(x.device))
        )
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(_same_batch(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_same_batch(a, b) for a, b in zip(x, y, strict=True))
    return bool(x == y)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"

"""``Lineage``: the counters of the newest state of one optimizer, and the refusal of any other
state by a step or a save. Imports nothing from steplib but its errors.

Why it exists: a step returns a new ``TrainState``, but the parameters and their ``.grad``, the
optimizer's buffers, the scheduler and the scaler change in place, shared by every state of the
run. A state used again once a newer one exists (``new, _ = step(state, b)`` twice, the state
passed to a ``run`` that raised, the state a ``load`` replaced) would pair its counters and
accumulation window with weights and gradients they do not describe, and nothing would say so.

How: the states of one optimizer (one ``Lane`` of one ``TrainState.create``) share one
``Lineage``. Every state made with new counters records them there (``TrainState.replace``:
the step's own advance, a hand edit), and a step compares the state it receives: two integer
comparisons and an identity, no tensor read, no allocation. A ``load`` into any state of the
run, older or not, is how a run legitimately goes back (its weights are overwritten too), and
begins a new lineage (:func:`lineage_after_load`), which the run's ``Head`` then names: equal
counters do not make a state from before the load describe what the load put in place (a
window's loss and target count, the skip counters, the extras), so every state from before it
is refused, whatever its counters, until one has its counters set by hand.

A backward that raises (out of memory, a KeyboardInterrupt) may have added part of its
micro-batch's gradient to ``.grad`` before the counters moved: :func:`backward_failed` clears an
empty window's gradients (what ``optimizer.zero_grad()`` at the top of a plain loop does, so the
same state can be stepped again), and marks an open window's ``torn``: its earlier micro-batches'
gradients can no longer be told apart from the failed one's. A step that raises while it closes
a window (:func:`update_failed`) marks it torn too: the gradients were processed in place and
the update may have begun.
"""

from __future__ import annotations

from typing import Any

from steplib.errors import ConfigError


class Head:
    """Which lineage of one optimizer's run is the newest: shared by them all. A ``load``
    moves it to the new lineage it begins; new counters (a step's, a hand edit's) to theirs."""

    __slots__ = ("lineage",)

    def __init__(self, lineage: Lineage) -> None:
        self.lineage = lineage


class Lineage:
    """The counters (``step``, ``micro_step``) of the newest state of one optimizer: the ones
    its model, optimizer, scheduler and scaler, changed in place, have been advanced to.

    Shared by every state derived from one ``TrainState.create`` for that optimizer
    (``state.lane.lineage``) up to a ``load``, which begins a new one (``head``, shared, names
    the newest); a ``copy.deepcopy`` of a state is a run of its own.
    """

    __slots__ = ("head", "micro_step", "step", "torn", "window_grads")

    def __init__(self, head: Head | None = None) -> None:
        self.step = 0
        self.micro_step = 0
        self.torn = False  # a step raised part-way: .grad is what no state describes
        # The open window's gradients were left in .grad (FSDP2 keeps them elsewhere until the
        # window's last backward; after a load none is known): then .grad may not be cleared.
        self.window_grads = False
        self.head = Head(self) if head is None else head

    def record(self, step: int, micro_step: int) -> None:
        """New counters: the state that has them is the newest of the run (a hand edit of a
        state from before a load makes it so again)."""
        self.step, self.micro_step, self.torn = step, micro_step, False
        self.head.lineage = self

    def __repr__(self) -> str:
        torn = ", torn" if self.torn else ""
        return f"Lineage(step={self.step}, micro_step={self.micro_step}{torn})"


def check_newest(state: Any, caller: str) -> None:
    """Raise ``ConfigError`` unless ``state`` (a ``TrainState``) holds the counters of the newest
    state of its optimizer: every step calls it before it changes anything in place, and a save
    before it records the counters."""
    lineage: Lineage = state.lane.lineage
    if (
        state.micro_step == lineage.micro_step
        and state.step == lineage.step
        and not lineage.torn
        and lineage.head.lineage is lineage
    ):
        if state.window.size and lineage.window_grads and not holds_grads(state.optimizer):
            raise _cleared_window(state, caller)
        return
    name = state.lane.name
    whose = "" if name is None else f" of optimizer {name!r}"
    loaded = ""
    if lineage.head.lineage is not lineage:
        lineage = lineage.head.lineage
        loaded = (
            ", on another line of states than this one: a load made after this state (or "
            "state.replace(step=..., micro_step=...) on a state from before a load) put in "
            "place weights, .grad, an accumulation window and optimizer state that this state "
            "does not describe, even with the same counters"
        )
    elif lineage.torn:
        raise ConfigError(
            f"{caller} received a TrainState{whose} of a run whose last step raised part-way "
            f"(at micro-batch {lineage.micro_step}, update {lineage.step}): in a backward "
            "inside an open accumulation window, or while closing a window (its gradients "
            "processed in place, its update perhaps begun). .grad, and the parameters if the "
            "update began, are no longer what any state describes: training or saving on "
            "would be silently wrong. Load the last checkpoint (state = load(url, state), or "
            "resume_from), or drop the window: state.model.zero_grad(set_to_none=True); state "
            "= state.replace(window=steplib.state.EMPTY_WINDOW, micro_step=state.micro_step - "
            "state.window.size)."
        )
    raise ConfigError(
        f"{caller} received a TrainState{whose} at update {state.step} (micro-batch "
        f"{state.micro_step}), but the newest state of the same run is at update {lineage.step} "
        f"(micro-batch {lineage.micro_step}){loaded}. The model's parameters and .grad, the "
        "optimizer, the scheduler and the scaler change in place and are shared by both: this "
        "state's counters and accumulation window no longer describe them, so training or "
        "saving from it would be silently wrong (two updates counted as one, a window that "
        "counts fewer micro-batches than .grad holds, a checkpoint whose counters do not match "
        "its weights). "
        "Go on from the state the last call returned: `state, out = step(state, batch)`, not "
        "two calls on one state; `state = run(...)`. After a run or step that raised: the "
        'state the run\'s exception event saw (register `seen = []; events.on("exception", '
        "lambda e: seen.append(e.state))` before the run, then `state = seen[-1]`; a loop "
        "`for state, out in iterate(...)` leaves `state` the newest only when the step itself "
        "raised, one call behind when a handler did: an evaluation, a save, a log), or load "
        "the last checkpoint (state = load(url, state)), or start over with "
        "TrainState.create(...). To set "
        "counters by hand: state.replace(step=..., micro_step=...), not dataclasses.replace "
        "(which the run does not see)."
    )


def holds_grads(optimizer: Any) -> bool:
    """Whether a parameter of ``optimizer`` holds a gradient (host only: no tensor is read)."""
    return any(p.grad is not None for g in optimizer.param_groups for p in g["params"])


def note_window_grads(state: Any) -> None:
    """After a micro-batch that left ``state``'s window open: whether its gradients are in
    ``.grad``, so that the next step or save can tell that they were cleared since."""
    state.lane.lineage.window_grads = holds_grads(state.optimizer)


def _cleared_window(state: Any, caller: str) -> ConfigError:
    size = state.window.size
    return ConfigError(
        f"{caller} received a TrainState whose accumulation window holds {size} "
        f"micro-batch(es) (window.size={size}), but no parameter of its optimizer holds a "
        "gradient any more: .grad was cleared inside the open window (optimizer.zero_grad() "
        "or model.zero_grad(), as a loop does at an epoch's start). Its next update would "
        "count those micro-batches' losses and targets without their gradients: a silently "
        "smaller update. To drop the window, as that zero_grad meant: state = "
        "state.replace(window=steplib.state.EMPTY_WINDOW) after the zero_grad. To apply it "
        "instead: call step.flush(state) (or step(state, batch, close_window=True) on the "
        "epoch's last batch) before the zero_grad."
    )


def lineage_after_load(lineage: Lineage) -> Lineage:
    """The new lineage of the state a ``load`` returns (``lineage``: the state's it loaded
    into), named the newest by the run's ``Head``: every state from before the load is refused
    from then on, even one whose counters equal the loaded ones (a run rewound and stepped on
    from there)."""
    new = Lineage(lineage.head)
    new.head.lineage = new
    return new


def backward_failed(state: Any) -> None:
    """Called when a step's backward raised, with the state the step received: part of its
    micro-batch's gradient may be in ``.grad``. An empty window's gradients are cleared (the
    state is then whole: step it again); an open window's lineage is marked ``torn``, so that
    the next step or save of the run refuses instead of updating with them."""
    if state.window.size == 0:  # this optimizer's alone: a GAN's other window may be open
        state.optimizer.zero_grad(set_to_none=True)
    else:
        state.lane.lineage.torn = True


def update_failed(state: Any) -> None:
    """Called when a step raised while it closed a window (``state``: the one it closed): the
    gradients processed in place, the update perhaps begun. The run's next step or save
    refuses, naming the ways out.

    A float16 ``GradScaler`` whose ``unscale_`` ran for this window marks the optimizer
    "unscaled" until its ``update()``, which the step did not reach: every later update of the
    run (after either way out) would raise torch's "unscale_() has already been called". Its
    per-optimizer record is cleared as ``update()`` clears it, with the scale kept as it is
    (``new_scale``: no backoff, no growth counted, no host read): the window is dropped, not
    applied."""
    state.lane.lineage.torn = True
    scaler = state.scaler
    # _scale is None until the scaler's first scale(): update() would then refuse.
    if scaler is not None and scaler.is_enabled() and scaler._scale is not None:
        scaler.update(new_scale=scaler._scale)

"""``Scheduler``: a learning-rate scheduler stepped per epoch or after each evaluation, as a
handler. A scheduler stepped per optimizer update belongs in the state instead
(``TrainState.create(scheduler=...)``): the step advances it with each applied update.

Its state is saved with every checkpoint and restored at resume without being named (it is a
handler with ``state_dict``; see ``steplib.checkpoint.contents``), and checkpoint saves run
after it at each event (``Events.on(..., last=True)``), so a checkpoint never holds the
scheduler from before its step.

Imports ``errors``, ``events``, ``schedules`` (``found_in``) and ``handlers.watched_value``
(``one_number``); for a sweep's per-copy rates, ``sweep.rates`` when it checks them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR
from torch.optim.swa_utils import SWALR

from steplib import errors
from steplib.errors import ConfigError, describe
from steplib.events import Event, Handler
from steplib.handlers.watched_value import one_number
from steplib.schedule_ends import check_steps_left, warn_if_rate_rises
from steplib.schedules import found_in


class Scheduler(Handler):
    """Step ``scheduler`` at every epoch end, or after every evaluation with its value.

    Args:
        scheduler: a torch LR scheduler (``StepLR``, ``MultiStepLR``, ``ExponentialLR``, ... or
            ``ReduceLROnPlateau``).
        metric: for a scheduler that takes a value (``ReduceLROnPlateau``): the ``Evaluator``
            whose monitored value feeds it after each of its evaluations, or the name of a
            value an evaluation records (``"val_loss"``; evaluations that do not record it,
            another evaluator's, pass it by). ``None``: step once per epoch.

    Raises:
        ConfigError: not a scheduler; a ``ReduceLROnPlateau`` without ``metric``, or a
            ``metric`` for a scheduler that takes none; a ``ReduceLROnPlateau`` in the other
            ``mode`` than the evaluator's (given by name: at ``fit_start``, the attached
            evaluator that monitors it); at ``fit_start``, a per-update scheduler of the
            state, or another ``Scheduler``'s, that steps the same optimizer where one of the
            two sets the rate from its base rates or to a rate of its own (``LambdaLR``,
            ``SWALR``, also inside a ``SequentialLR`` or ``ChainedScheduler``: it would erase
            the other's changes), the
            same scheduler is the state's too (it would be stepped twice), another
            ``Scheduler`` of the run steps the same optimizer at the same events (a notebook
            cell run again), or, over a sweep's per-copy rates, the scheduler sets an absolute
            rate (``eta_min``, ``max_lr``, ``min_lr``: ``steplib.sweep.rates``).

    Example:
        >>> import torch
        >>> from steplib import TrainState, make_train_step, run
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> state = TrainState.create(model=model, optimizer=opt)
        >>> per_epoch = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        >>> state = run(make_train_step(lambda m, b: m(b).sum()), state, [torch.ones(1, 2)] * 3,
        ...             events=[per_epoch], max_epochs=2)
        >>> opt.param_groups[0]["lr"]
        0.25
    """

    def __init__(self, scheduler: Any, *, metric: Any = None) -> None:
        stepped = callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "state_dict")
        if not (stepped and hasattr(scheduler, "optimizer")):  # an optimizer has no .optimizer
            raise ConfigError(
                f"Scheduler received {describe(scheduler)}, which is not an LR scheduler. Pass "
                "one built from the optimizer, e.g. Scheduler(torch.optim.lr_scheduler.StepLR("
                "optimizer, step_size=1, gamma=0.7))."
            )
        takes_value = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if not takes_value:
            errors.stepped_without_arguments("Scheduler", scheduler, "at each epoch end")
        if takes_value and metric is None:
            raise ConfigError(
                "Scheduler received a ReduceLROnPlateau without metric=...: it steps on a "
                "value. Pass the evaluator whose value it watches: Scheduler(plateau, "
                "metric=evaluator) (or the value's name, metric='val_loss')."
            )
        if metric is not None and not takes_value:
            raise ConfigError(
                f"Scheduler received metric={describe(metric)} for a "
                f"{type(scheduler).__name__}, which takes no value: it steps once per epoch. "
                "Leave metric out (a metric feeds a ReduceLROnPlateau)."
            )
        self.scheduler = scheduler
        self.metric: str | None = getattr(metric, "monitor", metric)
        self.evaluator = None if metric is None or isinstance(metric, str) else metric
        self._evaluations = 0  # of the evaluator's, when given one: one step per evaluation
        if metric is not None and not (isinstance(self.metric, str) and self.metric):
            raise ConfigError(
                f"Scheduler(metric=...) received {describe(metric)}, which names no value. Pass "
                "an Evaluator built with monitor='val_loss', or the name itself."
            )
        if self.evaluator is not None:  # a name's evaluator is known at fit_start (check)
            self._same_mode([self.evaluator])

    def _same_mode(self, handlers: Any) -> None:
        # ReduceLROnPlateau has a mode of its own ("min" by default): fed an accuracy that an
        # evaluator ranks "max", it lowered the rate at every improvement, in silence.
        mode = self.scheduler.mode
        errors.same_mode(
            "Scheduler(ReduceLROnPlateau)",
            str(self.metric),
            mode,
            handlers,
            fix=f"Build it in the evaluator's mode: ReduceLROnPlateau(optimizer, "
            f"mode={'max' if mode == 'min' else 'min'!r}, ...).",
        )

    def on_fit_start(self, event: Event) -> None:
        """:meth:`check`."""
        self.check(event)

    def on_epoch_start(self, event: Event) -> None:
        """Without a metric: refuse, before the epoch trains, a ``OneCycleLR`` that its step
        at this epoch's end would take past its end (``check_steps_left``)."""
        if self.metric is None:
            owner = f"the Scheduler's {type(self.scheduler).__name__}"
            late = ("epoch", event.state.epoch, "the whole epoch trained")
            after = "To train on after it, attach a Scheduler of a new scheduler."
            needs = "its step at this epoch's end"
            check_steps_left(self.scheduler, 1, needs=needs, owner=owner, late=late, after=after)

    def on_epoch_end(self, event: Event) -> None:
        """Without a metric: :meth:`step` once per epoch."""
        if self.metric is None:
            self.step(event)

    def on_validation_end(self, event: Event) -> None:
        """With a metric: :meth:`step` with the evaluation's value; with an evaluator, only
        after its own evaluations (another evaluator's, of an EMA model say, may record a value
        of the same name)."""
        if self.metric is None:
            return
        if self.evaluator is not None:
            evaluations = len(self.evaluator.history)
            if evaluations == self._evaluations:  # another evaluator's validation_end
                return
            self._evaluations = evaluations
        self.step(event)

    def check(self, event: Event) -> None:
        """Refuse a scheduler that the state steps too (per update), and an evaluator given as
        ``metric`` that is not attached to the run (it would never step the scheduler).

        Raises:
            ConfigError: ``event.state`` (or one of its optimizers') holds this scheduler; the
                evaluator is not attached to ``event.events``; another ``Scheduler`` of
                ``event.events`` steps the same optimizer at the same events.
        """
        if self.evaluator is not None:
            errors.evaluator_attached("Scheduler", self.evaluator, event.events)
        elif self.metric is not None:
            self._same_mode(event.events)
        state = event.state
        held = [state.scheduler] + [state[n].scheduler for n in getattr(state, "names", ())]
        if any(s is self.scheduler for s in held):
            raise ConfigError(
                "Scheduler received the scheduler the state holds too: the step advances it "
                "once per update and this handler would step it again. Create the state "
                "without it (TrainState.create(..., scheduler=None)) for a per-epoch or "
                "plateau schedule, or drop this handler for a per-update one."
            )
        # A notebook cell that adds a Scheduler, run again on the same Events, leaves the old
        # one attached: both step one optimizer at each of their events, the rate decays twice
        # as fast, and nothing else would say so.
        attached = event.events.attached() if event.events is not None else ()
        twins = [
            other
            for other in attached
            if isinstance(other, Scheduler)
            and other is not self
            and other.scheduler.optimizer is self.scheduler.optimizer
            and other.metric == self.metric
        ]
        if twins:
            when = "at each epoch end" if self.metric is None else f"on each {self.metric!r}"
            raise ConfigError(
                f"Scheduler: this Scheduler ({type(self.scheduler).__name__}) and another "
                f"attached to the same Events ({type(twins[0].scheduler).__name__}) step the "
                f"same optimizer {when}, so its learning rate would move twice as often (a "
                "notebook cell that adds a Scheduler, run again on an Events built in an "
                "earlier cell). Build the Events in the cell that adds its handlers (events = "
                "Events(...)), or events.remove(the_old_one) first; to apply two schedules on "
                "purpose, chain them in one handler: Scheduler(torch.optim.lr_scheduler."
                "ChainedScheduler([first, second]))."
            )
        self._not_erased(held, attached)
        if getattr(self.scheduler.optimizer, "lr_per_copy", False):  # a sweep's per-copy rates
            # Imported here: steplib.sweep pulls in torchmetrics (imported at first use), and
            # a sweep optimizer means it is imported already.
            from steplib.sweep.rates import check_per_copy_schedule

            check_per_copy_schedule(self.scheduler, self.scheduler.optimizer, "Scheduler")

    def _not_erased(self, held: list[Any], attached: Any) -> None:
        # A scheduler that sets the rate from its base rates (LambdaLR, OneCycleLR, AbsoluteLR)
        # erases, at each of its steps, what another scheduler of the optimizer did to it: a
        # plateau's reductions lasted until the next update (torch's own way, in silence).
        others = [("the state's per-update", s) for s in held] + [
            ("another Scheduler's", h.scheduler)
            for h in attached
            if isinstance(h, Scheduler) and h is not self
        ]
        for where, other in others:
            if getattr(other, "optimizer", None) is not self.scheduler.optimizer:
                continue
            setter = next(
                (found for s in (other, self.scheduler) if (found := _rate_setter(s))), None
            )
            if setter is not None:
                raise ConfigError(
                    f"Scheduler({type(self.scheduler).__name__}) and {where} "
                    f"{type(other).__name__} change the same optimizer's rate, and the "
                    f"{setter} at each step: what the other did is erased (a plateau's "
                    "reduction lasts until its next step). "
                    "Give the optimizer one schedule: fold both into one scheduler, or pair a "
                    "plateau or per-epoch Scheduler with a per-update scheduler that scales the "
                    "current rate (LinearLR for a warmup, ExponentialLR, StepLR)."
                )

    def step(self, event: Event) -> None:
        """Step the scheduler: once, or with the evaluation's value of :attr:`metric`.

        Raises:
            ConfigError: the evaluation did not record :attr:`metric` (the message lists what
                it recorded).
        """
        if self.metric is None:
            stepped = f"stepped at every {event.name} by this Scheduler: T_max counts those"
            warn_if_rate_rises(self.scheduler, stepped=stepped)
            self.scheduler.step()
            return
        values = event.metrics or {}
        if self.metric not in values:
            if self._recorded_by_another(event):
                return  # another evaluator's evaluation (a test set's): not this value's
            raise ConfigError(
                f"Scheduler(metric={self.metric!r}): the evaluation recorded "
                f"{', '.join(sorted(values)) or 'nothing'}. Name one of those."
            )
        self.scheduler.step(one_number("Scheduler", self.metric, values[self.metric], arg="metric"))

    def _recorded_by_another(self, event: Event) -> bool:
        """Whether the value named may come from another attached evaluator than the one that
        just evaluated: one that records it, or one that has not evaluated yet (so its names
        are not known). A name given with two evaluators (``val_``, ``test_``) was refused
        at the other's first evaluation; a name no evaluator records still is, once each has
        evaluated (or at the first evaluation, with the sanity pass that names them)."""
        if self.evaluator is not None or event.events is None:
            return False
        names = [
            h.names
            for h in event.events.attached()
            if isinstance(getattr(h, "names", None), frozenset)  # an Evaluator's values
        ]
        return any(not written or self.metric in written for written in names)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (saved with each checkpoint, without being named), and what
        the scheduler is (checked at load)."""
        return {
            **self._built(),
            "scheduler": self.scheduler.state_dict(),
            "evaluations": self._evaluations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``ConfigError`` for the state of another
        kind of scheduler, or one fed another value: torch's schedulers load any state).
        """
        errors.same_handler("Scheduler", self._built(), state)
        self.scheduler.load_state_dict(state["scheduler"])
        # Absent from a state saved before session 19: as if no evaluation had been seen.
        self._evaluations = int(state.get("evaluations", 0))

    def _built(self) -> dict[str, Any]:
        return {"kind": type(self.scheduler).__name__, "metric": self.metric}


def _rate_setter(scheduler: Any) -> str | None:
    """What in ``scheduler`` sets the rate, in words (see :func:`_sets_the_rate`): itself
    (``"LambdaLR sets it from its base rate"``), or one of the schedulers a ``SequentialLR`` or
    ``ChainedScheduler`` holds (``"SequentialLR's LambdaLR ..."``); ``None`` when nothing does."""
    return found_in(scheduler, _sets_the_rate)


def _sets_the_rate(scheduler: Any) -> str | None:
    """How ``scheduler`` sets the rate whatever the optimizer's current one, in words, or
    ``None`` when it computes it from the current one (``StepLR``, ``ExponentialLR``,
    ``LinearLR``). One that computes it from its base rates (``LambdaLR``, ``OneCycleLR``,
    ``AbsoluteLR``), asked for its rate at two current rates (each group's, or 1 where it is 0,
    and its half), gives the same; the rates are put back, and a scheduler that cannot say (no
    ``get_lr``) counts as not. ``SWALR`` sets ``swa_lr`` once annealed.
    """
    if isinstance(scheduler, SWALR):
        # The one scheduler whose kind changes as it goes: it scales the current rate while it
        # anneals and sets swa_lr once annealed. Probed at its current step, a run was let
        # through at its start and refused when resumed after the annealing (which the start
        # should have said: from then on it erases the other scheduler's changes).
        return "SWALR sets it to swa_lr once annealed"
    if isinstance(scheduler, OneCycleLR):
        # Its get_lr raises past total_steps (a OneCycleLR stepped past its cycle): probed
        # there, it counted as not setting the rate, and the check was escaped.
        return "OneCycleLR sets it from max_lr"
    groups = scheduler.optimizer.param_groups
    rates = [group["lr"] for group in groups]
    # Nonzero: a warmup LambdaLR from 0 (lambda s: s / n) is at 0 when the run starts, and a
    # rate of 0 scaled by any factor stays 0, so that at 0 the two kinds give the same.
    probes = [rate if float(rate) else 1.0 for rate in rates]
    try:
        with warnings.catch_warnings():  # torch warns of get_lr outside its step
            warnings.simplefilter("ignore")
            for group, probe in zip(groups, probes, strict=True):
                group["lr"] = probe
            before = [float(rate) for rate in scheduler.get_lr()]
            for group, probe in zip(groups, probes, strict=True):
                group["lr"] = probe * 0.5
            after = [float(rate) for rate in scheduler.get_lr()]
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None
    finally:
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate
    return f"{type(scheduler).__name__} sets it from its base rate" if before == after else None

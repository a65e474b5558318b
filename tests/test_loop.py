"""``run`` / ``iterate``: event order, limits, short last windows, unsized data, errors."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from steplib import (
    Events,
    LossFnError,
    StepOutput,
    TrainState,
    accumulate,
    iterate,
    make_train_step,
    run,
)
from tests.reference import Unsized

Batch = tuple[torch.Tensor, torch.Tensor]
RECORDED = ("fit_start", "epoch_start", "micro_step_end", "step_end", "epoch_end", "fit_end")


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    return TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)) for _ in range(n)]


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _recorder(log: list[tuple[str, int, int, int]], events: Events | None = None) -> Events:
    events = events if events is not None else Events()
    for name in RECORDED:
        events.on(name, lambda e: log.append((e.name, e.step, e.micro_step, e.epoch)))
    return events


def _drain(
    gen: Generator[tuple[TrainState, StepOutput], None, TrainState],
) -> tuple[list[tuple[TrainState, StepOutput]], TrainState]:
    """All yields of ``iterate`` and its return value (the final state)."""
    yielded = []
    while True:
        try:
            yielded.append(next(gen))
        except StopIteration as finished:
            return yielded, finished.value


def _params(state: TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


class Streamed(IterableDataset):
    """An IterableDataset without ``__len__``: ``len(DataLoader(...))`` raises TypeError."""

    def __init__(self, items: list[Batch]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.items)


# --- event order --------------------------------------------------------------------------------


def test_events_fire_in_documented_order_with_accumulation_and_a_shorter_last_window():
    log: list[tuple[str, int, int, int]] = []
    step = accumulate(make_train_step(_mse), 2)
    # 5 batches, k=2: windows [1,2] [3,4] [5]; the last batch closes the shorter window.
    run(step, _state(), _batches(5), events=_recorder(log), max_epochs=2)
    ms, se = "micro_step_end", "step_end"
    assert log == [
        ("fit_start", 0, 0, 0),
        ("epoch_start", 0, 0, 0),
        (ms, 0, 1, 0),
        (ms, 1, 2, 0),
        (se, 1, 2, 0),
        (ms, 1, 3, 0),
        (ms, 2, 4, 0),
        (se, 2, 4, 0),
        (ms, 3, 5, 0),
        (se, 3, 5, 0),
        ("epoch_end", 3, 5, 1),
        ("epoch_start", 3, 5, 1),
        (ms, 3, 6, 1),
        (ms, 4, 7, 1),
        (se, 4, 7, 1),
        (ms, 4, 8, 1),
        (ms, 5, 9, 1),
        (se, 5, 9, 1),
        (ms, 6, 10, 1),
        (se, 6, 10, 1),
        ("epoch_end", 6, 10, 2),
        ("fit_end", 6, 10, 2),
    ]


def test_step_events_carry_the_output_and_the_batch_index():
    seen: list[tuple[str, int | None, bool]] = []
    events = Events()
    for name in ("micro_step_end", "step_end"):
        events.on(
            name,
            lambda e: seen.append((e.name, e.batch_index, bool(e.output.did_update))),
        )
    run(accumulate(make_train_step(_mse), 2), _state(), _batches(3), events=events)
    assert seen == [
        ("micro_step_end", 0, False),
        ("micro_step_end", 1, True),
        ("step_end", 1, True),
        ("micro_step_end", 2, True),
        ("step_end", 2, True),
    ]


def test_step_events_are_built_only_for_a_loop_with_handlers_for_them(monkeypatch):
    import steplib.loop

    built: list[str] = []
    real_at = steplib.loop.Event.at

    def counting_at(name, state, **payload):
        built.append(name)
        return real_at(name, state, **payload)

    monkeypatch.setattr(steplib.loop.Event, "at", counting_at)
    events = Events()
    events.on("epoch_end", lambda e: None)
    run(accumulate(make_train_step(_mse), 2), _state(), _batches(4), events=events)
    assert "micro_step_end" not in built and "step_end" not in built
    events.on("step_end", lambda e: None)
    run(accumulate(make_train_step(_mse), 2), _state(), _batches(4), events=events)
    assert built.count("step_end") == 2 and "micro_step_end" not in built


# --- run == iterate -------------------------------------------------------------------------------


def test_run_and_iterate_give_the_same_final_state_bit_for_bit():
    step = accumulate(make_train_step(_mse), 2)
    data = _batches(5)
    by_run = run(step, _state(), data, max_epochs=3)
    yielded, by_iterate = _drain(iterate(step, _state(), data, max_epochs=3))
    counters = ("step", "micro_step", "epoch", "window")
    assert [getattr(by_run, c) for c in counters] == [getattr(by_iterate, c) for c in counters]
    assert (by_iterate.step, by_iterate.micro_step, by_iterate.epoch) == (9, 15, 3)
    for a, b in zip(by_run.model.parameters(), by_iterate.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # One yield per call of the step; the last call of a pass is yielded once its epoch is
    # counted (a `break` there leaves it counted), as in the return value.
    assert len(yielded) == 15
    assert [s.epoch for s, _ in yielded[3:6]] == [0, 1, 1]
    assert yielded[-1][0].epoch == 3


# --- limits ---------------------------------------------------------------------------------------


def test_max_steps_stops_mid_epoch_at_exactly_that_step():
    ended: list[int] = []
    events = Events().on("epoch_end", lambda e: ended.append(e.epoch))
    step = accumulate(make_train_step(_mse), 3)
    state = run(step, _state(), _batches(12), events=events, max_steps=2)
    assert (state.step, state.micro_step, state.epoch, state.window.size) == (2, 6, 0, 0)
    assert ended == []


def test_max_steps_across_epochs_stops_at_exactly_that_step():
    state = run(make_train_step(_mse), _state(), _batches(3), max_steps=7)
    assert (state.step, state.micro_step, state.epoch) == (7, 7, 2)


def test_max_steps_on_the_last_batch_counts_the_epoch():
    state = run(make_train_step(_mse), _state(), _batches(3), max_steps=3)
    assert (state.step, state.epoch) == (3, 1)


def test_max_epochs_runs_that_many_passes():
    ended: list[int] = []
    events = Events().on("epoch_end", lambda e: ended.append(e.epoch))
    state = run(make_train_step(_mse), _state(), _batches(4), events=events, max_epochs=3)
    assert (state.step, state.micro_step, state.epoch) == (12, 12, 3)
    assert ended == [1, 2, 3]


def test_max_steps_and_max_epochs_stop_at_whichever_comes_first():
    step = make_train_step(_mse)
    assert run(step, _state(), _batches(4), max_steps=5, max_epochs=3).step == 5
    assert run(step, _state(), _batches(4), max_steps=50, max_epochs=3).step == 12


def test_neither_limit_runs_one_epoch_and_a_second_run_runs_the_next_one():
    step = make_train_step(_mse)
    state = run(step, _state(), _batches(5))
    assert (state.step, state.epoch) == (5, 1)
    state = run(step, state, _batches(5))
    assert (state.step, state.epoch) == (10, 2)


def test_max_steps_already_reached_by_a_resumed_state_runs_nothing():
    step = make_train_step(_mse)
    state = run(step, _state(), _batches(3), max_steps=3)
    before = _params(state)
    with pytest.warns(UserWarning, match=r"trains nothing.*max_steps=3 \(state.step is 3\)"):
        again = run(step, state, _batches(3), max_steps=3)  # a cell run again: said, not silent
    assert (again.step, again.micro_step) == (3, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(again), strict=True))


# --- the shorter last window ------------------------------------------------------------------


def _reference_windows(
    seed: int, data: list[Batch], windows: list[list[int]]
) -> list[torch.Tensor]:
    """Plain PyTorch: per window, the mean of its micro-batch losses, one SGD update."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        loss = sum(_mse(model, data[i]) for i in window) / len(window)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_last_batch_of_sized_data_closes_a_shorter_window_normalised_by_what_it_held():
    window_at_end: list[int] = []
    last: list[StepOutput] = []
    events = Events()
    events.on("epoch_end", lambda e: window_at_end.append(e.state.window.size))
    events.on("step_end", lambda e: last.append(e.output))
    data = _batches(5)
    state = run(accumulate(make_train_step(_mse), 3), _state(), data, events=events)
    assert (state.step, state.micro_step, state.window.size) == (2, 5, 0)
    assert window_at_end == [0]
    assert float(last[-1].num_targets) == 2.0
    # Dividing the last window by k=3 instead of by 2 would move the parameters less.
    expected = _reference_windows(0, data, [[0, 1, 2], [3, 4]])
    for got, want in zip(_params(state), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_unsized_data_gets_its_open_window_flushed_at_epoch_end():
    log: list[tuple[str, int, int, int]] = []
    data = _batches(5)
    step = accumulate(make_train_step(_mse), 3)
    unsized = run(step, _state(), Unsized(data), events=_recorder(log))
    ms, se = "micro_step_end", "step_end"
    # The flush emits step_end only: no micro-batch ran, so no second micro_step_end 5.
    assert log == [
        ("fit_start", 0, 0, 0),
        ("epoch_start", 0, 0, 0),
        (ms, 0, 1, 0),
        (ms, 0, 2, 0),
        (ms, 1, 3, 0),
        (se, 1, 3, 0),
        (ms, 1, 4, 0),
        (ms, 1, 5, 0),
        (se, 2, 5, 0),
        ("epoch_end", 2, 5, 1),
        ("fit_end", 2, 5, 1),
    ]
    assert unsized.window.size == 0
    # The flushed window is normalised exactly as the sized one closed by the last batch.
    sized = run(step, _state(), data)
    for a, b in zip(_params(unsized), _params(sized), strict=True):
        assert torch.equal(a, b)


def test_iterate_yields_the_flushed_update_of_unsized_data():
    step = accumulate(make_train_step(_mse), 3)
    yielded, final = _drain(iterate(step, _state(), Unsized(_batches(5))))
    assert [bool(out.did_update) for _, out in yielded] == [False, False, True, False, False, True]
    assert final.step == 2


def test_dataloader_over_an_iterable_dataset_without_len_is_treated_as_unsized():
    data = _batches(5)
    loader = DataLoader(Streamed(data), batch_size=None)
    step = accumulate(make_train_step(_mse), 3)
    streamed = run(step, _state(), loader, max_epochs=2)
    listed = run(step, _state(), data, max_epochs=2)
    assert (streamed.step, streamed.micro_step, streamed.epoch) == (4, 10, 2)
    for a, b in zip(_params(streamed), _params(listed), strict=True):
        assert torch.equal(a, b)


# --- one-shot generators ----------------------------------------------------------------------


def test_a_generator_runs_one_epoch():
    state = run(make_train_step(_mse), _state(), (b for b in _batches(4)))
    assert (state.step, state.epoch) == (4, 1)


@pytest.mark.timeout(20)
def test_a_generator_for_two_epochs_raises_instead_of_looping_forever():
    errors: list[tuple[BaseException | None, int]] = []
    events = Events().on("exception", lambda e: errors.append((e.error, e.epoch)))
    with pytest.raises(ValueError) as info:
        run(make_train_step(_mse), _state(), (b for b in _batches(4)), events=events, max_epochs=2)
    message = str(info.value)
    assert "yielded no batches in epoch 1" in message
    assert "not an exhausted iterator or generator" in message
    assert errors == [(info.value, 1)]


# --- exceptions -------------------------------------------------------------------------------


def test_an_exception_in_loss_fn_emits_exception_with_the_error_and_is_reraised():
    calls: list[int] = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in loss_fn")
        return _mse(model, batch)

    data = _batches(5)
    seen: list[tuple[BaseException | None, int, int]] = []
    ended: list[int] = []
    events = Events()
    events.on("exception", lambda e: seen.append((e.error, e.step, e.micro_step)))
    events.on("fit_end", lambda e: ended.append(e.step))
    with pytest.raises(RuntimeError, match="boom in loss_fn") as info:
        run(make_train_step(loss_fn), _state(), data, events=events)
    assert seen == [(info.value, 2, 2)]
    assert ended == []


def test_a_bad_loss_fn_result_is_reported_through_the_exception_event():
    seen: list[BaseException | None] = []
    events = Events().on("exception", lambda e: seen.append(e.error))
    with pytest.raises(LossFnError) as info:
        run(make_train_step(lambda m, b: 1.0), _state(), _batches(2), events=events)
    assert seen == [info.value]


def test_breaking_out_of_iterate_early_emits_fit_end_not_exception():
    seen: list[BaseException | None] = []
    ended: list[int] = []
    events = Events().on("exception", lambda e: seen.append(e.error))
    events.on("fit_end", lambda e: ended.append(e.step))
    gen = iterate(make_train_step(_mse), _state(), _batches(10), events=events)
    last = None
    for state, _ in gen:
        last = state
        if state.step == 2:
            break
    gen.close()
    assert last is not None and last.step == 2
    assert seen == []
    assert ended == [2]  # handlers can finish (close a bar, flush a log) after a `break`


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_limits_must_be_positive_ints(label, value):
    with pytest.raises(ValueError) as info:
        run(make_train_step(_mse), _state(), _batches(2), **{label: value})
    assert f"received {label}={value!r}" in str(info.value)
    assert "positive int or None" in str(info.value)


def test_non_iterable_data_is_refused():
    with pytest.raises(ValueError) as info:
        run(make_train_step(_mse), _state(), 5)  # type: ignore[arg-type]
    message = str(info.value)
    assert "data of type int" in message and "not iterable" in message
    assert "list of batches" in message


def test_a_plain_function_as_step_is_refused():
    def not_a_step(state, batch):
        return state, None

    with pytest.raises(ValueError) as info:
        run(not_a_step, _state(), _batches(2))  # type: ignore[arg-type]
    message = str(info.value)
    assert "step of type function" in message and "not a Step" in message
    assert "make_train_step(loss_fn)" in message


def test_iterate_checks_its_arguments_when_called_not_at_the_first_next():
    with pytest.raises(ValueError, match="max_steps=0"):
        iterate(make_train_step(_mse), _state(), _batches(2), max_steps=0)


def test_iterate_does_not_mutate_the_state_it_was_given():
    start = _state()
    run(accumulate(make_train_step(_mse), 2), start, _batches(5), max_epochs=2)
    assert (start.step, start.micro_step, start.epoch, start.window.size) == (0, 0, 0, 0)
    assert float(start.window.loss) == 0.0


def test_a_plain_loaders_distributed_sampler_gets_each_epoch_without_a_handler() -> None:
    # Before: run never called set_epoch, so every epoch drew the first one's order (PyTorch
    # leaves the call to the loop; Lightning and Accelerate make it): 3 epochs, one order.
    dataset = TensorDataset(torch.arange(8.0).unsqueeze(1))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    seen: list[list[float]] = []

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        seen.append(batch[0].flatten().tolist())
        return model(batch[0]).mean()

    model = torch.nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    run(make_train_step(loss_fn), state, loader, max_epochs=3)
    expected = []
    for epoch in range(3):  # PyTorch's own loop
        sampler.set_epoch(epoch)
        expected += [batch[0].flatten().tolist() for batch in loader]
    assert seen == expected and seen[:4] != seen[4:8]


def test_a_model_left_in_eval_mode_is_warned_about_at_the_runs_start() -> None:
    # Before: model.eval() in a cell (to look at predictions), then run: it trained with
    # dropout off and BatchNorm's statistics fixed, in silence, and ended in eval mode.
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    step = make_train_step(lambda m, b: m(b).pow(2).mean())
    data = [torch.randn(4, 4) for _ in range(2)]
    model.eval()
    with pytest.warns(UserWarning, match=r"is in eval mode .*BatchNorm1d, Dropout layers"):
        state = run(step, state, data)
    model.train()
    model[1].eval()  # a part kept in eval mode on purpose: nothing said
    state = run(step, state, data, max_epochs=2)
    plain = nn.Sequential(nn.Linear(4, 1)).eval()  # no layer that depends on the mode
    run(step, TrainState.create(model=plain, optimizer=torch.optim.SGD(plain.parameters())), data)


class _EpochShuffled(IterableDataset[torch.Tensor]):
    """A streaming dataset that shuffles by its epoch, as a Hugging Face one does."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = torch.randperm(6, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order.float().unsqueeze(1))


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_dataset_or_data_with_set_epoch_gets_each_epoch(wrapped: bool) -> None:
    # Before: never called, so every epoch streamed epoch 0's order.
    dataset = _EpochShuffled()
    data: Any = DataLoader(dataset, batch_size=2) if wrapped else dataset
    seen: list[list[float]] = []

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        seen.append(batch.flatten().tolist())
        return model(batch).mean()

    model = torch.nn.Linear(1, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters()))
    run(make_train_step(loss_fn), state, data, max_epochs=2)
    half = len(seen) // 2
    first, second = ([x for batch in part for x in batch] for part in (seen[:half], seen[half:]))
    assert first != second and sorted(first) == sorted(second) == list(range(6))

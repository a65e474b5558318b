"""ProgressBar: reads tensors only on its refresh interval, shows the right numbers, closes."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import io
import os
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import tqdm

import steplib.handlers.logging.console
import steplib.handlers.progress
from steplib import (
    ConfigError,
    Event,
    Events,
    TrainState,
    accumulate,
    iterate,
    make_train_step,
    run,
)
from steplib.handlers import ProgressBar
from steplib.handlers.terminal import tqdm_class
from steplib.step import skip_nonfinite
from tests.host_reads import on_host_read


def _setup(n_batches: int = 10, *, fail_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    # SGD: torch's Adam/AdamW read their step counter with .item(), which would blur the count.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = TrainState.create(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n_batches):
        size = 2 + i % 4
        batches.append((torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,))))
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if fail_at is not None and calls[0] == fail_at:
            raise RuntimeError("boom")
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum"), y.numel()

    return state, make_train_step(loss_fn), batches


READS = ("item", "tolist", "__float__")


def test_bar_reads_tensors_only_on_its_refresh_interval() -> None:
    state, step, batches = _setup(10)
    where = ["setup"]
    reads: list[str] = []

    def track(event: Event) -> None:
        where[0] = f"{event.name}:{event.step}"

    events = Events()
    for name in ("fit_start", "step_end", "fit_end"):
        events.on(name, track)  # registered first, so it runs before the bar's handler
    bar = ProgressBar(total=10, every=3, file=io.StringIO())
    bar.attach(events)
    with on_host_read(lambda name: reads.append(where[0]), READS):
        run(step, state, batches, events=events)

    assert reads, "the bar never read its values"
    # Only on steps 3, 6, 9 and at the end (the remaining step 10), never in between.
    assert set(reads) == {"step_end:3", "step_end:6", "step_end:9", "fit_end:10"}
    assert bar.closed


def test_bar_shows_token_weighted_loss_lr_and_tokens() -> None:
    state, step, batches = _setup(8)
    outputs: list = []
    events = Events().on("step_end", lambda e: outputs.append(e.output))
    bar = ProgressBar(every=4, file=io.StringIO())
    snapshots: list[dict] = []
    bar.attach(events)
    events.on("step_end", lambda e: snapshots.append(dict(bar.stats)), every=4)
    run(step, state, batches, events=events)

    for snapshot, window in zip(snapshots, (outputs[:4], outputs[4:]), strict=True):
        targets = sum(float(o.num_targets) for o in window)
        loss = sum(float(o.loss) * float(o.num_targets) for o in window) / targets
        assert snapshot["loss"] == pytest.approx(loss, rel=1e-6)
        assert snapshot["lr"] == pytest.approx(0.05)
        assert snapshot["tokens_per_s"] > 0
    assert [s["step"] for s in snapshots] == [4, 8]
    assert bar.stats["tokens"] == sum(int(o.num_targets) for o in outputs)
    assert isinstance(bar.stats["tokens"], int)


def test_bar_draws_in_a_plain_stream_and_closes_at_fit_end() -> None:
    state, step, batches = _setup(6)
    stream = io.StringIO()
    bar = ProgressBar(total=3, every=2, desc="train", file=stream)
    events = bar.attach(Events())
    assert bar.closed  # nothing is open before the run
    final = run(accumulate(step, 2), state, batches, events=events)
    assert final.step == 3
    assert bar.closed
    text = stream.getvalue()
    assert "train" in text and "3/3" in text and "loss=" in text and "tokens/s=" in text
    bar.close()  # closing again is harmless


def _mean_loss_run(bar: ProgressBar, n: int = 6, accumulation: int = 2) -> str:
    state, _, batches = _setup(n)
    step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # a mean loss
    run(accumulate(step, accumulation), state, batches, events=bar.attach(Events()))
    assert isinstance(bar.file, io.StringIO)
    return bar.file.getvalue()


def test_a_mean_loss_rate_is_named_by_what_it_counts_not_tokens() -> None:
    bar = ProgressBar(every=1, file=io.StringIO())
    text = _mean_loss_run(bar)
    assert "batches/s=" in text and "tokens" not in text
    assert bar.stats["batches"] == 6  # one per micro-batch of a mean loss
    bar = ProgressBar(every=1, file=io.StringIO(), samples_per_step=8)
    text = _mean_loss_run(bar)
    assert "samples/s=" in text and "tokens" not in text and "batches" not in text
    assert bar.stats["samples"] == 3 * 8 and bar.stats["samples_per_s"] > 0
    bar = ProgressBar(every=1, file=io.StringIO(), unit="images")
    assert "images/s=" in _mean_loss_run(bar)


def test_samples_count_an_epochs_shorter_last_window_as_what_it_ran() -> None:
    # 7 batches an epoch in windows of 3: updates of 3, 3 and 1 batches. The shown count took
    # every update as a full window of samples_per_step: 36 samples an epoch, not 28.
    bar = ProgressBar(every=2, file=io.StringIO(), samples_per_step=3 * 4)
    state, _, _ = _setup()
    batches = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(7)]
    step = make_train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    run(accumulate(step, 3), state, batches, events=bar.attach(Events()), max_epochs=2)
    assert bar.stats["step"] == 6
    assert bar.stats["samples"] == 2 * sum(len(x) for x, _ in batches)  # counted by hand


def test_keys_choose_what_the_bar_shows_and_no_keys_reads_no_tensor() -> None:
    bar = ProgressBar(every=1, file=io.StringIO(), keys=["loss"])
    text = _mean_loss_run(bar)
    assert "loss=" in text and "lr=" not in text and "/s=" not in text
    bar = ProgressBar(every=1, file=io.StringIO(), keys=[])
    reads: list[str] = []
    with on_host_read(reads.append, READS):
        text = _mean_loss_run(bar)
    assert "loss=" not in text and bar.stats == {}
    assert reads == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keys": ["loss", "tok_s"]}, r"the bar shows some of \['loss', 'lr', 'rate'\]"),
        ({"keys": "loss"}, "keys"),
        ({"samples_per_step": 0}, "samples_per_step"),
        ({"unit": ""}, "unit"),
    ],
)
def test_bad_bar_choices_are_refused(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        ProgressBar(**kwargs)


def test_bar_closes_when_the_run_raises() -> None:
    state, step, batches = _setup(6, fail_at=4)
    bar = ProgressBar(every=2, file=io.StringIO())
    with pytest.raises(RuntimeError, match="boom"):
        run(step, state, batches, events=bar.attach(Events()))
    assert bar.closed
    assert bar.stats["step"] == 2  # the last refresh; nothing is read after an error


def test_bar_starts_at_the_resumed_step() -> None:
    state, step, batches = _setup(4)
    stream = io.StringIO()
    bar = ProgressBar(total=8, every=2, file=stream)
    state = run(step, state, batches, events=bar.attach(Events()))
    assert state.step == 4
    stream.truncate(0)
    run(step, state, batches, events=bar.attach(Events()))  # a second run: bar is reusable
    assert "8/8" in stream.getvalue()
    assert bar.stats["step"] == 8


def test_disabled_bar_reads_nothing() -> None:
    state, step, batches = _setup(4)
    where = ["run"]
    reads: list[str] = []
    bar = ProgressBar(every=1, disable=True, file=io.StringIO())
    with on_host_read(lambda name: reads.append(where[0]), READS):
        run(step, state, batches, events=bar.attach(Events()))
    assert reads == []
    assert bar.closed


def test_write_prints_above_the_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBar(file=stream)
    bar.write("hello")
    assert "hello\n" in stream.getvalue()


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"every": 2.5}, {"total": 0}, {"every": True}])
def test_bad_settings_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="ProgressBar"):
        ProgressBar(**kwargs)


def test_bar_draws_on_rank_zero_only_by_default(monkeypatch) -> None:
    assert not ProgressBar(file=io.StringIO()).disable  # no process group: rank 0
    monkeypatch.setattr(steplib.handlers.progress, "is_main", lambda: False)
    state, step, batches = _setup(4)
    stream = io.StringIO()
    where = ["run"]
    reads: list[str] = []
    bar = ProgressBar(every=1, file=stream)
    assert bar.disable
    with on_host_read(lambda name: reads.append(where[0]), READS):
        run(step, state, batches, events=bar.attach(Events()))
    assert stream.getvalue() == "" and reads == []
    assert not ProgressBar(disable=False).disable  # an explicit choice wins


# tqdm's front ends that decide, when imported, between the notebook widget and the text bar.
_TQDM_FRONT_ENDS = ("auto", "autonotebook", "notebook")


@pytest.fixture
def kernel_without_ipywidgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``tqdm.autonotebook`` sees in a Jupyter kernel where ipywidgets is not installed:
    ``ipykernel.zmqshell`` imported, IPython's shell a ``ZMQInteractiveShell``, and
    ``import ipywidgets`` failing. tqdm's front ends are taken out of ``sys.modules`` (and off
    the package) so that importing one runs its detection again; all is restored afterwards."""
    shell = type("ZMQInteractiveShell", (), {})()
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # None in sys.modules: ImportError
    for name in [n for n in os.environ if n == "QT_API" or n.startswith("SPYDER")]:
        monkeypatch.delenv(name)  # tqdm takes these for a Qt console, which draws text
    for front_end in _TQDM_FRONT_ENDS:
        name = f"tqdm.{front_end}"
        # Set, then delete: undone in reverse, this restores the entry, or removes the one
        # an import inside the test adds.
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(tqdm, front_end, getattr(tqdm, front_end, None), raising=False)
        monkeypatch.delattr(tqdm, front_end)


def test_the_simulated_kernel_makes_tqdm_auto_warn(kernel_without_ipywidgets: None) -> None:
    # The premise of the next test: there, tqdm.auto would warn, as it does in Jupyter.
    with pytest.warns(tqdm.TqdmWarning, match="IProgress not found"):
        importlib.import_module("tqdm.auto")


def test_progress_in_a_kernel_without_ipywidgets_warns_nothing(
    kernel_without_ipywidgets: None,
) -> None:
    state, step, batches = _setup(4)
    stream = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drawing = (steplib.handlers.progress, steplib.handlers.logging.console)
        for module in drawing:  # importing them, afresh
            assert module.__file__ is not None
            spec = importlib.util.spec_from_file_location(
                f"_fresh_{module.__name__}", module.__file__
            )
            assert spec is not None and spec.loader is not None
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        bar = ProgressBar(total=4, every=2, file=stream)
        run(step, state, batches, events=bar.attach(Events()))
        bar.write("a line above the bar")
        steplib.handlers.logging.console.ConsoleLogger(file=stream).write({"step": 4, "loss": 1.0})
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert "tqdm.auto" not in sys.modules  # the text bar, chosen without asking tqdm.auto
    text = stream.getvalue()
    assert "4/4" in text and "a line above the bar" in text and "step 4  loss 1" in text


def test_tqdm_auto_draws_where_ipywidgets_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm.std import tqdm as text_bar

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert tqdm_class() is text_bar
    found = types.ModuleType("ipywidgets")
    found.__spec__ = importlib.machinery.ModuleSpec("ipywidgets", None)
    monkeypatch.setitem(sys.modules, "ipywidgets", found)
    assert tqdm_class() is importlib.import_module("tqdm.auto").tqdm


def test_bar_leaves_skipped_updates_out_of_its_loss_and_says_how_many() -> None:
    state, _, batches = _setup(8)

    def loss_fn(model, batch):
        x, y = batch
        nan = float("nan") if x.shape[0] == 4 else 0.0  # batches 2 and 6: skipped
        return F.cross_entropy(model(x), y, reduction="sum") + nan, y.numel()

    step = skip_nonfinite(make_train_step(loss_fn))
    outputs: list = []
    events = Events().on("step_end", lambda e: outputs.append(e.output))
    bar = ProgressBar(every=8, file=io.StringIO())
    bar.attach(events)
    run(step, state, batches, events=events)

    trained = [o for o in outputs if not bool(o.skipped)]
    assert len(trained) == 6
    targets = sum(float(o.num_targets) for o in trained)
    loss = sum(float(o.loss) * float(o.num_targets) for o in trained) / targets
    assert bar.stats["loss"] == pytest.approx(loss, rel=1e-6)  # was NaN
    assert bar.stats["skipped"] == 2
    assert bar.stats["tokens"] == sum(int(o.num_targets) for o in outputs)  # all went through


def test_a_run_broken_off_before_its_first_update_closes_the_bar() -> None:
    state, step, batches = _setup(8)
    bar = ProgressBar(every=2, file=io.StringIO())
    loop = iterate(accumulate(step, 4), state, batches, events=bar.attach(Events()))
    for index, _ in enumerate(loop):  # micro-batches of the first window, then a break
        if index == 1:
            break
    loop.close()
    assert bar.closed and bar.stats == {}


def test_the_first_rate_leaves_out_the_other_fit_start_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The rate's clock started at the bar's own fit_start, before the fit_start handlers
    # registered after it (a sanity evaluation: 60 s on the fake clock here): each run's
    # first refresh read 2 updates of 1 s in 62 s (0.03 batches/s), a dip after each resume.
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(
        steplib.handlers.progress, "time", types.SimpleNamespace(perf_counter=lambda: clock.now)
    )
    bar = ProgressBar(every=2, file=io.StringIO())
    events = Events(bar).on("fit_start", lambda e: setattr(clock, "now", clock.now + 60.0))
    events.on("step_end", lambda e: setattr(clock, "now", clock.now + 1.0), first=True)
    rates: list[float] = []
    events.on("step_end", lambda e: rates.append(bar.stats["batches_per_s"]), every=2)
    model = torch.nn.Linear(2, 1)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    run(
        make_train_step(lambda m, b: m(b).pow(2).mean()),
        state,
        [torch.ones(1, 2)] * 4,
        events=events,
    )
    assert rates == [1.0, 1.0]

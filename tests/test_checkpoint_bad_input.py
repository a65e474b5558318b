"""Bad input: each error says what was received, why it is wrong, and the fix."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from steplib import (
    ConfigError,
    Event,
    Events,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    make_train_step,
    run,
)
from steplib.checkpoint import (
    CheckpointError,
    checkpoint_every,
    latest,
    list_checkpoints,
    load,
    preemption,
    resume_from,
    save,
)
from steplib.data import resumable_loader
from tests.checkpoint_helpers import make_state, memory_dir, train
from tests.reference import make_batches, mean_loss

__all__ = ["memory_dir"]


def _without_filesystem(monkeypatch: pytest.MonkeyPatch, protocol: str, package: str) -> None:
    """Make ``protocol``'s fsspec implementation look uninstalled."""
    registry = importlib.import_module("fsspec.registry")._registry
    if protocol in registry:
        monkeypatch.delitem(registry, protocol)
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError


@pytest.mark.parametrize(
    ("url", "protocol", "package", "install"),
    [
        ("s3://bucket/run/ckpt", "s3", "s3fs", "pip install 'steplib[s3]'"),
        ("gs://bucket/run/ckpt", "gs", "gcsfs", "install gcsfs"),
    ],
)
def test_url_whose_filesystem_is_not_installed_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, url: str, protocol: str, package: str, install: str
) -> None:
    _without_filesystem(monkeypatch, protocol, package)
    for call in (
        lambda: save(make_state(), url),
        lambda: load(f"{url}/step-00000001", make_state()),
        lambda: latest(url),
    ):
        with pytest.raises(CheckpointError, match=rf"{protocol}:// filesystem is not installed"):
            call()
        with pytest.raises(CheckpointError, match=install.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_unknown_protocol() -> None:
    with pytest.raises(ConfigError, match=r"protocol 'nope' fsspec does not know"):
        save(make_state(), "nope://somewhere/ckpt")


def test_checkpoint_of_a_model_with_other_parameter_names_lists_them(memory_dir: str) -> None:
    url = save(make_state(), memory_dir)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), nn.Flatten(0))
    state = TrainState.create(model=other, optimizer=torch.optim.AdamW(other.parameters()))
    with pytest.raises(ConfigError) as error:
        load(url, state)
    message = str(error.value)
    assert "missing from the checkpoint: 2.weight, 2.bias" in message
    assert "unexpected in the checkpoint: 3.weight, 3.bias" in message
    assert "Build the model as the run that saved it did" in message


def test_checkpoint_of_a_model_with_other_shapes_lists_them(memory_dir: str) -> None:
    url = save(make_state(), memory_dir)
    torch.manual_seed(0)
    wider = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.0), nn.Linear(32, 3), nn.Flatten(0)
    )
    state = TrainState.create(model=wider, optimizer=torch.optim.AdamW(wider.parameters()))
    with pytest.raises(ConfigError, match=r"0.weight \(16, 8\) in the checkpoint, \(32, 8\) here"):
        load(url, state)


def test_checkpoint_of_another_step_composition_says_what_differs(memory_dir: str) -> None:
    saved_step = clip(accumulate(make_train_step(mean_loss), 4), max_norm=1.0)
    url = save(make_state(), memory_dir, step=saved_step)
    other = accumulate(make_train_step(mean_loss), 2)
    with pytest.raises(ConfigError) as error:
        load(url, make_state(), step=other)
    message = str(error.value)
    assert "accumulate k=4 in the checkpoint, 2 now" in message
    assert "the checkpoint's step applies clip(max_norm=1.0" in message
    assert "Build the step as the checkpoint's, or load it unchecked by hand" in message
    # Built-in wrappers commute: another order of the same wrappers is the same step.
    same = accumulate(clip(make_train_step(mean_loss), max_norm=1.0), 4)
    assert load(url, make_state(), step=same).step == 0


def test_added_wrapper_is_named(memory_dir: str) -> None:
    url = save(make_state(), memory_dir, step=make_train_step(mean_loss))
    step = amp_wrap(make_train_step(mean_loss), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"this step applies amp_wrap\(dtype='torch.bfloat16'\)"):
        load(url, make_state(), step=step)


def test_directory_with_no_checkpoint(tmp_path: Path, memory_dir: str) -> None:
    for directory in (str(tmp_path / "empty"), memory_dir):
        assert latest(directory) is None
        assert list_checkpoints(directory) == []
        with pytest.raises(CheckpointError, match=r"no checkpoint \(no manifest.json\)"):
            load(directory, make_state())
        resume = resume_from(directory)
        assert resume(Event("fit_start", make_state())) is None  # a fresh start, no error
        assert resume.loaded is None


def test_loading_a_directory_of_checkpoints_says_to_use_latest(memory_dir: str) -> None:
    save(make_state(), memory_dir)
    with pytest.raises(CheckpointError, match=r"a directory of checkpoints.*load\(latest\(url\)"):
        load(memory_dir, make_state())


def test_non_writable_path_fails_cleanly_and_keeps_older_checkpoints(tmp_path: Path) -> None:
    good = str(tmp_path / "ckpt")
    first = save(make_state(), good)
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(CheckpointError, match=r"could not write.*NotADirectoryError.*writable"):
        save(make_state(), str(blocker / "ckpt"))
    assert latest(good) == first


def test_resume_does_not_fall_back_over_a_configuration_error(memory_dir: str) -> None:
    step = make_train_step(mean_loss)
    events = Events().on("fit_start", resume_from(memory_dir))
    save(make_state(), memory_dir, step=step)
    with pytest.raises(ConfigError, match="accumulate"):
        run(accumulate(step, 2), make_state(), make_batches(2), events=events)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d: save(object(), d), r"save received state=<object.*not a TrainState"),  # type: ignore[arg-type]
        (lambda d: save(make_state(), 42), r"save received the location 42"),  # type: ignore[arg-type]
        (
            lambda d: save(make_state(), d, data=[1, 2]),
            r"data=\.\.\.\) received \[1, 2\].*resumable",
        ),
        (lambda d: save(make_state(), d, extras={"x": 3}), r"extras\['x'\] is 3.*state_dict"),
        (lambda d: save(make_state(), d, extras=[3]), r"extras=\.\.\.\) received \[3\]"),  # type: ignore[arg-type]
        (
            lambda d: save(make_state(), d, step="step"),
            r"step=\.\.\.\) received 'step'.*not a Step",
        ),
        (lambda d: save(make_state(), d, metrics=[0.1]), r"metrics=\.\.\.\) received \[0.1\]"),  # type: ignore[arg-type]
        (lambda d: checkpoint_every(d, every=0), r"every=\.\.\.\) received 0"),
        (lambda d: preemption(d), r"preemption\(checkpointer\) received"),
        (lambda d: preemption(checkpoint_every(d, every=1), signals=()), r"received no signals"),
        (lambda d: resumable_loader([1], batch_size=0), r"batch_size=\.\.\.\) received 0"),
        (lambda d: resumable_loader([1], batch_size=1, seed="0"), r"seed=\.\.\.\) received '0'"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_are_refused_with_the_fix(
    memory_dir: str, call: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        call(memory_dir)  # type: ignore[operator]


def test_load_into_a_state_built_differently(memory_dir: str) -> None:
    url = save(train(make_state()), memory_dir, extras={"ema": nn.Linear(2, 2)})
    model = make_state().model
    sgd = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"optimizer AdamW in the checkpoint, SGD here"):
        load(url, sgd, extras={"ema": nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match=r"scheduler StepLR in the checkpoint, None here"):
        load(url, make_state(scheduler=False), extras={"ema": nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match=r"scaler False in the checkpoint, True here"):
        load(url, make_state(scaler=True), extras={"ema": nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match=r"received the names \[\].*holds \['ema'\]"):
        load(url, make_state())
    loader = resumable_loader(list(range(4)), batch_size=2)
    with pytest.raises(ConfigError, match=r"holds no data position.*data=None"):
        load(url, make_state(), data=loader, extras={"ema": nn.Linear(2, 2)})


def _with_scaler(scaler: torch.amp.GradScaler | None, seed: int = 0) -> TrainState:
    model = make_state(seed).model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainState.create(model=model, optimizer=opt, scaler=scaler)


def test_a_scaler_that_scales_loads_only_into_one_that_scales(memory_dir: str) -> None:
    # The enabled=use_fp16 idiom saves a disabled GradScaler, whose state_dict is {}. Loading it
    # into an enabled one failed inside torch's load_state_dict after the model was loaded, and
    # an enabled one's scale was dropped in silence by a disabled one (a later save then held
    # {}). Both are refused before anything changes; None and a disabled one are alike.
    def enabled() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def disabled() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", enabled=False)

    for saved, here in ((disabled, enabled), (enabled, disabled)):
        url = save(train(_with_scaler(saved())), f"{memory_dir}/{saved.__name__}")
        fresh = _with_scaler(here(), seed=5)
        before = [p.detach().clone() for p in fresh.model.parameters()]
        with pytest.raises(
            ConfigError, match=rf"scaler {saved is enabled} in the checkpoint, {here is enabled}"
        ):
            load(url, fresh)
        assert all(map(torch.equal, before, fresh.model.parameters()))  # nothing changed
    for saved_scaler, here_scaler in ((None, disabled()), (disabled(), None)):
        url = save(train(_with_scaler(saved_scaler)), f"{memory_dir}/{saved_scaler is None}")
        assert load(url, _with_scaler(here_scaler, seed=5)).step == 3


def test_resume_may_add_or_drop_observation_only_wrappers(tmp_path) -> None:
    from steplib import TrainState, accumulate, make_train_step, tap
    from steplib.checkpoint import load, save
    from steplib.step import detect_anomaly
    from tests.reference import make_batches, tiny_model, token_loss

    model = tiny_model(0)
    state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_train_step(token_loss), 2)
    state, _ = step(state, make_batches(1)[0])
    state, _ = step(state, make_batches(1)[0])
    url = save(state, str(tmp_path / "ckpt"), step=step)
    debug = detect_anomaly(tap(step, after_backward=lambda s: None))
    assert load(url, state, step=debug).step == 1  # accepted: no wrapper that changes numbers

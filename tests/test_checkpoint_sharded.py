"""Sharded checkpoints (DCP through fsspec) on 2 ranks, gloo, CPU: exact resume for DDP and
FSDP2, resharding into 1 rank and into a plain module, asynchronous saves on their own process
group, integrity, retention by rank 0, and a failed save that leaves nothing behind.

Each 2-rank scenario runs once (a module fixture) and the tests read its results.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import pickle
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
import torch.distributed as dist

from steplib import ConfigError, Event, Events
from steplib.checkpoint import (
    AsyncSaver,
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    checkpoint_every,
    checkpointer,
    latest,
    list_checkpoints,
    load,
    preemption,
    resume_from,
    save,
    storage,
)
from steplib.checkpoint.dcp import MetadataReader
from steplib.data import resumable_loader
from steplib.testing import run_ranks
from tests import sharded_runs
from tests.checkpoint_helpers import assert_every_rank_saved_update_3_and_stopped, assert_same
from tests.sharded_runs import SAVE_AT, build, contents, full, plain_step, train

# A load on another number of ranks warns that no rank gets its saved generators back
# (tests/test_resume_other_world_size.py tests the warning); these tests are about the rest.
_RNG_NOT_RESTORED = "ignore:load. checkpoint .* is loaded on:steplib.errors.CheckpointWarning"
pytestmark = pytest.mark.filterwarnings(_RNG_NOT_RESTORED)


def _manifest(url: str) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(Path(url, "manifest.json").read_bytes())
    return body


def _slow_background_writes(rank: int, seconds: float) -> None:
    """On ``rank``, each train-state file written outside the main thread (by AsyncSaver)
    starts late, so the other rank's background save waits in a collective of the checkpoint
    group while both ranks train on (all-reduces on the default group)."""
    write = storage.write_tensors

    def slow(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == rank and threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return write(*args, **kwargs)

    storage.write_tensors = slow  # a forked rank: the patch dies with the process


def _async_and_sync_at(root: str, loader: Any, step: Any, out: dict[str, Any]) -> Any:
    """A step_end handler: at SAVE_AT, a sync save to root/sync and an async one to
    root/async (same state); one update later, whether the async one is still writing."""
    saver = AsyncSaver()
    out["saver"] = saver

    def handler(event: Event) -> None:
        if event.step == SAVE_AT:
            out["sync_url"] = save(event.state, f"{root}/sync", data=loader, step=step)
            out["async_url"] = saver.save(event.state, f"{root}/async", data=loader, step=step)
            # The parameters and optimizer state are left to a background copy, which the
            # next update waits for (and tests above compare the checkpoint with a sync one).
            out["background_copies"] = event.state.fence.held
        elif event.step == SAVE_AT + 1:
            out["pending_after_next_update"] = saver.pending

    return handler


def _loaded(kind: str, rank: int, url: str) -> dict[str, Any]:
    """Load ``url`` into a fresh run (other initial weights, scrambled RNG): its contents and
    the next batch of its data."""
    state, step, loader = build(kind, rank, seed=7)
    torch.manual_seed(999)
    state = load(url, state, data=loader, step=step)
    found = contents(state)
    found["next_batch"] = next(iter(loader))
    del state, step
    return found


def _ddp_run(rank: int, world: int, *, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}

    # The uninterrupted reference.
    state, step, loader = build("ddp", rank)
    state, losses = train(state, step, loader)
    results["reference"] = {"losses": losses, **contents(state)}

    # The same run saving: every update into keep/ (keep_last=2), at SAVE_AT sync and async.
    _slow_background_writes(rank=0, seconds=0.3)
    prunes: list[int] = []
    prune = checkpointer.prune

    def counting_prune(*args: Any, **kwargs: Any) -> list[str]:
        prunes.append(1)
        return prune(*args, **kwargs)

    checkpointer.prune = counting_prune  # a forked rank: the patch dies with the process
    state, step, loader = build("ddp", rank)
    events = Events()
    checkpoint_every(f"{root}/keep", every=1, keep_last=2, data=loader).attach(events)
    saves: dict[str, Any] = {}
    events.on("step_end", _async_and_sync_at(root, loader, step, saves))
    state, losses = train(state, step, loader, events=events)
    saves.pop("saver").close()
    results["saving"] = {"losses": losses, "prunes": len(prunes), **contents(state), **saves}

    # Resume on 2 ranks from the sync checkpoint; load the async one too.
    state, step, loader = build("ddp", rank, seed=7)
    torch.manual_seed(999)
    state = load(saves["sync_url"], state, data=loader, step=step)
    state, losses = train(state, step, loader)
    results["resumed"] = {"losses": losses, **contents(state)}
    results["sync_loaded"] = _loaded("ddp", rank, saves["sync_url"])
    results["async_loaded"] = _loaded("ddp", rank, saves["async_url"])

    keep = f"{root}/keep"
    results["kept"] = [c.step for c in list_checkpoints(keep)]
    newest = list_checkpoints(keep)[-1].url
    results["files"] = sorted(_manifest(newest)["files"])

    # One altered byte in the biggest shard of the newest checkpoint.
    shards = {n: r["bytes"] for n, r in _manifest(newest)["files"].items() if n.endswith(".distcp")}
    target = max(shards, key=lambda n: shards[n])
    results["corrupted"] = target
    if rank == 0:
        with open(f"{newest}/{target}", "r+b") as file:
            file.seek(shards[target] // 2)
            byte = file.read(1)
            file.seek(shards[target] // 2)
            file.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    state, step, loader = build("ddp", rank, seed=7)
    try:
        load(newest, state, data=loader, step=step)
    except CorruptCheckpointError as err:
        results["corrupt_error"] = str(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["latest"] = latest(keep)
        resumed = resume_from(keep, data=loader)(Event("fit_start", state=state))
        results["resume_from"] = (resumed.state.step, resumed.state.epoch)  # type: ignore[union-attr]
    results["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]

    # A failed save on rank 1 only: both ranks raise, nothing is committed or left behind.
    write = storage.write_tensors

    def failing(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    storage.write_tensors = failing
    try:
        save(resumed.state.replace(step=99), keep)  # type: ignore[union-attr]
    except CheckpointError as err:
        results["failed_save"] = str(err)
    storage.write_tensors = write
    results["after_failed_save"] = sorted(os.listdir(keep))
    del state, step, loader, resumed
    return results


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("sharded-ddp"))
    rank0, rank1 = run_ranks(functools.partial(_ddp_run, root=root), timeout=90)
    return {"ranks": [rank0, rank1], "root": root}


def test_ddp_sharded_resume_on_2_ranks_is_bit_exact(ddp: dict[str, Any]) -> None:
    for result in ddp["ranks"]:
        reference, resumed = result["reference"], result["resumed"]
        assert len(reference["losses"]) == sharded_runs.UPDATES
        assert_same(resumed["losses"], reference["losses"][SAVE_AT:], "losses")
        for key in ("params", "optimizer", "lr", "scheduler", "counters", "rng"):
            assert_same(resumed[key], reference[key], key)


def test_ddp_async_save_equals_the_sync_save_and_training_is_not_corrupted(
    ddp: dict[str, Any],
) -> None:
    assert ddp["ranks"][0]["saving"][
        "pending_after_next_update"
    ]  # it was written while training ran
    for result in ddp["ranks"]:
        saving, reference = result["saving"], result["reference"]
        assert saving["background_copies"] == 1
        assert_same(saving["losses"], reference["losses"], "losses")
        for key in ("params", "optimizer", "scheduler", "counters", "rng"):
            assert_same(saving[key], reference[key], key)
        assert_same(result["async_loaded"], result["sync_loaded"], "async vs sync")
        assert result["sync_loaded"]["counters"][0] == SAVE_AT


def test_sharded_retention_is_pruned_by_rank_0_and_the_manifest_lists_every_rank(
    ddp: dict[str, Any],
) -> None:
    rank0, rank1 = ddp["ranks"]
    assert rank0["saving"]["prunes"] > 0 and rank1["saving"]["prunes"] == 0
    for result in ddp["ranks"]:
        assert result["kept"] == [5, 6]
        files = result["files"]
        assert {"rank-00000.pt", "rank-00001.pt", "dcp/.metadata"} <= set(files)
        assert any(f.endswith(".distcp") for f in files)


def test_a_corrupt_shard_is_named_and_latest_falls_back(ddp: dict[str, Any]) -> None:
    for result in ddp["ranks"]:
        assert result["corrupted"] in result["corrupt_error"]
        assert "has checksum xxh3_64" in result["corrupt_error"]
        assert result["latest"].endswith("step-00000005")
        assert result["resume_from"][0] == 5
        categories = {category for category, _ in result["warnings"]}
        assert categories == {CheckpointWarning.__name__}
        assert all(result["corrupted"] in message for _, message in result["warnings"])


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_commits_nothing(
    ddp: dict[str, Any],
) -> None:
    for result in ddp["ranks"]:
        assert "rank 1: OSError" in result["failed_save"]
        assert "No space left on device" in result["failed_save"]
        assert result["after_failed_save"] == ["step-00000005", "step-00000006"]


def _fsdp_run(rank: int, world: int, *, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    state, step, loader = build("fsdp", rank)
    state, losses = train(state, step, loader)
    results["reference"] = {"losses": losses, **contents(state)}

    state, step, loader = build("fsdp", rank)
    events = Events()
    saves: dict[str, Any] = {}
    events.on("step_end", _async_and_sync_at(root, loader, step, saves))
    at_save: dict[str, Any] = {}
    events.on("step_end", lambda e: at_save.update(full(e.state)) if e.step == SAVE_AT else None)
    state, losses = train(state, step, loader, events=events)
    saves.pop("saver").close()
    results["saving"] = {"losses": losses, **contents(state), **saves}
    results["full_at_save"] = at_save

    state, step, loader = build("fsdp", rank, seed=7)
    torch.manual_seed(999)
    state = load(saves["sync_url"], state, data=loader, step=step)
    state, losses = train(state, step, loader)
    results["resumed"] = {"losses": losses, **contents(state)}
    results["sync_loaded"] = _loaded("fsdp", rank, saves["sync_url"])
    results["async_loaded"] = _loaded("fsdp", rank, saves["async_url"])

    # An extra object holding DTensors (the FSDP2 model itself, as an EMA of it would).
    results["dtensor_extras_url"] = save(state, f"{root}/extras", extras={"shadow": state.model})

    # Inside an open window FSDP2's gradients cannot be saved: refused, with the fix.
    state, step, loader = build("fsdp", rank)
    state, _ = step(state, next(iter(loader)))
    try:
        save(state, f"{root}/window")
    except ConfigError as err:
        results["window_error"] = str(err)
    del state, step, loader
    return results


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("sharded-fsdp"))
    rank0, rank1 = run_ranks(functools.partial(_fsdp_run, root=root), timeout=90)
    return {"ranks": [rank0, rank1], "root": root}


def test_fsdp_sharded_resume_on_2_ranks_is_bit_exact(fsdp: dict[str, Any]) -> None:
    for result in fsdp["ranks"]:
        reference, resumed = result["reference"], result["resumed"]
        assert_same(resumed["losses"], reference["losses"][SAVE_AT:], "losses")
        for key in ("params", "optimizer", "lr", "scheduler", "counters", "rng"):
            assert_same(resumed[key], reference[key], key)


def test_fsdp_async_save_equals_the_sync_save_and_training_is_not_corrupted(
    fsdp: dict[str, Any],
) -> None:
    for result in fsdp["ranks"]:
        saving, reference = result["saving"], result["reference"]
        assert saving["background_copies"] == 1
        assert_same(saving["losses"], reference["losses"], "losses")
        assert_same(saving["params"], reference["params"], "params")
        assert_same(result["async_loaded"], result["sync_loaded"], "async vs sync")


def test_fsdp_save_inside_an_open_window_is_refused_with_the_fix(fsdp: dict[str, Any]) -> None:
    for result in fsdp["ranks"]:
        assert "open accumulation window" in result["window_error"]
        assert "Save between windows" in result["window_error"]


def test_a_2_rank_fsdp_checkpoint_loads_into_a_plain_module(fsdp: dict[str, Any]) -> None:
    url = fsdp["ranks"][0]["saving"]["sync_url"]
    want = fsdp["ranks"][0]["full_at_save"]
    state, _, _ = build_plain(seed=7)
    # The step without fsdp_wrap: the distribution may change, the rest must not.
    state = load(url, state, step=plain_step())
    got = full(state)
    assert_same(got, want, "plain module")
    assert (state.step, state.micro_step) == (SAVE_AT, 2 * SAVE_AT)
    assert state.scheduler is not None and state.scheduler.last_epoch == SAVE_AT
    assert latest(fsdp["root"] + "/sync") == url


def test_extras_holding_dtensors_are_not_resharded_onto_another_world_size(
    fsdp: dict[str, Any],
) -> None:
    state, _, _ = build_plain(seed=7)
    with pytest.raises(ConfigError, match=r"of 2 ranks, loaded on 1, .*DTensors.*Resume on 2"):
        load(
            fsdp["ranks"][0]["dtensor_extras_url"],
            state,
            extras={"shadow": build_plain(seed=7)[0].model},
        )


def test_a_2_rank_checkpoint_on_1_rank_refuses_the_per_rank_data_position(
    fsdp: dict[str, Any],
) -> None:
    url = fsdp["ranks"][0]["saving"]["sync_url"]
    state, _, loader = build_plain(seed=7)
    with pytest.raises(ConfigError, match="data=None"):
        load(url, state, data=loader)


def _fsdp_one_rank(rank: int, world: int, *, url: str) -> dict[str, Any]:
    state, step, loader = build("fsdp", rank, seed=7)
    state = load(url, state, step=step)
    found = full(state)
    state, losses = train(state, step, loader)  # training goes on, resharded
    found["losses"] = losses
    del state, step, loader
    return found


def test_a_2_rank_fsdp_checkpoint_loads_into_1_rank(fsdp: dict[str, Any]) -> None:
    url = fsdp["ranks"][0]["saving"]["sync_url"]
    (found,) = run_ranks(functools.partial(_fsdp_one_rank, url=url), world=1, timeout=60)
    losses = found.pop("losses")
    assert_same(found, fsdp["ranks"][0]["full_at_save"], "1 rank")
    assert len(losses) == sharded_runs.UPDATES - SAVE_AT
    assert all(torch.isfinite(loss) for loss in losses)


def build_plain(*, seed: int) -> tuple[Any, Any, Any]:
    """The run of ``sharded_runs.build`` on a plain module in this process (no process group)."""
    from steplib import TrainState

    net = sharded_runs.model(seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state = TrainState.create(
        model=net,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )
    data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randn(24, 3))
    return state, plain_step(), resumable_loader(data, batch_size=4, seed=0)


def _preempted(rank: int, world: int, *, root: str, inside_agreement: bool) -> dict[str, Any]:
    """A DDP run in which rank 1 alone is signalled during update 2: after that update's
    handlers ran, or while it waits in the ranks' all-reduce of the flag (which it entered
    having read its flag: 0), as a scheduler's SIGTERM can land at any moment."""
    # The module (the package's name `preemption` is the function that builds the handler).
    preemption_module: Any = importlib.import_module("steplib.checkpoint.resume")
    state, step, loader = build("ddp", rank)
    checkpointer = checkpoint_every(f"{root}/preempt", every=100, data=loader)
    handler = preemption(checkpointer)
    events = handler.attach(checkpointer.attach(Events()))
    agree, calls = preemption_module.max_over_ranks, itertools.count(1)

    def signal_rank_1() -> None:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would, to one rank only

    def during_the_agreement(value: Any, *, group: Any) -> Any:
        if next(calls) == 2:  # one agreement per update: the second is update 2's
            signal_rank_1()
        return agree(value, group=group)

    if inside_agreement:
        preemption_module.max_over_ranks = during_the_agreement
    else:  # after the preemption check of update 2
        events.on("step_end", lambda e: signal_rank_1() if e.step == 2 else None, last=True)
    try:
        state, _ = train(state, step, loader, events=events)
    finally:
        preemption_module.max_over_ranks = agree
    result = {"step": state.step, "saved": handler.saved, "exit_code": handler.exit_code}
    del state, step, loader
    return result


@pytest.mark.parametrize("inside_agreement", [False, True], ids=["after-handlers", "mid-reduce"])
def test_a_signal_on_one_rank_makes_every_rank_save_the_same_update_and_stop(
    tmp_path: Path, inside_agreement: bool
) -> None:
    # Signalled during update 2: both ranks agree at update 3. Inside the agreement, before:
    # rank 1 read its flag again after the all-reduce (which had given 0), saved alone and
    # entered the save's collectives while rank 0 trained on (a hang).
    run = functools.partial(_preempted, root=str(tmp_path), inside_agreement=inside_agreement)
    results = run_ranks(run, timeout=60)
    assert_every_rank_saved_update_3_and_stopped(results, tmp_path)
    assert results[0]["step"] == 3


class _Payload:
    """Unpickling this runs code (here: creates a file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_dcp_metadata_that_would_run_code_is_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(pickle.UnpicklingError, match=r"pathlib\.Path\.touch"):
        MetadataReader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def _ddp_mid_window(rank: int, world: int, *, root: str) -> dict[str, Any]:
    shadow = torch.nn.Linear(2, 2)  # an extra object, different on each rank
    torch.nn.init.constant_(shadow.weight, float(rank + 1))

    def micro_batches(state: Any, step: Any, loader: Any, stop: int, url: list[str]) -> Any:
        losses = []
        for batch in loader:
            state, out = step(state, batch)
            if out.did_update:
                losses.append(out.loss)
            if state.micro_step == 3 and not url:  # the second window is half done
                extras = {"shadow": shadow}
                url.append(save(state, root, data=loader, step=step, extras=extras))
            if state.micro_step == stop:
                break
        return state, losses

    state, step, loader = build("ddp", rank)
    url: list[str] = []
    state, reference = micro_batches(state, step, loader, 6, url)
    want = contents(state)
    state, step, loader = build("ddp", rank, seed=7)
    torch.manual_seed(999)
    fresh = torch.nn.Linear(2, 2)
    state = load(url[0], state, data=loader, step=step, extras={"shadow": fresh})
    window = state.window.size
    state, resumed = micro_batches(state, step, loader, 6, [url[0]])
    result = {"want": want, "got": contents(state), "window": window, "url": url[0]}
    result["shadow"] = (fresh.state_dict(), shadow.state_dict())
    result["losses"] = (reference[1:], resumed)
    del state, step, loader
    return result


def test_ddp_sharded_checkpoint_inside_an_open_window_resumes_bit_exact(tmp_path: Path) -> None:
    for result in run_ranks(functools.partial(_ddp_mid_window, root=str(tmp_path)), timeout=60):
        assert result["url"].endswith("step-00000001-micro-00000003")
        assert result["window"] == 1  # one micro-batch of the open window, with its gradients
        assert_same(result["got"], result["want"], "mid-window resume")
        reference, resumed = result["losses"]
        assert_same(resumed, reference, "losses")
        loaded, saved = result["shadow"]
        assert_same(loaded, saved, "this rank's extra object")


def test_a_sharded_checkpoint_that_does_not_fit_is_refused_before_loading(
    fsdp: dict[str, Any],
) -> None:
    from steplib import TrainState, accumulate, make_train_step

    url = fsdp["ranks"][0]["saving"]["sync_url"]
    state, _, _ = build_plain(seed=7)
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(ConfigError, match="clip"):  # another composition (clip missing)
        load(url, state, step=accumulate(make_train_step(sharded_runs.loss_fn), 2))
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(wider.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    other = TrainState.create(model=wider, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(ConfigError, match=r"another model.*0\.weight \(16, 8\)"):
        load(url, other)
    # The same model and optimizer class, with settings whose state the checkpoint lacks.
    net = sharded_runs.model(7)
    amsgrad = torch.optim.AdamW(net.parameters(), lr=1e-2, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.StepLR(amsgrad, step_size=2, gamma=0.5)
    settings = TrainState.create(model=net, optimizer=amsgrad, scheduler=scheduler)
    kept = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ConfigError, match=r"no optimizer state for .*max_exp_avg_sq.*momentum"):
        load(url, settings)
    assert_same([p.detach() for p in net.parameters()], kept, "untouched")
    assert_same([p.detach() for p in state.model.parameters()], before, "untouched")


def _saved_before_the_first_update(rank: int, world: int, *, root: str) -> dict[str, Any]:
    state, _, _ = build("ddp", rank)
    for group in state.optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.25, 0.125  # settings, no state yet
    url = save(state, root)
    fresh, _, _ = build("ddp", rank, seed=7)
    loaded = load(url, fresh)
    groups = [(g["lr"], g["weight_decay"], len(g["params"])) for g in fresh.optimizer.param_groups]
    result = {"groups": groups, "state": len(loaded.optimizer.state)}
    del state, fresh, loaded
    return result


def test_a_sharded_checkpoint_before_the_first_update_restores_the_optimizer_settings(
    tmp_path: Path,
) -> None:
    run = functools.partial(_saved_before_the_first_update, root=str(tmp_path))
    for result in run_ranks(run, timeout=60):
        assert result["state"] == 0
        assert result["groups"] == [(0.25, 0.125, len(list(sharded_runs.model(0).parameters())))]

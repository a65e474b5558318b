"""A run prototyped on one process and continued on 2 DDP ranks (gloo): its checkpoint resumes
there as a sharded one resumes on another number of ranks.

Before, ``resume_from`` refused it for the step's composition (``ddp_wrap`` added), and the
fix it gave (load without ``step=``) led into a second refusal: the DDP model's names carry
``module.``. Now the distribution wrappers are left out of the comparison for either back-end,
the weights are found by their plain names, and what cannot continue on another number of
ranks is refused: an open accumulation window's gradients, and a data position that is not
``shard=True``'s (it went to every rank as it was, loaded into the DDP model's module)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from steplib import ConfigError, TrainState, accumulate, ddp_wrap, make_train_step, run
from steplib.checkpoint import checkpoint_every, latest, load, resume_from, save
from steplib.data import resumable_loader
from steplib.distributed import apply_ddp
from steplib.testing import run_ranks

BATCHES = list(torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(1)))


class _Mixup:
    """A collate_fn with a generator of its own, saved with the position (own_states)."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(rows) * torch.rand(1, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["gen"])


def _loader(name: str, rank: int = 0) -> Any:
    """Each checkpoint's loader: "position" per rank (its own data), "sharded" shard=True,
    "own" with _Mixup."""
    collate = _Mixup() if name == "own" else None
    data = torch.randn(16, 4) + (rank if name == "position" else 0)
    return resumable_loader(data, batch_size=2, shard=name != "position", collate_fn=collate)


def _build(*, ddp: bool) -> tuple[TrainState, Any]:
    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net = apply_ddp(net) if ddp else net
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    step = make_train_step(lambda model, batch: model(batch).pow(2).mean())
    return TrainState.create(model=net, optimizer=opt), ddp_wrap(step) if ddp else step


def _result(state: TrainState) -> dict[str, Any]:
    module: Any = state.model.module
    params = {k: v.tolist() for k, v in module.state_dict().items()}
    momenta = [s["momentum_buffer"].tolist() for s in state.optimizer.state.values()]
    return {"step": state.step, "params": params, "momenta": momenta}


def _on_ranks(rank: int, world: int, *, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = BATCHES[4 + rank :: 2]  # each rank its own batches after the prototype's 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators (rng_is_own), a position unsaved
        state, step = _build(ddp=True)
        resumed = run(step, state, mine, events=[resume_from(str(root / "one"))], max_steps=6)
        out["resumed"] = _result(resumed)
    # The reference: the files' weights and momenta put in by hand, the counters set.
    state, step = _build(ddp=True)
    url = Path(str(latest(str(root / "one"))))
    module: Any = state.model.module
    module.load_state_dict(torch.load(url / "model.pt", weights_only=True))
    state.optimizer.load_state_dict(torch.load(url / "optimizer.pt", weights_only=True))
    out["by_hand"] = _result(run(step, state.replace(step=4, micro_step=4), mine, max_steps=6))
    for name in ("window", "position", "sharded", "own"):  # refused, as the message says
        state, _ = _build(ddp=True)
        data = None if name == "window" else _loader(name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the generators (rng_is_own)
                load(
                    str(latest(str(root / name))),
                    state.replace(model=state.model.module),
                    data=data,
                )
            out[name] = "loaded"
        except ConfigError as err:
            out[name] = str(err)
    del state, step, resumed
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("one-on-ranks")
    state, step = _build(ddp=False)  # the prototype: 4 updates on one process
    run(step, state, BATCHES[:4], events=[checkpoint_every(str(root / "one"), every=4)])
    state, step = _build(ddp=False)  # saved inside a window of 2 micro-batches
    state, _ = accumulate(step, 2)(state, BATCHES[0])
    save(state, str(root / "window"))
    for name in ("position", "sharded", "own"):  # one process's loader's positions
        state, step = _build(ddp=False)
        every = checkpoint_every(str(root / name), every=2)
        run(step, state, _loader(name), events=[every], max_steps=2)
    return run_ranks(functools.partial(_on_ranks, root=root), world=2, timeout=120)


def test_a_one_process_checkpoint_resumes_on_ddp_ranks_as_loaded_by_hand(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in ranks:
        assert rank["resumed"]["step"] == 6
        assert rank["resumed"] == rank["by_hand"]
    assert ranks[0]["resumed"] == ranks[1]["resumed"]  # DDP keeps them equal


def test_what_cannot_continue_on_more_ranks_is_refused(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert "inside an accumulation window by rank 0 of 1 process(es)" in rank["window"]
        assert "written by 1 ranks and is loaded on 2" in rank["position"]
        assert "shard=True" in rank["position"]
        assert rank["sharded"] == "loaded"  # shard=True's position carries over
        # Before: the one process's collate_fn state went to both ranks (the same mixup).
        assert "holds the collate's own state (state_dict()) of one saving rank" in rank["own"]


def _saved_by_rank_0_alone(rank: int, world: int, *, root: Path) -> dict[str, str]:
    # docs/checkpoints.md's single-process checkpoint of a DDP run: rank 0 saves its module.
    for name in ("window", "position", "sharded", "own"):
        state, step = _build(ddp=True)
        data = None
        if name == "window":
            state, _ = accumulate(step, 2)(state, BATCHES[rank])
        else:
            data = _loader(name, rank)
            state = run(step, state, data, max_steps=2)
        if rank == 0:
            save(state.replace(model=state.model.module), str(root / name), data=data)
        del state, step
        torch.distributed.barrier()
    out = {}
    for name in ("window", "position", "sharded", "own"):  # every rank loads rank 0's
        state, _ = _build(ddp=True)
        data = None if name == "window" else _loader(name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the generators (rng_is_own)
                url = str(latest(str(root / name)))
                load(url, state.replace(model=state.model.module), data=data)
            out[name] = "loaded"
        except ConfigError as err:
            out[name] = str(err)
        del state
    return out


def test_rank_0s_own_checkpoint_loads_on_rank_0_and_its_own_state_on_no_other(
    tmp_path: Path,
) -> None:
    # Before: rank 1 loaded rank 0's open window (its unsynchronised gradients), its per-rank
    # position (no shard=True) and its collate_fn's generator (both ranks the same mixup).
    saver, other = run_ranks(functools.partial(_saved_by_rank_0_alone, root=tmp_path), world=2)
    assert saver == dict.fromkeys(saver, "loaded")  # its own, whatever it holds
    assert other["sharded"] == "loaded"  # the same position on every rank
    assert "window by rank 0 of 2 process(es)" in other["window"]
    for name in ("position", "own"):
        assert "written by rank 0 of 2 alone and is loaded on another rank" in other[name]
        assert "Save on every rank" in other[name]
    assert "holds the collate's own state" in other["own"]

"""Launch environments read from faked environments, and a real 2-process torchrun run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from steplib import ConfigError
from steplib.distributed import (
    LaunchEnv,
    apply_ddp,
    first_slurm_host,
    init_distributed,
    is_main,
    rank,
    read_launch_env,
    world_size,
)
from tests.reference import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_environment() -> None:
    env = read_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500",
        }
    )
    assert env == LaunchEnv(3, 4, 1, "node0", 29500, "torchrun")


def test_slurm_environment_takes_the_first_node_as_rendezvous() -> None:
    env = read_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08],gpu11",
            "MASTER_PORT": "29400",
        }
    )
    assert env == LaunchEnv(5, 8, 1, "gpu07", 29400, "slurm")


def test_torchrun_inside_slurm_wins() -> None:
    env = read_launch_env(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"}
    )
    assert env.launcher == "torchrun" and env.rank == 1


def test_open_mpi_environment() -> None:
    env = read_launch_env(
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "MASTER_ADDR": "head",  # mpirun -x MASTER_ADDR -x MASTER_PORT
            "MASTER_PORT": "29500",
        }
    )
    assert env == LaunchEnv(6, 8, 2, "head", 29500, "openmpi")


def test_intel_mpi_and_mpich_hydra_environment() -> None:
    env = read_launch_env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"})
    assert env == LaunchEnv(3, 4, 1, None, None, "mpi")  # no rendezvous: init_distributed says so


def test_mpi_without_a_local_rank_and_open_mpi_before_pmi() -> None:
    assert read_launch_env({"PMI_RANK": "0", "PMI_SIZE": "2"}).local_rank == 0
    both = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMI_RANK": "0"}
    assert read_launch_env({**both, "PMI_SIZE": "2"}).launcher == "openmpi"


def test_srun_with_pmi_sets_both_and_slurm_wins() -> None:
    env = read_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "MASTER_PORT": "29400",
            "PMI_RANK": "5",  # srun --mpi=pmi2 sets these alike
            "PMI_SIZE": "8",
        }
    )
    assert env == LaunchEnv(5, 8, 1, "gpu07", 29400, "slurm")


def test_mpirun_inside_sbatch_uses_mpi_ranks_and_the_allocations_first_node() -> None:
    # Every process inherits the batch step's SLURM_PROCID=0: the SLURM values are stale.
    env = read_launch_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "0",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "MASTER_PORT": "29400",
        }
    )
    assert env == LaunchEnv(5, 8, 1, "gpu07", 29400, "openmpi")


def test_torchrun_inside_mpi_wins() -> None:
    env = read_launch_env(
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "RANK": "1", "WORLD_SIZE": "2"}
    )
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 1, 2)


def test_no_launcher_is_one_process_and_queries_work_without_a_group() -> None:
    assert read_launch_env({}) == LaunchEnv(0, 1, 0, None, None, "single")
    assert (rank(), world_size(), is_main()) == (0, 1, True)


@pytest.mark.parametrize(
    ("nodes", "first"), [("n1", "n1"), ("n[1-3]", "n1"), ("a[09,12-14],b2", "a09"), ("x,y", "x")]
)
def test_slurm_node_lists(nodes, first) -> None:
    assert first_slurm_host(nodes) == first


def test_bad_environments_are_explained() -> None:
    with pytest.raises(ConfigError, match="RANK='one' is not an integer"):
        read_launch_env({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="rank 2 for a world of 2"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_SIZE='x' is not an integer"):
        read_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "x"})
    with pytest.raises(ConfigError, match="The mpi environment gives rank 4 for a world of 4"):
        read_launch_env({"PMI_RANK": "4", "PMI_SIZE": "4"})


def test_init_distributed_without_rendezvous_says_what_to_set(monkeypatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ConfigError, match="MASTER_ADDR/MASTER_PORT"):
        init_distributed()


@pytest.mark.parametrize(("backend", "gpus", "device"), [("gloo", 2, 1), ("gloo", 1, None)])
def test_init_distributed_puts_each_rank_on_its_own_gpu_with_gloo_too(
    monkeypatch, backend: str, gpus: int, device: int | None
) -> None:
    # Before, only nccl set the device: under gloo every rank's .to("cuda") landed on GPU 0.
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: None)
    init_distributed(backend=backend)
    assert chosen == ([] if device is None else [device])  # a GPU that exists, or none


def test_apply_ddp_without_a_group_says_what_to_call() -> None:
    with pytest.raises(ConfigError, match="init_distributed"):
        apply_ddp(tiny_model(0))


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        # Port 0: the c10d rendezvous picks a free port itself (no race with other tests).
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_torchrun_two_processes_run_the_example_and_exit_0() -> None:
    done = _torchrun(str(ROOT / "examples" / "ddp_train.py"), "--steps", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert lines == [lines[0], lines[1]] and lines[-1].startswith("step 10 loss")  # rank 0 only


_DDP_THEN_SHUTDOWN = """
import os, torch, steplib
from steplib.distributed import apply_ddp, init_distributed, shutdown
init_distributed()
model = apply_ddp(torch.nn.Linear(4, 1))  # its constructor imports torch._dynamo
model(torch.ones(2, 4)).sum().backward()
del model
shutdown()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
left = sum(name.startswith(("pt_gloo", "gloo")) for name in names)
os.write(1, f"gloo threads left: {left}\\n".encode())  # one write: the ranks' lines never mix
"""


_RUN_THEN_SHUTDOWN = """
import os, sys, torch, steplib
from steplib import Events, TrainState, checkpoint_every, ddp_wrap, make_train_step, resume_from
from steplib import resumable_loader, run
from steplib.checkpoint import preemption
from steplib.distributed import apply_ddp, init_distributed, shutdown
init_distributed()
data = resumable_loader(torch.utils.data.TensorDataset(torch.ones(16, 4)), batch_size=2, seed=0,
                        shard=True)
model = apply_ddp(torch.nn.Linear(4, 1))
state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
step = ddp_wrap(make_train_step(lambda model, batch: model(batch[0]).pow(2).mean()))
events = Events()  # kept, with its handlers, as a script's are until it ends
events.on("fit_start", resume_from(sys.argv[1], data=data))
saves = checkpoint_every(sys.argv[1], every=2, data=data, background=True)
saves.attach(events)
preemption(saves).attach(events)
state = run(step, state, data, events=events, max_steps=int(sys.argv[2]))
del model, state, step  # what the user holds of the run
shutdown()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
left = sum(name.startswith(("pt_gloo", "gloo")) for name in names)
os.write(1, f"gloo threads left: {left}\\n".encode())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_shutdown_after_a_checkpointed_run_leaves_no_gloo_thread_to_abort_the_exit(
    tmp_path: Path,
) -> None:
    # The checkpoint handler kept the run's last state (so its DDP model and process group)
    # and its gloo groups after the run: destroy_process_group does not stop gloo's threads,
    # so they outlived shutdown(), and a finished torchrun job aborted at exit (SIGABRT, CI).
    script = tmp_path / "run_then_shutdown.py"
    script.write_text(_RUN_THEN_SHUTDOWN)
    for max_steps in ("4", "6"):  # saves, then resumes and saves in the background
        done = _torchrun(str(script), str(tmp_path / "checkpoints"), max_steps)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("gloo threads left: 0") == 2, done.stdout + done.stderr


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_shutdown_after_ddp_leaves_no_gloo_thread_to_abort_the_exit(tmp_path: Path) -> None:
    # torch.distributed.nn.functional's default arguments held the default group when DDP's
    # constructor first imported it: destroy_process_group could not free the group, its gloo
    # threads outlived it, and one dropping a tensor during interpreter exit aborted a
    # finished job (SIGABRT) about one run in three. steplib imports it before any group.
    script = tmp_path / "ddp_then_shutdown.py"
    script.write_text(_DDP_THEN_SHUTDOWN)
    done = _torchrun(str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("gloo threads left: 0") == 2, done.stdout + done.stderr

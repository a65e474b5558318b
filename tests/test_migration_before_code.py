"""The "Before" code of each migration guide runs with the library it migrates from.

A guide whose "before" column misuses the peer's API would lose the reader at once, so each
"## Before" block of docs/migration/*.md is executed on the same tiny data as its steplib
script. The peers (lightning, accelerate, pytorch-ignite) come with the ``bench`` extra, not
``dev``: a guide whose peer is not installed is left out (and named in the output), while the
in-house ``BaseTrainer`` needs only torch and always runs. The Hugging Face guide describes
``transformers`` in prose and is not executed.

All blocks run in one child process: the peers install signal handlers, seeds and warnings
filters of their own, which must not leak into this test session.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = {"lightning": "lightning", "accelerate": "accelerate", "ignite": "ignite"}

RUNNER = r"""
import importlib.util, os, re, sys, tempfile, warnings

import torch
from torch.utils.data import DataLoader

root = sys.argv[1]


def example(name):
    path = os.path.join(root, "examples", f"migrate_from_{name}.py")
    spec = importlib.util.spec_from_file_location(f"migrate_from_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loaders(name):
    m, gen = example(name), torch.Generator().manual_seed(0)
    if name == "lightning":
        return {"train_loader": DataLoader(m.blobs(2048, seed=1), batch_size=32, shuffle=True,
                                           generator=gen),
                "val_loader": DataLoader(m.blobs(512, seed=2), batch_size=256)}
    if name == "accelerate":
        return {"train_loader": DataLoader(m.regression_data(1024, seed=1), batch_size=16,
                                           shuffle=True, generator=gen)}
    if name == "ignite":
        return {"train_loader": DataLoader(m.rings(1024, seed=1), batch_size=32, shuffle=True,
                                           generator=gen),
                "val_loader": DataLoader(m.rings(512, seed=2), batch_size=256)}
    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    return {"train_loader": DataLoader(m.two_moons(1000, seed=1), batch_size=25, shuffle=True,
                                       generator=gen),
            "val_loader": DataLoader(m.two_moons(500, seed=2), batch_size=250),
            "model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "scheduler": None}


for name in sys.argv[2:]:
    text = open(os.path.join(root, "docs", "migration", f"{name}.md")).read()
    code = re.search(r"## Before\n.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    namespace = loaders(name)
    os.chdir(tempfile.mkdtemp(prefix=f"before-{name}-"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers' own advice (num_workers, ...), not ours
        exec(compile(code, f"docs/migration/{name}.md (Before)", "exec"), namespace)
    print("ran", name, flush=True)
"""


def test_the_before_code_of_each_guide_runs_with_its_library() -> None:
    names = [name for name, module in PEERS.items() if importlib.util.find_spec(module)]
    names.append("base_trainer")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)  # Accelerate and Lightning read them: run as one process
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(ROOT), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ran ")]
    assert ran == names
    missing = sorted(set(PEERS) - set(names))
    print(f"ran the Before code of {ran}; not installed, so not run: {missing}")

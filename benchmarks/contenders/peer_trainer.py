"""The Lightning Trainer, in barebones mode, paused inside one continuous ``fit``.

Interleaving the Trainer needs it to stop after a few updates and continue later. Re-entering
``trainer.fit`` with a larger ``max_steps`` works, but each call repeats the set-up (strategy,
hooks, data fetcher, a fresh epoch over the data) at a few ms per call, which at a few updates
per chunk would be charged as per-step overhead that a real run pays once. So ``fit`` runs once,
in a worker thread, and a callback blocks at the chunk's last update until the harness asks
for the next chunk. The worker times its own chunk (from the resume to the pause), so the
thread hand-off is not charged to the Trainer; the harness thread is blocked meanwhile, so the
two never run at once.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from benchmarks.contenders import Contender
from benchmarks.contenders._quiet import quiet
from benchmarks.contenders.peer_ignite import _Pool
from benchmarks.workloads import Setup

# Generous: a chunk of the compute-bound workload takes well under a second.
_HANDOFF_TIMEOUT_S = 300.0


class TrainerContender(Contender):
    name = "trainer"
    label = "Lightning Trainer"
    requires = ("lightning",)
    distributions = ("lightning",)
    notes = (
        "Trainer(barebones=True: no logger, checkpointing, progress bar, model summary or "
        "sanity check; accumulate_grad_batches=k, gradient_clip_val=1.0, max_steps=-1); "
        "training_step returns the loss; the scheduler is stepped by Lightning with "
        "interval='step'. One fit() in a worker thread, paused by a callback at chunk ends "
        "(one extra Python call per micro-batch); the worker measures each chunk itself."
    )

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._go = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._target = 0
        self._stopping = False
        self._chunk_ns = 0
        self._error: BaseException | None = None
        self._ended = False
        self._thread: threading.Thread | None = None

    def build(self) -> None:
        # importlib, not `import lightning`: the bench extra is optional (mypy without it).
        pl: Any = importlib.import_module("lightning.pytorch")
        setup, contender = self.setup, self

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = setup.make_model()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                loss: torch.Tensor = setup.loss_fn(self.net, batch)
                return loss  # Lightning divides by accumulate_grad_batches itself

            def configure_optimizers(self) -> Any:
                optimizer = setup.make_optimizer(self.net.parameters())
                scheduler = setup.make_scheduler(optimizer)
                return {
                    "optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
                }

        class Pause(pl.Callback):
            def on_train_start(self, trainer: Any, module: Any) -> None:
                contender._pause()  # built and set up; wait for the first chunk
                if contender._stopping:
                    trainer.should_stop = True

            def on_train_batch_end(
                self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                # global_step only moves on an update, so this fires at a window's end.
                if trainer.global_step >= contender._target:
                    contender._pause()
                    if contender._stopping:
                        trainer.should_stop = True

        self.lightning_module = Module()
        self.trainer = pl.Trainer(
            accelerator="gpu" if setup.device.type == "cuda" else "cpu",
            devices=1,
            precision="32-true",
            barebones=True,
            accumulate_grad_batches=setup.accumulation,
            gradient_clip_val=setup.max_norm,
            gradient_clip_algorithm="norm",
            max_epochs=-1,
            max_steps=-1,
            callbacks=[Pause()],
        )
        pool = _Pool(list(setup.batches))
        self._thread = threading.Thread(
            target=self._fit, args=(pool,), name="lightning-trainer-fit", daemon=True
        )
        self._thread.start()
        self._wait_paused()  # fit's set-up is not part of any chunk

    def _fit(self, pool: _Pool) -> None:
        self._chunk_start = time.perf_counter_ns()
        try:
            self.trainer.fit(self.lightning_module, train_dataloaders=pool)
        except BaseException as error:  # handed to the harness thread, re-raised there
            self._error = error
        finally:
            self._ended = True
            self._paused.release()

    def _pause(self) -> None:
        if self.timing_sync:
            self.setup.sync()  # on CUDA the chunk's work must be done before the clock stops
        self._chunk_ns = time.perf_counter_ns() - self._chunk_start
        self._paused.release()
        if not self._go.acquire(timeout=_HANDOFF_TIMEOUT_S):
            self._stopping = True  # the harness is gone: end fit rather than hang
        self._chunk_start = time.perf_counter_ns()

    def _wait_paused(self) -> None:
        if not self._paused.acquire(timeout=_HANDOFF_TIMEOUT_S):
            raise TimeoutError("the Lightning Trainer thread did not reach its pause point")
        if self._error is not None:
            raise RuntimeError("Lightning Trainer.fit failed in its thread") from self._error
        if self._ended and not self._stopping:
            raise RuntimeError("Lightning Trainer.fit ended before the harness stopped it")

    def advance(self, steps: int) -> int:
        if self._stopping or self._ended:
            raise RuntimeError("the Lightning Trainer's fit has ended")
        self._target += steps
        self._go.release()
        self._wait_paused()
        return self._chunk_ns

    def module(self) -> nn.Module:
        net: nn.Module = self.lightning_module.net
        return net

    def close(self) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._stopping = True
        self._go.release()
        thread.join(timeout=_HANDOFF_TIMEOUT_S)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        with quiet(["lightning.pytorch", "lightning.fabric", "lightning_fabric"]):
            yield

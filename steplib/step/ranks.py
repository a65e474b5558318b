"""What ``ddp_wrap`` and ``fsdp_wrap`` share: the window's sums over the ranks
(:class:`RankSync`) and the build-time check that every rank composed the same step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from steplib.distributed.collectives import first_other, sum_window
from steplib.errors import ConfigError
from steplib.state import TrainState
from steplib.step.core import Step, add_part
from steplib.step.parts import GradSync, Part


class RankSync(GradSync):
    """Shared by DDP and FSDP2: the window's loss sum and target count summed over the ranks
    (one small all-reduce on the device), gradients averaged over the ranks by the wrapper."""

    def reduce_window(
        self, state: TrainState, loss_sum: torch.Tensor, targets: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        total, count = sum_window(loss_sum, targets)
        return total, count, dist.get_world_size()

    def describe(self) -> dict[str, Any]:
        return {"world_size": dist.get_world_size()}


def check_distributed_step(step: Step, part: Part) -> Step:
    """``step`` with ``part`` added, once every rank is known to have built the same
    composition (one collective at build time; a mismatch would otherwise hang or silently
    diverge). Shared by ``ddp_wrap`` and ``fsdp_wrap``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"{part.name} needs an initialised default process group, and none is. Launch with "
            "torchrun and call steplib.distributed.init_distributed() (or "
            "torch.distributed.init_process_group(...)) before building the step."
        )
    wrapped = add_part(step, part)
    mine = wrapped.describe()
    if found := first_other(mine):
        rank, theirs = found
        raise ConfigError(
            f"{part.name}: rank {dist.get_rank()} built the step {mine} but rank {rank} "
            f"built {theirs}. Every rank must compose the same wrappers with the same "
            "settings (build the step from the same code and configuration on every rank)."
        )
    return wrapped

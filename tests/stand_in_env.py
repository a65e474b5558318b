"""A stand-in for gym's CartPole, for the ports of pytorch/examples' reinforcement learning
loops (tests/test_reinforce_example.py, tests/test_actor_critic_example.py): seeded, no gym."""

from __future__ import annotations

import torch


class Env:
    """4 observations, 2 actions, reward 1 a step, seeded."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> torch.Tensor:
        self.t, self.obs = 0, torch.randn(4, generator=self.generator)
        return self.obs

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        self.t += 1
        noise = 0.05 * torch.randn(4, generator=self.generator)
        self.obs = self.obs * 0.9 + (0.1 if action else -0.1) + noise
        done = (self.obs.abs().max() > 1.5 and self.t >= 3) or self.t >= 30
        return self.obs, 1.0, bool(done)

"""The PyTorch tutorial's DQN (intermediate_source/reinforcement_q_learning.py) written with
steplib equals the tutorial's loop bit for bit, also stopped and resumed in new objects.

The tutorial: an epsilon-greedy action from a step counter (``steps_done``), a transition
pushed into a replay memory, an update on a batch drawn from it at random once it holds
``BATCH_SIZE`` transitions (SmoothL1Loss against a target network's values,
``clip_grad_value_(..., 100)``, AdamW with amsgrad), then a soft update of the target network
(``tau``) after every environment step, whether it updated or not.

With steplib (docs/migration/README.md, "A replay memory and a target network (DQN)"): the
agent is the data (it plays, pushes and samples, and yields a batch when there is one), the
soft update after an update is a ``step_end`` handler, ``clip(step, max_value=100)`` is
``clip_grad_value_``. For resume, the agent's ``state_dict`` holds the memory, the counter,
the environment and the observation; the soft-update handler's holds the target network.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from steplib import Events, TrainState, make_train_step, run
from steplib.checkpoint import checkpoint_every, resume_from
from steplib.events import Event
from steplib.step import clip
from tests.checkpoint_helpers import assert_same

BATCH_SIZE, GAMMA, EPS_START, EPS_END, EPS_DECAY, TAU, LR = 8, 0.99, 0.9, 0.05, 50, 0.005, 1e-3
EPISODES, CAPACITY = 6, 64
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Env:
    """A stand-in for gym's CartPole: 4 observations, 2 actions, reward 1 a step, seeded."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.t, self.obs = 0, torch.zeros(4)

    def reset(self) -> torch.Tensor:
        self.t, self.obs = 0, torch.randn(4, generator=self.generator)
        return self.obs

    def sample_action(self) -> int:
        return int(torch.randint(2, (1,), generator=self.generator))

    def step(self, action: int) -> tuple[torch.Tensor, float, bool, bool]:
        self.t += 1
        noise = 0.05 * torch.randn(4, generator=self.generator)
        self.obs = self.obs * 0.9 + (0.1 if action else -0.1) + noise
        terminated = bool(self.obs.abs().max() > 1.5) and self.t >= 3
        return self.obs, 1.0, terminated, self.t >= 20

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "t": self.t, "obs": self.obs}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.generator.set_state(sd["generator"])
        self.t, self.obs = sd["t"], sd["obs"]


def dqn() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def nets() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    policy, target = dqn(), dqn()
    target.load_state_dict(policy.state_dict())
    return policy, target, torch.optim.AdamW(policy.parameters(), lr=LR, amsgrad=True)


def select_action(policy: nn.Module, env: Env, obs: torch.Tensor, steps_done: int) -> int:
    eps = EPS_END + (EPS_START - EPS_END) * math.exp(-1.0 * steps_done / EPS_DECAY)
    if random.random() > eps:
        with torch.no_grad():
            return int(policy(obs.unsqueeze(0)).max(1).indices)
    return env.sample_action()


def as_batch(transitions: list[tuple[Any, ...]]) -> Batch:
    states, actions, next_states, rewards = zip(*transitions, strict=True)
    mask = torch.tensor([s is not None for s in next_states], dtype=torch.bool)
    nexts = [s for s in next_states if s is not None]
    non_final = torch.stack(nexts) if nexts else torch.zeros(0, 4)
    actions_ = torch.tensor(actions).unsqueeze(1)
    return torch.stack(states), actions_, mask, non_final, torch.tensor(rewards)


def dqn_loss(policy: nn.Module, target: nn.Module, batch: Batch) -> torch.Tensor:
    states, actions, mask, non_final, rewards = batch
    state_action_values = policy(states).gather(1, actions)
    next_state_values = torch.zeros(BATCH_SIZE)
    with torch.no_grad():
        next_state_values[mask] = target(non_final).max(1).values
    expected = next_state_values * GAMMA + rewards
    return nn.SmoothL1Loss()(state_action_values, expected.unsqueeze(1))


def soft_update(target: nn.Module, policy: nn.Module) -> None:
    target_sd, policy_sd = target.state_dict(), policy.state_dict()
    for key in policy_sd:
        target_sd[key] = policy_sd[key] * TAU + target_sd[key] * (1 - TAU)
    target.load_state_dict(target_sd)


def reference() -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """The tutorial's loop, as written there."""
    random.seed(0)
    policy, target, optimizer = nets()
    env, memory, steps_done, losses = Env(1), deque[Any](maxlen=CAPACITY), 0, []
    for _ in range(EPISODES):
        obs = env.reset().clone()
        while True:
            action = select_action(policy, env, obs, steps_done)
            steps_done += 1
            nxt, reward, terminated, truncated = env.step(action)
            memory.append((obs, action, None if terminated else nxt.clone(), reward))
            obs = nxt.clone()
            if len(memory) >= BATCH_SIZE:
                loss = dqn_loss(policy, target, as_batch(random.sample(memory, BATCH_SIZE)))
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_value_(policy.parameters(), 100)
                optimizer.step()
                losses.append(loss.detach())
            soft_update(target, policy)
            if terminated or truncated:
                break
    return policy, target, losses


class Agent:
    """The data: plays with the policy, pushes, samples; its state_dict is all it holds."""

    def __init__(self, policy: nn.Module, target: nn.Module) -> None:
        self.policy, self.target, self.env = policy, target, Env(1)
        self.memory, self.steps_done, self.episode = deque[Any](maxlen=CAPACITY), 0, 0
        self.obs: torch.Tensor | None = None  # None: the next step starts an episode

    def __iter__(self) -> Iterator[Batch]:
        while self.episode < EPISODES:
            if self.obs is None:
                self.obs = self.env.reset().clone()
            action = select_action(self.policy, self.env, self.obs, self.steps_done)
            self.steps_done += 1
            nxt, reward, terminated, truncated = self.env.step(action)
            self.memory.append((self.obs, action, None if terminated else nxt.clone(), reward))
            self.obs = None if terminated or truncated else nxt.clone()
            self.episode += self.obs is None
            if len(self.memory) >= BATCH_SIZE:  # the update's soft update: SoftUpdate
                yield as_batch(random.sample(self.memory, BATCH_SIZE))
            else:
                soft_update(self.target, self.policy)

    def state_dict(self) -> dict[str, Any]:
        return {
            "memory": list(self.memory),
            "steps_done": self.steps_done,
            "episode": self.episode,
            "obs": self.obs,
            "env": self.env.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.memory = deque(sd["memory"], maxlen=CAPACITY)
        self.steps_done, self.episode, self.obs = sd["steps_done"], sd["episode"], sd["obs"]
        self.env.load_state_dict(sd["env"])


class SoftUpdate:
    def __init__(self, target: nn.Module, policy: nn.Module) -> None:
        self.target, self.policy = target, policy

    def on_step_end(self, event: Event) -> None:
        soft_update(self.target, self.policy)

    # A handler's state_dict is saved and restored with the run: the target network with it.
    def state_dict(self) -> dict[str, Any]:
        return self.target.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.target.load_state_dict(sd)


class Losses:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_step_end(self, event: Event) -> None:
        self.seen.append(event.output.loss.detach().clone())


def with_steplib(
    directory: Path | None = None, max_steps: int | None = None, *, soft: type = SoftUpdate
) -> tuple[nn.Module, nn.Module, list[torch.Tensor], int]:
    random.seed(0)
    policy, target, optimizer = nets()
    state = TrainState.create(model=policy, optimizer=optimizer)
    step = clip(make_train_step(lambda m, b: dqn_loss(m, target, b)), max_value=100)
    losses, handlers = Losses(), list[Any]()
    if directory is not None:
        ckpt = checkpoint_every(str(directory), every=1, keep_last=1)
        handlers = [resume_from(ckpt), ckpt]
    events = Events(soft(target, policy), losses, *handlers)
    state = run(step, state, Agent(policy, target), events=events, max_steps=max_steps)
    return policy, target, losses.seen, state.step


def test_dqn_with_steplib_equals_the_tutorial_loop() -> None:
    policy, target, losses = reference()
    ours, our_target, our_losses, updates = with_steplib()
    assert updates == len(losses) > 20
    assert_same(ours.state_dict(), policy.state_dict())
    assert_same(our_target.state_dict(), target.state_dict())
    assert torch.equal(torch.stack(our_losses), torch.stack(losses))


def test_dqn_stopped_and_resumed_in_new_objects_equals_the_tutorial_loop(tmp_path: Path) -> None:
    policy, target, losses = reference()
    _, _, first, at = with_steplib(tmp_path, max_steps=len(losses) // 2)
    ours, our_target, rest, updates = with_steplib(tmp_path)
    assert at == len(losses) // 2 and updates == len(losses)
    assert_same(ours.state_dict(), policy.state_dict())
    assert_same(our_target.state_dict(), target.state_dict())
    assert torch.equal(torch.stack(first + rest), torch.stack(losses))

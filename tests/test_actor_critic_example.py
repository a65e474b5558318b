"""pytorch/examples' actor-critic (reinforcement_learning/actor_critic.py) written with steplib
equals the original loop bit for bit.

One model with two heads (the policy's action probabilities and the critic's state value)
plays an episode; after it, the discounted returns are normalised and the loss is the sum of
the actor's ``-log_prob * advantage`` (the advantage read with ``value.item()``, so no gradient
flows through it into the critic) and the critic's smooth L1 to the returns; Adam updates once
per episode; the running reward (updated from the episode's reward before the update, as in the
example) stops the run once it passes a threshold.

With steplib it is the REINFORCE recipe (docs/migration/README.md, "Data the model makes"):
the episodes come from a generator over the model, the loss is returned with the episode's
reward as aux, and a handler keeps the running reward and returns ``Stop``. Both heads are one
model, so one optimizer and one step train them with the summed loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from steplib import Events, TrainState, make_train_step, run
from steplib.events import Event, Stop
from tests.checkpoint_helpers import assert_same
from tests.stand_in_env import Env

GAMMA, LR, EPISODES, THRESHOLD = 0.99, 3e-2, 40, 14.0
EPS = torch.finfo(torch.float32).eps
Saved = list[tuple[torch.Tensor, torch.Tensor]]  # (log_prob, value) per move
Episode = tuple[Saved, list[float]]


class Policy(nn.Module):
    """The example's actor and critic in one model: a shared layer and two heads."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 16)
        self.action_head, self.value_head = nn.Linear(16, 2), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.affine1(x))
        return F.softmax(self.action_head(x), dim=-1), self.value_head(x)


def play(model: Policy, env: Env) -> Episode:
    obs, saved, rewards = env.reset(), Saved(), list[float]()
    while True:
        probs, value = model(obs)
        dist = Categorical(probs)
        action = dist.sample()
        saved.append((dist.log_prob(action), value))
        obs, reward, done = env.step(int(action.item()))
        rewards.append(reward)
        if done:
            return saved, rewards


def episode_loss(saved: Saved, rewards: list[float]) -> torch.Tensor:
    discounted, returns = 0.0, list[float]()
    for reward in reversed(rewards):
        discounted = reward + GAMMA * discounted
        returns.insert(0, discounted)
    normalised = torch.tensor(returns)
    normalised = (normalised - normalised.mean()) / (normalised.std() + EPS)
    policy_losses, value_losses = [], []
    for (log_prob, value), ret in zip(saved, normalised, strict=True):
        advantage = ret - value.item()  # the example's: no gradient into the critic from here
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([ret])))
    return torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()


def build() -> tuple[Policy, torch.optim.Optimizer, Env]:
    torch.manual_seed(543)
    model = Policy()
    return model, torch.optim.Adam(model.parameters(), lr=LR), Env(543)


def reference() -> tuple[Policy, int, list[float]]:
    model, optimizer, env = build()
    running, history = 10.0, []
    for episode in range(1, EPISODES + 1):  # noqa: B007 (returned: how many ran)
        saved, rewards = play(model, env)
        running = 0.05 * sum(rewards) + 0.95 * running
        optimizer.zero_grad()
        episode_loss(saved, rewards).backward()
        optimizer.step()
        history.append(running)
        if running > THRESHOLD:
            break
    return model, episode, history


class Solved:
    """The example's running reward and its ``Solved!`` break, as a handler."""

    def __init__(self) -> None:
        self.running, self.history = 10.0, list[float]()

    def on_step_end(self, event: Event) -> Stop | None:
        self.running = 0.05 * float(event.output.aux["reward"]) + 0.95 * self.running
        self.history.append(self.running)
        return Stop(f"solved at {self.running:.2f}") if self.running > THRESHOLD else None


def with_steplib() -> tuple[Policy, int, list[float]]:
    model, optimizer, env = build()

    def episodes() -> Iterator[Episode]:
        for _ in range(EPISODES):
            yield play(model, env)  # by the model as the last update left it

    def loss_fn(_: nn.Module, episode: Episode) -> tuple[torch.Tensor, dict[str, Any]]:
        saved, rewards = episode  # played (both heads ran) while the episode was drawn
        return episode_loss(saved, rewards), {"reward": torch.tensor(sum(rewards))}

    solved = Solved()
    state = TrainState.create(model=model, optimizer=optimizer)
    state = run(make_train_step(loss_fn), state, episodes(), events=Events(solved))
    return model, state.step, solved.history


def test_actor_critic_equals_the_example_bit_for_bit() -> None:
    expected, expected_episodes, expected_running = reference()
    got, episodes, running = with_steplib()
    assert 1 < expected_episodes < EPISODES  # the threshold stops it: the Stop is exercised
    assert episodes == expected_episodes
    assert running == expected_running
    assert_same(got.state_dict(), expected.state_dict())  # bit for bit, both heads

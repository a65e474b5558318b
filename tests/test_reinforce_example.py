"""pytorch/examples' REINFORCE (reinforcement_learning/reinforce.py) written with steplib equals
the original loop bit for bit.

Its data is made by the model being trained: each "batch" is an episode that the current
policy played (sampling its actions, dropout on), holding the log-probabilities with their
graph; the loss is the episode's discounted, normalised returns times those, summed; Adam
updates once per episode; the run stops once a running mean of the episodes' rewards passes a
threshold (the example's ``Solved!`` break).

With steplib (docs/migration/README.md, "Data the model makes: on-policy reinforcement
learning"): the episodes come from a generator over the policy, the loss function ignores its
``model`` argument (the forward ran while playing), the reward is returned as aux, and a
handler keeps the running reward and returns ``Stop``. What makes it exact is that the loop
draws the next batch only after the update on the previous one: an episode played a batch
ahead would be played by the policy before that update (and its graph, built on weights an
update changes in place, could not even be back-propagated).
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

GAMMA, LR, EPISODES, THRESHOLD = 0.99, 1e-2, 40, 13.0
Episode = tuple[list[torch.Tensor], list[float]]


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1, self.affine2 = nn.Linear(4, 16), nn.Linear(16, 2)
        self.dropout = nn.Dropout(0.6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


def play(policy: Policy, env: Env) -> Episode:
    obs, log_probs, rewards = env.reset(), [], []
    while True:
        dist = Categorical(policy(obs.unsqueeze(0)))
        action = dist.sample()
        log_probs.append(dist.log_prob(action))
        obs, reward, done = env.step(int(action.item()))
        rewards.append(reward)
        if done:
            return log_probs, rewards


def episode_loss(log_probs: list[torch.Tensor], rewards: list[float]) -> torch.Tensor:
    discounted, returns = 0.0, list[float]()
    for reward in reversed(rewards):
        discounted = reward + GAMMA * discounted
        returns.insert(0, discounted)
    normalised = torch.tensor(returns)
    normalised = (normalised - normalised.mean()) / (normalised.std() + 1e-7)
    return torch.cat([-lp * r for lp, r in zip(log_probs, normalised, strict=True)]).sum()


def build() -> tuple[Policy, torch.optim.Optimizer, Env]:
    torch.manual_seed(543)
    policy = Policy()
    return policy, torch.optim.Adam(policy.parameters(), lr=LR), Env(543)


def reference() -> tuple[Policy, int]:
    policy, optimizer, env = build()
    running = 10.0
    for episode in range(1, EPISODES + 1):  # noqa: B007 (returned: how many ran)
        log_probs, rewards = play(policy, env)
        optimizer.zero_grad()
        episode_loss(log_probs, rewards).backward()
        optimizer.step()
        running = 0.05 * sum(rewards) + 0.95 * running
        if running > THRESHOLD:
            break
    return policy, episode


class Solved:
    """The example's running reward and its ``Solved!`` break, as a handler."""

    def __init__(self) -> None:
        self.running = 10.0

    def on_step_end(self, event: Event) -> Stop | None:
        self.running = 0.05 * float(event.output.aux["reward"]) + 0.95 * self.running
        return Stop(f"solved at {self.running:.2f}") if self.running > THRESHOLD else None


def with_steplib() -> tuple[Policy, int]:
    policy, optimizer, env = build()

    def episodes() -> Iterator[Episode]:
        for _ in range(EPISODES):
            yield play(policy, env)  # by the policy as the last update left it

    def loss_fn(model: nn.Module, episode: Episode) -> tuple[torch.Tensor, dict[str, Any]]:
        log_probs, rewards = episode  # played (the forward ran) while the episode was drawn
        return episode_loss(log_probs, rewards), {"reward": torch.tensor(sum(rewards))}

    state = TrainState.create(model=policy, optimizer=optimizer)
    state = run(make_train_step(loss_fn), state, episodes(), events=Events(Solved()))
    return policy, state.step


def test_reinforce_equals_the_example_bit_for_bit() -> None:
    expected, expected_episodes = reference()
    got, episodes = with_steplib()
    assert 1 < expected_episodes < EPISODES  # the threshold stops it: the Stop is exercised
    assert episodes == expected_episodes
    assert_same(got.state_dict(), expected.state_dict())  # bit for bit

"""Reinforcement learning: one agent, several observers, actions chosen in batches.

Each observer runs its own cart-pole (the classic control problem, simulated here in a
few lines) and asks the agent for every action (``agent.rpc_sync().select_action``).
``select_action`` is an ``async_execution`` method: it returns a Future at once and no
server thread waits; when every observer's state has arrived the agent runs its policy
once on the whole batch and completes all the Futures. After each round of rollouts
the agent improves its policy (REINFORCE) from the rewards the observers reported.
The run is deterministic: it checks that the episodes got longer and prints OK.

    python examples/rpc/reinforcement_learning.py              # agent + 3 observers
    python examples/rpc/reinforcement_learning.py --quick
    python -m tandem.run --standalone --nproc-per-node 4 examples/rpc/reinforcement_learning.py
"""

from __future__ import annotations

import argparse
import math
import random
import threading

import torch
from torch import nn

import tandem.rpc as rpc

from _common import launch


class CartPole:
    """Balance a pole on a cart: reward 1 per step until it falls (standard physics)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.reset()

    def reset(self) -> list[float]:
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        return self.state

    def step(self, action: int) -> tuple[list[float], bool]:
        x, v, theta, omega = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * omega * omega * sin) / 1.1
        alpha = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos * cos / 1.1))
        accel = temp - 0.05 * alpha * cos / 1.1
        dt = 0.02
        self.state = [x + dt * v, v + dt * accel, theta + dt * omega, omega + dt * alpha]
        fallen = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 12 * math.pi / 180
        return self.state, fallen


class Agent:
    """Lives on the agent worker; observers call it through an RRef."""

    def __init__(self, observers: int) -> None:
        torch.manual_seed(0)
        self.policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=0.02)
        self.generator = torch.Generator().manual_seed(0)
        self.observers = observers
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[list[float], torch.futures.Future[int]]] = {}
        self.log_probs: dict[int, list[torch.Tensor]] = {i: [] for i in range(observers)}
        self.rewards: dict[int, list[float]] = {i: [] for i in range(observers)}

    @rpc.functions.async_execution
    def select_action(self, observer: int, state: list[float]) -> torch.futures.Future[int]:
        fut: torch.futures.Future[int] = torch.futures.Future()
        with self.lock:
            self.waiting[observer] = (state, fut)
            if len(self.waiting) < self.observers:
                return fut  # the last observer's call answers everyone
            batch = sorted(self.waiting.items())  # observer order: the run is reproducible
            self.waiting = {}
            probs = torch.softmax(self.policy(torch.tensor([s for _, (s, _) in batch])), dim=1)
            actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            for (obs, _), p, a in zip(batch, probs, actions):
                self.log_probs[obs].append(p[a].log())
        for (_, (_, f)), a in zip(batch, actions.tolist()):
            f.set_result(a)
        return fut

    def report(self, observer: int, reward: float) -> None:
        self.rewards[observer].append(reward)

    def learn(self, gamma: float = 0.99) -> None:
        """REINFORCE on every observer's rollout (a reward of 0 marks an episode's end)."""
        loss = torch.zeros(())
        for obs in range(self.observers):
            ret, returns = 0.0, []
            for r in reversed(self.rewards[obs]):
                ret = 0.0 if r == 0.0 else r + gamma * ret
                returns.insert(0, ret)
            g = torch.tensor(returns)
            g = (g - g.mean()) / (g.std() + 1e-6)
            loss = loss - (torch.stack(self.log_probs[obs]) * g).sum()
            self.log_probs[obs], self.rewards[obs] = [], []
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()


def rollout(agent: rpc.RRef[Agent], observer: int, env: CartPole, steps: int) -> list[int]:
    """On an observer: ``steps`` steps (an episode may go on into the next rollout);
    returns the lengths of the episodes that ended."""
    lengths, length, state = [], 0, env.state
    for _ in range(steps):
        action = agent.rpc_sync().select_action(observer, state)
        state, fallen = env.step(action)
        length += 1
        agent.rpc_sync().report(observer, 0.0 if fallen else 1.0)
        if fallen:
            lengths.append(length)
            length, state = 0, env.reset()
    return lengths


ENV: dict[str, CartPole] = {}


def observe(agent: rpc.RRef[Agent], observer: int, steps: int) -> list[int]:
    env = ENV.setdefault("env", CartPole(seed=observer))
    return rollout(agent, observer, env, steps)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    rpc.init_rpc("agent" if rank == 0 else f"observer{rank - 1}", rank=rank, world_size=world)
    if rank == 0:
        observers = world - 1
        agent = rpc.RRef(Agent(observers))
        history = []
        for it in range(args.iterations):
            futures = [rpc.rpc_async(f"observer{i}", observe, args=(agent, i, args.steps))
                       for i in range(observers)]
            ended = sum(len(f.wait()) for f in futures)
            agent.local_value().learn()
            # steps per episode (one still running counts as begun): the pole stays up longer
            history.append(observers * args.steps / (ended + observers))
            print(f"iteration {it:3d}  steps per episode {history[-1]:6.1f}", flush=True)
        first, last = history[:3], history[-3:]
        if sum(last) < 2 * sum(first):
            raise SystemExit(f"the policy did not improve: {first} -> {last}")
        print("OK", flush=True)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--observers", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200, help="steps per rollout")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rollouts")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.steps = 12, 100
    launch(worker, args.observers + 1, args)


if __name__ == "__main__":
    main()

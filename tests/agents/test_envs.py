"""Environments for the tests of `env_turns`: deterministic, with a reward every turn, and ones that fail."""

from __future__ import annotations

from gcore_rl.agents.environments import EnvStep


class Echo:
    """Asks for a number `turns` times; each turn's reward is 1 when the reply is the number asked for, else 0."""

    def __init__(self, turns: int = 2):
        self.turns, self.asked, self.seen = turns, 0, 0

    def _ask(self) -> str:
        return f"say {self.asked}"

    def reset(self, spec):
        self.asked, self.seen = int(spec.get("seed", 0)) % 10, 0
        return [{"role": "user", "content": self._ask()}]

    def step(self, reply):
        reward = float(reply.strip() == str(self.asked))
        self.seen += 1
        self.asked = (self.asked + 1) % 10
        if self.seen >= self.turns:
            return EnvStep(reward=reward, done=True)
        return EnvStep(messages=[{"role": "user", "content": self._ask()}], reward=reward)

    def close(self):
        pass


class FailsAtStep(Echo):
    def step(self, reply):
        raise RuntimeError("the game server went away")


class FailsAtReset(Echo):
    def reset(self, spec):
        raise ValueError("no such level")

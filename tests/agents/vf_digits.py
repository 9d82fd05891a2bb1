"""A verifiers (v1) environment defined on an in-memory taskset, for the tests of the verifiers adapter: the
environment asks a question, then asks "again?" (a user turn of its own), and rewards the share of digits in the
policy's last reply (what a tiny random model can learn). Its taskset is found by module name (this module)."""

from __future__ import annotations

import verifiers.v1 as vf

from gcore_rl.agents.verifiers_env import in_process_agent

__all__ = ["DigitsTaskset"]

QUESTIONS = ["2+3=", "7*6=", "9-4=", "1+1="]


class DigitsTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def digit_share(self, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant"]
        last = (replies[-1].content or "") if len(replies) >= 2 else ""
        return sum(c.isdigit() for c in last) / max(len(last), 1)


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        return [DigitsTask(vf.TaskData(prompt=q), self.config.task) for q in QUESTIONS]


class AskTwiceConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class AskTwice(vf.Env[AskTwiceConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn("again?")


def make_env() -> AskTwice:
    return AskTwice(AskTwiceConfig(taskset=vf.TasksetConfig(id="vf_digits"), agent=in_process_agent(max_turns=4)))

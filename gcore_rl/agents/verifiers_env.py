"""verifiers (v1) environments trained through the chat endpoint: the agent for `agent_loop`
(`rollout.options={agent: gcore_rl.agents.verifiers_env:run_episode, agent_options: {env: package.module:make_env}}`).

`make_env()` returns a `verifiers.v1.Env` whose agent runs in this process: `agent=in_process_agent()` (the harness
of `gcore_rl.agents.verifiers_harness`, the runtime `vf.SubprocessConfig()`; verifiers' default is a remote
sandbox).
Each sample plays the task `episode["task"]` (an index into the environment's taskset; the row's `env` column)
as one verifiers episode against the sample's session, on an event loop of its own in the agent's thread, and
its reward is the episode's (the sum over its traces). Each agent thread keeps its own environment.

verifiers 0.4 (`pip install 'gcore-rl[agents]'`, Python >= 3.11) takes about 5 s to import; its subprocess
runtime's scratch folders go to a temporary folder rather than the home folder.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from gcore_rl.agents.environments import AGENTS_EXTRA
from gcore_rl.configlib import load_callable
from gcore_rl.errors import ConfigError

_LOCAL = threading.local()


def import_verifiers() -> Any:
    """`verifiers.v1`, or ConfigError naming the extra that installs it."""
    try:
        vf = importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise ConfigError("rollout.options.agent_options.env", f"needs the verifiers package ({exc}); install the "
                          f"agents extra: {AGENTS_EXTRA}") from None
    runtime = importlib.import_module("verifiers.v1.runtimes.subprocess")
    if not str(runtime.CACHE_DIR).startswith(tempfile.gettempdir()):
        runtime.CACHE_DIR = Path(tempfile.mkdtemp(prefix="gcore-verifiers-"))
    return vf


HARNESS_ID = "gcore_rl_verifiers_harness"
"""The module name verifiers finds the in-process harness by (verifiers imports a harness by a plain module name)."""


def in_process_agent(max_turns: int = 8, **fields: Any) -> Any:
    """A `vf.AgentConfig` whose chat loop runs in this process (`verifiers_harness.InProcessChat`) on the subprocess
    runtime, ending after `max_turns` model calls; `fields` are further `AgentConfig` fields."""
    vf = import_verifiers()
    sys.modules.setdefault(HARNESS_ID, importlib.import_module("gcore_rl.agents.verifiers_harness"))
    return vf.AgentConfig(harness=vf.HarnessConfig(id=HARNESS_ID), runtime=vf.SubprocessConfig(), max_turns=max_turns,
                          **fields)


def _environment(env: str) -> tuple[Any, list]:
    """This thread's environment made by the factory `env`, and its tasks."""
    cache = getattr(_LOCAL, "envs", None)
    if cache is None:
        cache = _LOCAL.envs = {}
    if env not in cache:
        environment = load_callable(env, "rollout.options.agent_options.env")()
        cache[env] = (environment, list(environment.taskset))
    return cache[env]


def run_episode(base_url: str, model: str, episode: dict[str, Any], env: str, max_tokens: int | None = None) -> float:
    """One verifiers episode of task `episode["task"]` of the environment `env` makes, against `base_url`; its
    reward."""
    vf = import_verifiers()
    environment, tasks = _environment(env)
    task = tasks[int(episode.get("task", 0)) % len(tasks)]
    ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var="GCORE_RL_NO_KEY"),
                          sampling=vf.SamplingConfig(max_tokens=max_tokens))

    async def play() -> Any:
        async with environment.serving():
            return await environment.run_episode(task, ctx)

    result = asyncio.run(play())
    return float(sum(trace.reward or 0.0 for trace in result.traces))

"""`agent_loop`: a rollout function that trains agent code written against an OpenAI client
(`rollout.function=gcore_rl.agents.agent_loop:agent_loop`, `rollout.options.agent=package.module:run`).

Each sample runs the agent, `run(base_url, model, episode, **agent_options) -> reward or None`, in a thread of its
own: `base_url` is the sample's session of the rollout device's `ChatEndpoint`
(`http://127.0.0.1:PORT/s/<session>/v1`, for `openai.OpenAI(base_url=..., api_key="-")`), `model` the name it
serves (`rollout.options.model`; `openai_client(base_url)` builds a client that shares the process's connection
pool), and `episode` the row's `env` column (what the agent needs: a question, an answer, a game's seed; an empty mapping without
one). The agent calls `chat.completions.create` as often as it likes, runs its tools or environment between
calls, and returns its reward (credited at the last token of the sample; None: the job's other rewards alone,
which read the final turn). All the device's agents run at once; their requests are batched into engine calls
as they arrive (`ChatEndpoint.serve_pending`), so an agent busy with a tool leaves the batch to the others.

A sample is its session's last segment (`chat_endpoint`: a history that diverged begins a new one). An agent
that raises, or makes no request, gives what it recorded (nothing: an empty sample, with no tokens to train on)
and is counted (`rollout/agent_errors`); the run goes on. Each completion carries `rollout_stats`: `turns`
(requests of its segment), `requests`, `segments`, `agent_errors`, `agent_seconds`. Sampling draws are not
reproducible run to run: which requests share an engine call depends on the agents' timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gcore_rl.agents.chat_endpoint import ChatEndpoint, Session
from gcore_rl.agents.parsers import TOOL_CALL_PARSERS
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.agents.turns import Trajectory, turn_seed
from gcore_rl.configlib import check_import_path, from_dict, load_callable
from gcore_rl.errors import ConfigError
from gcore_rl.records import Completion, EpisodePrompt
from gcore_rl.rollout.functions import RolloutRequest

log = logging.getLogger(__name__)


@dataclass
class AgentLoopOptions:
    """`rollout.options` of `agent_loop`."""

    agent: str = field(default="", metadata={"help": "Import path `package.module:run` of the agent: run(base_url, model, episode) -> reward (float) or None, calling the OpenAI-compatible endpoint at base_url."})
    agent_options: dict[str, Any] = field(default_factory=dict, metadata={"help": "Keyword arguments handed to the agent after (base_url, model, episode), e.g. {env: package.module:make_env} for gcore_rl.agents.verifiers_env:run_episode."})
    model: str = field(default="policy", metadata={"help": "The model name the endpoint serves; requests naming another get a 404 (model_not_found)."})
    parser: str = field(default="hermes", metadata={"help": "How tool calls are read from a reply when a request offers `tools` (returned as OpenAI tool_calls): a registered parser (gcore_rl/agents/parsers.py)."})
    timeout_s: float = field(default=600.0, metadata={"help": "Seconds an agent may run; one still running then is counted as an error and its sample ends with what it recorded."})

    def validate(self) -> None:
        if not self.agent:
            raise ConfigError("agent", "names no agent; give the import path `package.module:run` of a function "
                              "run(base_url, model, episode) that calls the endpoint and returns a reward or None")
        check_import_path(self.agent, "agent")
        if self.parser not in TOOL_CALL_PARSERS:
            raise ConfigError("parser", f"'{self.parser}' is not a tool-call parser ({', '.join(sorted(TOOL_CALL_PARSERS))})")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s}")


COUNTS = ("requests", "segments", "agent_errors", "agent_seconds")
"""What `agent_loop` counts of each sample (`Completion.rollout_stats`, beside `turns`)."""

_ENDPOINTS: dict[tuple, ChatEndpoint] = {}
"""This process's endpoints, by tokenizer and options: a rollout device keeps its endpoint between steps."""


_HTTP: list = []


def openai_client(base_url: str, **kwargs: Any) -> Any:
    """An `openai.OpenAI` for `base_url` sharing one HTTP connection pool with every agent of the process: building
    a client's own costs ~40 ms of CPU (its TLS context), which 32 agents starting together pay before the first
    engine call. `kwargs` go to `openai.OpenAI` (`max_retries`, `timeout`, ...)."""
    import httpx
    import openai

    if not _HTTP:
        _HTTP.append(httpx.Client(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)))
    return openai.OpenAI(base_url=base_url, api_key="-", http_client=_HTTP[0], **kwargs)


def check_options(options: Mapping[str, Any], tokenizer: Any = None) -> None:
    """What the driver checks before any process starts: the options, that the agent imports, and that the policy's
    chat template can give a message back after an assistant turn (ConfigError naming the dotted key otherwise)."""
    opts = from_dict(AgentLoopOptions, dict(options), prefix="rollout.options")
    load_callable(opts.agent, "rollout.options.agent")
    if tokenizer is not None:
        TurnRenderer(tokenizer, role="user")


def _endpoint(request: RolloutRequest, opts: AgentLoopOptions) -> ChatEndpoint:
    key = (id(request.tokenizer), opts.model, opts.parser, request.params.max_new_tokens, request.context)
    if key not in _ENDPOINTS:
        _ENDPOINTS[key] = ChatEndpoint(request.tokenizer, opts.model, request.params.max_new_tokens,
                                       request.context or 10**9, TOOL_CALL_PARSERS[opts.parser])
    return _ENDPOINTS[key]


def agent_loop(request: RolloutRequest) -> Iterator[list[Completion]]:
    """The rollout function (see the module docstring)."""
    opts = from_dict(AgentLoopOptions, dict(request.options), prefix="rollout.options")
    run = load_callable(opts.agent, "rollout.options.agent")
    endpoint = _endpoint(request, opts)
    sessions: dict[Future, tuple[str, Session, float]] = {}
    calls = 0

    def generate(continuations):
        nonlocal calls
        calls += 1
        return request.engine.continue_stream(continuations, request.params, seed=turn_seed(request.seed, calls))

    samples = [(i, k) for i in range(len(request.prompts)) for k in range(request.params.n)]
    # not a `with` block: leaving one waits for every thread, and an agent past its time limit may never return
    pool = ThreadPoolExecutor(max_workers=max(len(samples), 1), thread_name_prefix="agent")
    for prompt_index, sample_index in samples:
        url, session = endpoint.open_session(prompt_index, sample_index)
        episode = _episode(request.prompts[prompt_index])
        sessions[pool.submit(run, url, opts.model, episode, **opts.agent_options)] = (url, session, time.monotonic())
    try:
        while sessions:
            endpoint.serve_pending(generate)
            finished = [f for f, (_, _, started) in sessions.items()
                        if f.done() or time.monotonic() - started > opts.timeout_s]
            for f in finished:
                endpoint.close_session(sessions[f][0])
            if finished:
                yield [_sample(request, f, *sessions.pop(f)) for f in finished]
    finally:
        for url, _, _ in sessions.values():
            endpoint.close_session(url)
        endpoint.fail_pending("the rollout ended")  # release agents still waiting on a request
        pool.shutdown(wait=False, cancel_futures=True)


def _episode(prompt: Any) -> dict[str, Any]:
    return dict(prompt.env) if isinstance(prompt, EpisodePrompt) else {}


def _sample(request: RolloutRequest, future: Future, url: str, session: Session, started: float) -> Completion:
    """The training sample of a finished (or timed-out) agent: its last segment with the agent's reward."""
    reward, failed = None, False
    if not future.done():
        failed = True
        log.warning("agent of sample %d/%d ran past its time limit; its sample ends with what it recorded",
                    session.prompt_index, session.sample_index)
    elif future.exception() is not None:
        failed = True
        exc = future.exception()
        log.warning("agent of sample %d/%d raised %s: %s", session.prompt_index, session.sample_index,
                    type(exc).__name__, exc)
    else:
        reward = future.result()
    trajectory = session.trajectory() or Trajectory(session.prompt_index, session.sample_index,
                                                    list(request.prompts[session.prompt_index]))
    failed = failed or not session.segments
    if reward is not None:
        trajectory.reward_turn(float(reward))
    trajectory.stats.update({"requests": float(session.requests), "segments": float(len(session.segments)),
                             "agent_errors": float(failed), "agent_seconds": time.monotonic() - started})
    return trajectory.completion()


def close() -> None:
    """Stop this process's endpoints (a device worker calls it when it closes)."""
    for endpoint in _ENDPOINTS.values():
        endpoint.close()
    _ENDPOINTS.clear()


agent_loop.check_options = check_options  # type: ignore[attr-defined]  (see `rollout.functions.check_rollout`)
agent_loop.close = close  # type: ignore[attr-defined]  (a device worker closes its rollout function's resources)

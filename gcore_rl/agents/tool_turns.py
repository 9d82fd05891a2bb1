"""`tool_turns`: a rollout function for tool-using policies (`rollout.function=gcore_rl.agents.tool_turns:tool_turns`).

Each sample is a trajectory of assistant turns. A turn that ends with the end-of-turn token and contains tool
calls (in the format of `rollout.options.parser`) has its calls run (`ToolSet`: in a pool, each with a time
limit), their results rendered as `tool` messages by the chat template (`ToolTurnRenderer`, by delta), and the
trajectory continues through `RolloutEngine.continue_stream`. It ends at a turn without calls, after
`max_turns` turns, or when `sampling.max_new_tokens` (which counts every token after the prompt, inserted ones
included) would be exceeded. The policy's ids are kept exactly as sampled, with the engine's log-probs and
loss mask 1; the inserted ids have loss mask 0 and log-prob 0. All trajectories of a request advance turn by
turn together, so each turn is one batched engine call.

Each completion carries `rollout_stats`: `turns`, `tool_calls`, `tool_errors` (unknown tools, unreadable
calls, tools that raised, overran or returned no string; given back to the model as an error message, or
ending the trajectory with `on_tool_error: end`) and `tool_seconds`.

Chat prompts are rendered with the tools' JSON schemas (`prompt_tools`: the template's `tools=`, which a
template renders where and as it likes, by name only if the context is short); plain-text prompts must
describe the tools themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gcore_rl.agents.parsers import TOOL_CALL_PARSERS, CallError, ToolCall, ToolCallParser
from gcore_rl.agents.template import ToolTurnRenderer
from gcore_rl.agents.tools import ToolSet, load_tools
from gcore_rl.configlib import check_import_path, from_dict, load_callable
from gcore_rl.errors import ConfigError
from gcore_rl.records import Completion
from gcore_rl.rollout.functions import RolloutRequest
from gcore_rl.rollout.protocol import Continuation


@dataclass
class ToolTurnsOptions:
    """`rollout.options` of `tool_turns`."""

    tools: list[str] = field(default_factory=list, metadata={"help": "Import paths of the tools (module-level functions with type hints and an `Args:` docstring)."})
    parser: str = field(default="hermes", metadata={"help": "How tool calls are read from a turn: a registered parser (gcore_rl/agents/parsers.py: hermes = <tool_call>{json}</tool_call>) or the import path `package.module:parse` of a function (text) -> list of ToolCall / CallError."})
    max_turns: int = field(default=4, metadata={"help": "Most assistant turns of a trajectory."})
    tool_timeout_s: float = field(default=10.0, metadata={"help": "Seconds one tool call may take; a call past it is an error for the model."})
    tool_workers: int = field(default=1, metadata={"help": "Processes that run tool calls on each rollout device."})
    on_tool_error: Literal["message", "end"] = field(default="message", metadata={"help": "A failed call: give the error back to the model as the tool's answer ('message'), or end the trajectory there ('end')."})

    def validate(self) -> None:
        if not self.tools:
            raise ConfigError("tools", "names no tool; give the import paths of the functions the policy may call")
        if self.parser not in TOOL_CALL_PARSERS:
            try:
                check_import_path(self.parser, "parser")
            except ConfigError:
                raise ConfigError("parser", f"'{self.parser}' is neither a tool-call parser "
                                  f"({', '.join(sorted(TOOL_CALL_PARSERS))}) nor an import path `package.module:parse`") from None
        for key in ("max_turns", "tool_workers"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not self.tool_timeout_s > 0:
            raise ConfigError("tool_timeout_s", f"must be > 0, got {self.tool_timeout_s}")


@dataclass
class Trajectory:
    """One sample's ids after the prompt so far, with log-probs, loss mask and counts."""

    prompt_index: int
    sample_index: int
    prompt_ids: Sequence[int]  # as the request gave it (a `VisionPrompt` keeps its images)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    finish_reason: str = "stop"
    policy_version: int = 0

    def add_turn(self, turn: Completion) -> None:
        self.ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.token_ids)
        self.turns += 1
        self.finish_reason = turn.finish_reason
        # the oldest weights of its turns (a backend may load new weights between calls)
        self.policy_version = turn.policy_version if self.turns == 1 else min(self.policy_version, turn.policy_version)

    def insert(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def completion(self) -> Completion:
        return Completion(prompt_index=self.prompt_index, sample_index=self.sample_index, prompt_ids=self.prompt_ids,
                          token_ids=self.ids, logprobs=self.logprobs, loss_mask=self.mask,
                          finish_reason=self.finish_reason, policy_version=self.policy_version,  # type: ignore[arg-type]
                          rollout_stats={"turns": float(self.turns), "tool_calls": float(self.calls),
                                         "tool_errors": float(self.errors), "tool_seconds": self.seconds})


_TOOLS: dict[tuple, ToolSet] = {}
"""Tool pools of this process, by their options: a rollout device's worker process keeps its pool between steps
and stops it when it closes (`close`)."""


def _parser(opts: ToolTurnsOptions) -> ToolCallParser:
    return TOOL_CALL_PARSERS.get(opts.parser) or load_callable(opts.parser, "rollout.options.parser")


def _tools(opts: ToolTurnsOptions) -> ToolSet:
    key = (tuple(opts.tools), opts.tool_timeout_s, opts.tool_workers)
    if key not in _TOOLS:
        _TOOLS[key] = ToolSet(opts.tools, opts.tool_timeout_s, opts.tool_workers)
    return _TOOLS[key]


def check_options(options: Mapping[str, Any], tokenizer: Any = None) -> None:
    """What the driver checks before any process starts: the options, that every tool imports and can be
    described to the model, and that the policy's chat template can carry tool turns (ConfigError naming the
    dotted key otherwise)."""
    opts = from_dict(ToolTurnsOptions, dict(options), prefix="rollout.options")
    load_tools(opts.tools)
    _parser(opts)
    if tokenizer is not None:
        ToolTurnRenderer(tokenizer)


def prompt_tools(options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tools' JSON schemas, which chat prompts are rendered with (the template's `tools=`)."""
    return load_tools(from_dict(ToolTurnsOptions, dict(options), prefix="rollout.options").tools)[1]


def tool_turns(request: RolloutRequest) -> Iterator[list[Completion]]:
    """The rollout function (see the module docstring)."""
    opts = from_dict(ToolTurnsOptions, dict(request.options), prefix="rollout.options")
    tools, parse = _tools(opts), _parser(opts)
    renderer = ToolTurnRenderer(request.tokenizer)
    budget, eos = request.params.max_new_tokens, request.tokenizer.eos_token_id
    trajectories: dict[tuple[int, int], Trajectory] = {}
    turns = [c for chunk in request.engine.generate_stream(request.prompts, request.params, seed=request.seed)
             for c in chunk]
    for turn_number in range(1, opts.max_turns + 1):
        ending: list[Trajectory] = []
        calling: list[tuple[Trajectory, list[ToolCall | CallError]]] = []
        for turn in turns:
            key = (turn.prompt_index, turn.sample_index)
            trajectory = trajectories.setdefault(key, Trajectory(*key, request.prompts[turn.prompt_index]))
            trajectory.add_turn(turn)
            calls = parse(request.tokenizer.decode(turn.token_ids, skip_special_tokens=False))
            ends_turn = bool(turn.token_ids) and turn.token_ids[-1] == eos
            (calling.append((trajectory, calls)) if calls and ends_turn and turn_number < opts.max_turns
             else ending.append(trajectory))
        follow_ups = _answer(calling, tools, renderer, opts, budget, ending)
        if ending:
            yield [t.completion() for t in ending]
        if not follow_ups:
            return
        requests = [Continuation(prefix=t.prompt_ids, appended=list(t.ids), max_new_tokens=budget - len(t.ids))
                    for t in follow_ups]
        answered = [c for chunk in request.engine.continue_stream(requests, request.params,
                                                                  seed=turn_seed(request.seed, turn_number)) for c in chunk]
        turns = [_as_turn(c, follow_ups[c.prompt_index]) for c in answered]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` + 1 of a request seeded `seed`: far from the seeds of the request's other
    waves and devices (`seed + 1`, ...), so its draws are not those of another wave's first turn."""
    return (seed * 1_000_003 + turn * 7_919) % 2**62


def close() -> None:
    """Stop this process's tool pools (a device worker calls it when it closes)."""
    for tools in _TOOLS.values():
        tools.close()
    _TOOLS.clear()


def _answer(calling: list[tuple[Trajectory, list[ToolCall | CallError]]], tools: ToolSet, renderer: ToolTurnRenderer,
            opts: ToolTurnsOptions, budget: int, ending: list[Trajectory]) -> list[Trajectory]:
    """Run every call of this turn in one batch, insert each trajectory's answers; the trajectories that go on
    (the others join `ending`: a failed call under `on_tool_error: end`, or no room left)."""
    results = tools.run([call for _, calls in calling for call in calls])
    going: list[Trajectory] = []
    offset = 0
    for trajectory, calls in calling:
        mine, offset = results[offset:offset + len(calls)], offset + len(calls)
        trajectory.calls += len(calls)
        trajectory.errors += sum(r.error for r in mine)
        trajectory.seconds += sum(r.seconds for r in mine)
        if opts.on_tool_error == "end" and any(r.error for r in mine):
            ending.append(trajectory)
            continue
        inserted = renderer.tool_ids([r.text for r in mine])
        if len(trajectory.ids) + len(inserted) >= budget:  # no room for the tool's answer and a token of reply
            trajectory.finish_reason = "length"
            ending.append(trajectory)
            continue
        trajectory.insert(inserted)
        going.append(trajectory)
    return going


def _as_turn(continuation: Completion, trajectory: Trajectory) -> Completion:
    """A continuation (indexed by request) as the next turn of `trajectory`."""
    continuation.prompt_index, continuation.sample_index = trajectory.prompt_index, trajectory.sample_index
    return continuation


tool_turns.check_options = check_options  # type: ignore[attr-defined]  (see `rollout.functions.check_rollout`)
tool_turns.prompt_tools = prompt_tools  # type: ignore[attr-defined]  (see `rollout.functions.prompt_tools`)
tool_turns.close = close  # type: ignore[attr-defined]  (a device worker closes its rollout function's resources)

"""`tool_turns`: a rollout function for tool-using policies (`rollout.function=gcore_rl.agents.tool_turns:tool_turns`).

Each sample is a trajectory of assistant turns. A turn that ends with the end-of-turn token and contains tool
calls (in the format of `rollout.options.parser`) has its calls run (`ToolSet`: in a pool, each with a time
limit), their results rendered as `tool` messages by the chat template (`TurnRenderer`, by delta), and the
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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gcore_rl.agents.parsers import TOOL_CALL_PARSERS, CallError, ToolCall, ToolCallParser
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.agents.tools import ToolSet, load_tools
from gcore_rl.agents.turns import Trajectory, turn_loop
from gcore_rl.configlib import check_import_path, from_dict, load_callable
from gcore_rl.errors import ConfigError
from gcore_rl.records import Completion
from gcore_rl.rollout.functions import RolloutRequest


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
        TurnRenderer(tokenizer)


def prompt_tools(options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tools' JSON schemas, which chat prompts are rendered with (the template's `tools=`)."""
    return load_tools(from_dict(ToolTurnsOptions, dict(options), prefix="rollout.options").tools)[1]


def tool_turns(request: RolloutRequest) -> Iterator[list[Completion]]:
    """The rollout function (see the module docstring)."""
    opts = from_dict(ToolTurnsOptions, dict(request.options), prefix="rollout.options")
    tools, parse = _tools(opts), _parser(opts)
    renderer = TurnRenderer(request.tokenizer)
    budget, eos = request.params.max_new_tokens, request.tokenizer.eos_token_id

    def answer(finished: list[Trajectory], last: bool) -> list[Trajectory]:
        calling: list[tuple[Trajectory, list[ToolCall | CallError]]] = []
        for trajectory in finished:
            calls = parse(request.tokenizer.decode(trajectory.last_turn, skip_special_tokens=False))
            ends_turn = bool(trajectory.last_turn) and trajectory.last_turn[-1] == eos
            if calls and ends_turn and not last:
                calling.append((trajectory, calls))
        return _answer(calling, tools, renderer, opts, budget)

    yield from turn_loop(request, opts.max_turns, answer, start=_zero_counts)


COUNTS = ("tool_calls", "tool_errors", "tool_seconds")
"""What `tool_turns` counts of each sample (`Completion.rollout_stats`, beside `turns`)."""


def _zero_counts(trajectory: Trajectory) -> None:
    for name in COUNTS:
        trajectory.count(name, 0.0)


def close() -> None:
    """Stop this process's tool pools (a device worker calls it when it closes)."""
    for tools in _TOOLS.values():
        tools.close()
    _TOOLS.clear()


def _answer(calling: list[tuple[Trajectory, list[ToolCall | CallError]]], tools: ToolSet, renderer: TurnRenderer,
            opts: ToolTurnsOptions, budget: int) -> list[Trajectory]:
    """Run every call of this turn in one batch, insert each trajectory's answers; the trajectories that go on
    (not those with a failed call under `on_tool_error: end`, nor those with no room left)."""
    results = tools.run([call for _, calls in calling for call in calls])
    going: list[Trajectory] = []
    offset = 0
    for trajectory, calls in calling:
        mine, offset = results[offset:offset + len(calls)], offset + len(calls)
        trajectory.count("tool_calls", len(calls))
        trajectory.count("tool_errors", sum(r.error for r in mine))
        trajectory.count("tool_seconds", sum(r.seconds for r in mine))
        if opts.on_tool_error == "end" and any(r.error for r in mine):
            continue
        inserted = renderer.tool_ids([r.text for r in mine])
        if trajectory.fits(inserted, budget):
            trajectory.insert(inserted)
            going.append(trajectory)
    return going


tool_turns.check_options = check_options  # type: ignore[attr-defined]  (see `rollout.functions.check_rollout`)
tool_turns.prompt_tools = prompt_tools  # type: ignore[attr-defined]  (see `rollout.functions.prompt_tools`)
tool_turns.close = close  # type: ignore[attr-defined]  (a device worker closes its rollout function's resources)

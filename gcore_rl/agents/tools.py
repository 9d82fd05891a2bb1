"""Tools a policy may call: Python functions named by import path, described to the model by the JSON
schema of their signature and docstring (`transformers.utils.get_json_schema`), run in a pool of worker
processes with a time limit per call (`rewards.pool.TimedPool`: a call that hangs costs its timeout, never
the run). Tools must be stateless: any call may run in any worker.

Every outcome is text for the model: the tool's string result, or an error message (an unknown tool, a
call that could not be parsed, a tool that raised, overran its time or returned something other than a
string), counted as a tool error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gcore_rl.agents.parsers import CallError, ToolCall
from gcore_rl.configlib import load_callable
from gcore_rl.errors import ConfigError
from gcore_rl.rewards.pool import TimedPool


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back to the model (`text`), whether it failed, and the seconds it took."""

    text: str
    error: bool
    seconds: float


_LOADED: dict[str, Callable[..., Any]] = {}


def invoke(path: str, arguments: dict[str, Any]) -> tuple[bool, str, float]:
    """Run the tool at import path `path` with `arguments` (in a pool worker): (failed, text, seconds)."""
    started = time.perf_counter()
    try:
        fn = _LOADED.get(path) or _LOADED.setdefault(path, load_callable(path, "rollout.options.tools"))
        value = fn(**arguments)
    except Exception as exc:  # a tool's failure is the model's to read, never the run's
        return True, f"error: the tool raised {type(exc).__name__}: {exc}", time.perf_counter() - started
    if not isinstance(value, str):
        return True, f"error: the tool returned {type(value).__name__}, not a string", time.perf_counter() - started
    return False, value, time.perf_counter() - started


class ToolSet:
    """The tools of `paths` (import paths of module-level functions), each call limited to `timeout_s` seconds in
    a pool of `workers` processes (started on the first call; `close` stops it). `key` is the config key that
    names the tools, for errors."""

    def __init__(self, paths: Sequence[str], timeout_s: float, workers: int = 1, key: str = "rollout.options.tools"):
        self.paths, self.schemas = load_tools(paths, key)
        self.timeout_s = timeout_s
        self.pool = TimedPool(workers, timeout_s)

    def run(self, calls: Sequence[ToolCall | CallError]) -> list[ToolResult]:
        """Each call's result, in order (all the known ones run in the pool together)."""
        runnable = [(i, c) for i, c in enumerate(calls) if isinstance(c, ToolCall) and c.name in self.paths]
        outcomes = self.pool.map(invoke, [(self.paths[c.name], c.arguments) for _, c in runnable]) if runnable else []
        results: list[ToolResult | None] = [None] * len(calls)
        for (i, call), outcome in zip(runnable, outcomes, strict=True):
            if outcome.timed_out:
                results[i] = ToolResult(f"error: the tool '{call.name}' ran past its {self.timeout_s:g} s", True,
                                        self.timeout_s)
            elif outcome.failure is not None:
                results[i] = ToolResult(f"error: the tool '{call.name}' failed ({outcome.failure})", True, 0.0)
            else:
                failed, text, seconds = outcome.value
                results[i] = ToolResult(text, failed, seconds)
        for i, call in enumerate(calls):
            if isinstance(call, CallError):
                results[i] = ToolResult(f"error: {call.reason}", True, 0.0)
            elif results[i] is None:
                results[i] = ToolResult(f"error: there is no tool '{call.name}'; the tools are "
                                        f"{', '.join(sorted(self.paths))}", True, 0.0)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()


def load_tools(paths: Sequence[str], key: str = "rollout.options.tools") -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Each tool's import path by its name, and the tools' JSON schemas (ConfigError naming `key.<index>` for a
    tool that cannot be imported or described, or two tools of one name)."""
    by_name: dict[str, str] = {}
    schemas: list[dict[str, Any]] = []
    for index, path in enumerate(paths):
        fn = load_callable(path, f"{key}.{index}")
        name = getattr(fn, "__name__", path)
        if name in by_name:
            raise ConfigError(f"{key}.{index}", f"two tools are named '{name}' ({by_name[name]} and {path})")
        by_name[name] = path
        schemas.append(tool_schema(fn, path, f"{key}.{index}"))
    return by_name, schemas


def tool_schema(fn: Callable[..., Any], path: str, key: str) -> dict[str, Any]:
    """The JSON schema a chat template renders for `fn` (ConfigError naming `key` when its signature or
    docstring cannot be described: every argument needs a type hint and an `Args:` line)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:
        raise ConfigError(key, f"cannot describe the tool `{path}` to the model ({exc}); give every argument a "
                          "type hint and a line under `Args:` in its docstring") from None

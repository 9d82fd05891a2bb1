"""Tool-call parsers: the policy's turn (text) → the calls it makes, in the chat template's own format.

A parser is a function `(text) -> list[ToolCall | CallError]`, registered by name in `TOOL_CALL_PARSERS`
(`rollout.options.parser`). `hermes` reads the format of Hermes and Qwen2.5 templates: each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call whose body is not a JSON object with a
string `name` and an object `arguments` is a `CallError`, given back to the model like a failed tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the policy made: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallError:
    """A call that could not be read (`text` is what the policy wrote, `reason` why it is not a call)."""

    text: str
    reason: str


ToolCallParser = Callable[[str], list[ToolCall | CallError]]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall | CallError]:
    """Every `<tool_call>{json}</tool_call>` of `text`, in order."""
    calls: list[ToolCall | CallError] = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(CallError(body, f"the call is not JSON ({exc.msg} at character {exc.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(CallError(body, 'the call needs a string "name"'))
        elif not isinstance(call.get("arguments", {}), dict):
            calls.append(CallError(body, '"arguments" must be an object'))
        else:
            calls.append(ToolCall(call["name"], dict(call.get("arguments", {}))))
    return calls


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes}
"""Tool-call parsers by name (`rollout.options.parser`)."""

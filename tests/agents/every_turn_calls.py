"""A tool-call parser for tests: every turn calls `mul` with its length, so a random policy uses its tool."""

from __future__ import annotations

from gcore_rl.agents.parsers import ToolCall


def parse(text: str) -> list[ToolCall]:
    return [ToolCall("mul", {"a": len(text), "b": 2})]

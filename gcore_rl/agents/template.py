"""The ids a tool turn inserts, rendered by the policy's chat template without re-tokenising the policy's turns.

A multi-turn trajectory is the prompt, then the engine's generated ids of each assistant turn exactly as
sampled, then between turns the ids of what the template writes after an assistant turn: the tool messages
and the next generation prompt. Those are rendered by *delta*: the template renders a fixed anchor
conversation that ends with an assistant turn, with and without the tool messages, and the ids inserted are
the encoding of the text after the anchor's end-of-turn token. That needs the template's prefix property
(rendering messages[:k+1] extends rendering messages[:k]), checked once when the renderer is built; a
template that rewrites earlier turns, or renders no `tool` role (drops it, writes it as an assistant turn,
or never names it), is refused in one paragraph. The text is
cut right after a special token, so its encoding cannot merge with the ids before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gcore_rl.errors import ConfigError

ANCHOR: tuple[dict[str, str], ...] = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
"""A conversation that ends with an assistant turn, after which tool messages are rendered."""


class ToolTurnRenderer:
    """Renders tool results as the ids to insert after an assistant turn that ended with `tokenizer.eos_token`
    (the end of an assistant turn in the template). `key` names the config key of the template, for errors."""

    def __init__(self, tokenizer: Any, key: str = "data.chat_template"):
        self.tokenizer = tokenizer
        end = tokenizer.eos_token
        base = self._render(list(ANCHOR), generation_prompt=False, key=key)
        if not end or end not in base:
            raise ConfigError(key, f"the chat template does not end an assistant turn with the end-of-sequence token "
                              f"{end!r}, so a turn the engine ended cannot be continued after a tool's answer")
        self.cut = base.rindex(end) + len(end)
        self.head = base[: self.cut]
        probe = "tool-answer-7"
        extended = self._render([*ANCHOR, {"role": "tool", "content": probe}], generation_prompt=True, key=key)
        if not extended.startswith(self.head):
            raise ConfigError(key, "the chat template rewrites earlier turns when a tool message follows them (rendering "
                              "a conversation plus one message does not extend rendering the conversation), so the "
                              "tokens the policy sampled could not be kept as they are; use a template with that "
                              "prefix property")
        as_reply = self._render([*ANCHOR, {"role": "assistant", "content": probe}], generation_prompt=True, key=key)
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
        if probe not in extended[self.cut:] or extended == as_reply or "tool" not in source:
            raise ConfigError(key, "the chat template renders no message of role 'tool', so a tool's answer cannot be "
                              "given back to the policy; use a template with tool support")

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, key: str = "data.chat_template") -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:
            raise ConfigError(key, f"the chat template failed on a tool conversation ({type(exc).__name__}: {exc})") from None

    def tool_ids(self, results: Sequence[str]) -> list[int]:
        """The ids after an assistant turn for tool messages holding `results`, and the next generation prompt."""
        text = self._render([*ANCHOR, *({"role": "tool", "content": r} for r in results)], generation_prompt=True)
        if not text.startswith(self.head):
            raise ConfigError("data.chat_template", "the chat template rewrote earlier turns for a tool's answer")
        return self.tokenizer.encode(text[self.cut:], add_special_tokens=False)

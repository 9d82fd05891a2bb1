"""The ids a turn inserts between assistant turns, rendered by the policy's chat template without re-tokenising
the policy's turns.

A multi-turn trajectory is the prompt, then the engine's generated ids of each assistant turn exactly as
sampled, then between turns the ids of what the template writes after an assistant turn: the messages that
answer it (a tool's results, an environment's next user message) and the next generation prompt. Those are
rendered by *delta*: the template renders a fixed anchor conversation that ends with an assistant turn, with
and without the messages, and the ids inserted are the encoding of the text after the anchor's end-of-turn
token. That needs the template's prefix property (rendering messages[:k+1] extends rendering messages[:k]),
checked once for the role the renderer inserts when it is built; a template that rewrites earlier turns, or
renders no message of that role (drops it, writes it as an assistant turn, or never names a `tool` role), is
refused in one paragraph. The text is cut right after a special token, so its encoding cannot merge with the
ids before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gcore_rl.errors import ConfigError

ANCHOR: tuple[dict[str, str], ...] = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
"""A conversation that ends with an assistant turn, after which the inserted messages are rendered."""


class TurnRenderer:
    """Renders messages of `role` (`tool`: a tool's results; `user`: an environment's answer) as the ids to insert
    after an assistant turn that ended with `tokenizer.eos_token` (the end of an assistant turn in the template).
    `key` names the config key of the template, for errors."""

    def __init__(self, tokenizer: Any, key: str = "data.chat_template", role: str = "tool"):
        self.tokenizer = tokenizer
        end = tokenizer.eos_token
        base = self._render(list(ANCHOR), generation_prompt=False, key=key)
        if not end or end not in base:
            raise ConfigError(key, f"the chat template does not end an assistant turn with the end-of-sequence token "
                              f"{end!r}, so a turn the engine ended cannot be continued after a tool's answer")
        self.cut = base.rindex(end) + len(end)
        self.head = base[: self.cut]
        probe = f"{role}-answer-7"
        extended = self._render([*ANCHOR, {"role": role, "content": probe}], generation_prompt=True, key=key)
        if not extended.startswith(self.head):
            raise ConfigError(key, f"the chat template rewrites earlier turns when a {role} message follows them (rendering "
                              "a conversation plus one message does not extend rendering the conversation), so the "
                              "tokens the policy sampled could not be kept as they are; use a template with that "
                              "prefix property")
        as_reply = self._render([*ANCHOR, {"role": "assistant", "content": probe}], generation_prompt=True, key=key)
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
        if probe not in extended[self.cut:] or extended == as_reply or role not in source:
            what = "a tool's answer" if role == "tool" else f"a {role} message"
            raise ConfigError(key, f"the chat template renders no message of role '{role}' after an assistant turn, so "
                              f"{what} cannot be given back to the policy; use a template with {role} support")

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, key: str = "data.chat_template") -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:
            raise ConfigError(key, f"the chat template failed on a multi-turn conversation ({type(exc).__name__}: {exc})") from None

    def message_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids after an assistant turn for `messages` (`{"role", "content"}`) and the next generation prompt."""
        text = self._render([*ANCHOR, *messages], generation_prompt=True)
        if not text.startswith(self.head):
            raise ConfigError("data.chat_template", "the chat template rewrote earlier turns for the messages answering one")
        return self.tokenizer.encode(text[self.cut:], add_special_tokens=False)

    def tool_ids(self, results: Sequence[str]) -> list[int]:
        """`message_ids` of one tool message per result."""
        return self.message_ids([{"role": "tool", "content": r} for r in results])

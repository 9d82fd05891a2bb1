"""Chat-format rows: conversations rendered to text with the tokenizer's chat template.

A chat row holds ``messages``: a list of turns ``{"role": "system" | "user" | "assistant",
"content": str}`` with at least one user turn (the conversational format of Hugging Face TRL). A
turn's content may also be a list of parts, ``{"type": "text", "text": str}`` and ``{"type": "image"}``
(TRL's vision format; images in system and user turns only): the row's ``images`` fill the image
parts in order, and rendering writes each image part as `IMAGE_PLACEHOLDER` in the turn's text
(`content_text`), so any template that renders text content renders it.
Rendering goes through `transformers`' ``tokenizer.apply_chat_template(..., tokenize=False)`` with
the tokenizer's own template (the demo's character tokenizer has `gcore_rl.models.tiny.TINY_CHAT_TEMPLATE`),
or with the ``data.chat_template`` override (a Jinja string or a
``.jinja`` file). The rendered text is then encoded without special tokens, as every other prompt
of the project: the template writes BOS/EOS and turn markers itself.

How each job reads a conversation (`generation_split` finds the generation point):

- GRPO and held-out evaluation: the prompt is the messages up to the generation point (a final
  assistant turn is left out), rendered with ``add_generation_prompt=True``; the left-out reply is
  the row's ``answer`` unless the row has an answer column.
- SFT: the final assistant turn is the target. Its text is what the template writes after the
  generation prompt when the whole conversation is rendered (the reply and its end-of-turn
  marker); only those tokens carry loss (`ChatRenderer.reply`).
- Reward-model pairs: the prompt as for GRPO, each of chosen/rejected rendered as the reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat turn may have (`tool`: a tool's answer, in a tool-use trace)."""



def messages_problem(messages: Any) -> str | None:
    """What is wrong with a conversation, or None when it is a list of valid turns with a user turn."""
    if messages is None:
        return "has no `messages`"
    if not isinstance(messages, list):
        return f"`messages` is not a list of turns (got {type(messages).__name__})"
    for number, turn in enumerate(messages):
        if not isinstance(turn, dict):
            return f"turn {number} of `messages` is not a {{role, content}} object (got {type(turn).__name__})"
        if turn.get("role") not in ROLES:
            return f"turn {number} of `messages` has the unknown role {turn.get('role')!r}; roles are {', '.join(ROLES)}"
        problem = _content_problem(turn)
        if problem is not None:
            return f"turn {number} of `messages` ({turn['role']}) {problem}"
    if not any(turn["role"] == "user" for turn in messages):
        return "`messages` has no user turn; a conversation needs at least one"
    return None


def _content_problem(turn: dict[str, Any]) -> str | None:
    """What is wrong with a turn's content (text, or a list of text and image parts), or None."""
    content = turn.get("content")
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return "has no text `content`"
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" and turn["role"] == "assistant":
            return f"has an image in content part {index}; images go in system and user turns"
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"has a text content part {index} without a `text` string"
        if kind not in ("text", "image"):
            return (f"has content part {index} that is neither {{type: text, text}} nor {{type: image}} "
                    f"(got {part!r:.60})")
    return None


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A valid turn's content as text: text parts joined, each image part written as `IMAGE_PLACEHOLDER`."""
    if isinstance(content, str):
        return content
    return "".join(IMAGE_PLACEHOLDER if part["type"] == "image" else part["text"] for part in content)


def image_parts(messages: Sequence[dict[str, Any]]) -> int:
    """How many image parts a valid conversation has (the images its row must hold)."""
    return sum(1 for turn in messages if isinstance(turn["content"], list)
               for part in turn["content"] if part["type"] == "image")


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """`messages` itself when valid (see `messages_problem`); DataError naming `where` otherwise."""
    problem = messages_problem(messages)
    if problem is not None:
        raise DataError(f"{where}: {problem}")
    return messages


def generation_split(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(the turns before the generation point, the final assistant turn or None).

    A conversation that ends with an assistant turn is split before it; any other ends at the
    generation point already.
    """
    if messages and messages[-1]["role"] == "assistant":
        return list(messages[:-1]), messages[-1]
    return list(messages), None


def is_template_text(value: str) -> bool:
    """Whether a ``data.chat_template`` value is Jinja text (it has a tag or an expression) rather than a path."""
    return "{%" in value or "{{" in value


def check_chat_template_option(value: str | None) -> None:
    """ConfigError (key ``chat_template``) for an empty value or a path that is not a readable file."""
    if value is None or is_template_text(value):
        return
    if not value.strip():
        raise ConfigError("chat_template", "must be a Jinja template, a path to a .jinja file, or null")
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError("chat_template", f"'{value}' is neither a Jinja template (no {{% %}} or {{{{ }}}}) nor an "
                          "existing file; give the template text or the path of a .jinja file")


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, override: str | None, model_path: str) -> str:
    """The template to render with: `override` (text, or the contents of the file it names) or the tokenizer's own.

    Raises DataError when neither exists, since chat rows cannot be rendered without one.
    """
    if override is not None:
        check_chat_template_option(override)
        return override if is_template_text(override) else Path(override).expanduser().read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise DataError(f"the data is in chat format (`messages`), but the tokenizer of '{model_path}' has no chat "
                        "template; set data.chat_template to a Jinja template or a .jinja file")
    return template


class ChatRenderer:
    """Renders conversations with one tokenizer and template; every error names the row it was given. `tools`:
    JSON schemas of the tools the policy may call, handed to the template (`tools=`), which renders them where
    it renders tools (a template that ignores them renders none)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, tools: Sequence[dict[str, Any]] = ()):
        self.tokenizer = tokenizer
        self.template = template
        self.tools = list(tools) or None

    def render(self, messages: Sequence[dict[str, Any]], where: str, *, add_generation_prompt: bool) -> str:
        turns = [{**turn, "content": content_text(turn["content"])} for turn in messages]
        try:
            text = self.tokenizer.apply_chat_template(turns, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, tools=self.tools)
        except Exception as exc:  # jinja2 raises syntax, undefined and raise_exception() errors alike
            raise DataError(f"{where}: the chat template failed to render this row ({type(exc).__name__}: {exc}); "
                            "fix the row or the template (data.chat_template)") from None
        if not isinstance(text, str):
            raise DataError(f"{where}: the chat template rendered {type(text).__name__}, not text")
        return text

    def prompt(self, messages: Sequence[dict[str, Any]], where: str) -> str:
        """The text a policy continues: `messages` up to the generation point, with the generation prompt."""
        return self.render(generation_split(check_messages(list(messages), where))[0], where, add_generation_prompt=True)

    def reply(self, prompt_messages: Sequence[dict[str, Any]], reply: dict[str, Any], where: str) -> tuple[str, str]:
        """(prompt text, completion text): the completion is what the template writes for `reply` after the
        generation prompt (the reply and its end-of-turn marker). DataError when the rendered
        conversation does not start with the rendered prompt (the template rewrites earlier turns)."""
        prompt = self.render(prompt_messages, where, add_generation_prompt=True)
        whole = self.render([*prompt_messages, reply], where, add_generation_prompt=False)
        if not whole.startswith(prompt):
            raise DataError(f"{where}: the chat template renders the conversation differently from its prompt "
                            f"(prompt {prompt[-40:]!r}, conversation {whole[:len(prompt)][-40:]!r}), so the reply "
                            "cannot be told apart; use a template whose prompt is a prefix of the conversation")
        return prompt, whole[len(prompt):]

    def final_reply(self, messages: Any, where: str) -> tuple[str, str]:
        """`reply` for the final assistant turn of a conversation (the SFT target); DataError without one."""
        prompt_messages, final = generation_split(check_messages(messages, where))
        if final is None:
            raise DataError(f"{where}: the conversation ends with a {messages[-1]['role']} turn, but SFT trains on a "
                            "final assistant turn; end every training conversation with the assistant's reply")
        return self.reply(prompt_messages, final, where)

    def turns(self, messages: Any, where: str) -> tuple[str, list[tuple[str, bool]]]:
        """(prompt text, [(text, trained)]): the conversation up to its first assistant turn, with the generation
        prompt, then every later message as the template renders it after the ones before: an assistant turn
        (its reply and end-of-turn marker) trained, any other message (a tool's answer, a user turn, with the
        generation prompt after it when an assistant turn follows) not. The multi-turn SFT target, laid out as
        a tool-using rollout lays out its trajectory. DataError without an assistant turn, or when the
        template rewrites earlier turns."""
        messages = check_messages(list(messages), where)
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: the conversation has no assistant turn to train on")
        done = prompt = self.render(messages[:first], where, add_generation_prompt=True)
        segments = []
        for k in range(first, len(messages)):
            reply = messages[k]["role"] == "assistant"
            then_reply = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
            text = self.render(messages[:k + 1], where, add_generation_prompt=not reply and then_reply)
            if not text.startswith(done):
                raise DataError(f"{where}: the chat template renders message {k} ({messages[k]['role']}) by rewriting "
                                "the turns before it, so the turns cannot be told apart; use a template whose "
                                "rendering of a conversation extends the rendering of its beginning")
            segments.append((text[len(done):], reply))
            done = text
        return prompt, segments

    def preference(self, row: dict[str, Any], fields: tuple[str, str], where: str) -> tuple[str, str, str]:
        """(prompt text, chosen completion, rejected completion) of a chat preference row (TRL's two forms).

        Explicit prompt: ``messages`` holds the shared prompt and each of `fields` the assistant's
        reply (text, or a list of one assistant turn). Implicit prompt: no ``messages``; each of
        `fields` is a whole conversation ending with an assistant turn, both with the same turns before it.
        """
        if is_chat_row(row):
            prompt_messages = generation_split(check_messages(row["messages"], where))[0]
            replies = [_assistant_reply(row.get(name), name, where) for name in fields]
        else:
            splits = []
            for name in fields:
                before, final = generation_split(check_messages(row.get(name), f"{where}, `{name}`"))
                if final is None:
                    raise DataError(f"{where}: the conversation in `{name}` does not end with an assistant turn")
                splits.append((before, final))
            if splits[0][0] != splits[1][0]:
                raise DataError(f"{where}: `{fields[0]}` and `{fields[1]}` differ before their final assistant turns; "
                                "the two sides of a preference pair share one prompt")
            prompt_messages, replies = splits[0][0], [final for _, final in splits]
        prompt, chosen = self.reply(prompt_messages, replies[0], where)
        return prompt, chosen, self.reply(prompt_messages, replies[1], where)[1]


def _assistant_reply(value: Any, name: str, where: str) -> dict[str, Any]:
    """A reply column's value as an assistant turn: text (or a number), or a list of one assistant turn."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return {"role": "assistant", "content": str(value)}
    if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
            and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str)):
        return value[0]
    raise DataError(f"{where}: `{name}` must be the assistant's reply, as text or as a list of one assistant turn "
                    f"(got {value!r:.60})")


def is_chat_row(row: dict[str, Any]) -> bool:
    """Whether a loaded row is a conversation still to be rendered (it has `messages` and no `prompt`)."""
    return "prompt" not in row and "messages" in row


def render_prompt_rows(rows: Sequence[dict[str, Any]], renderer: ChatRenderer | None, source: str,
                       row_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Rows with chat rows given their rendered ``prompt`` (and ``answer`` from a left-out final reply).

    `row_ids[i]` is the global row of `rows[i]`, named in errors; plain rows are returned as they are.
    """
    out = []
    for row, row_id in zip(rows, row_ids, strict=True):
        if not is_chat_row(row):
            out.append(row)
            continue
        if renderer is None:
            raise ValueError("chat rows need a ChatRenderer")
        where = f"{source}, row {row_id}"
        rendered = {**row, "prompt": renderer.prompt(row["messages"], where)}
        final = generation_split(row["messages"])[1]
        if "answer" not in rendered and final is not None:
            rendered["answer"] = content_text(final["content"])
        out.append(rendered)
    return out

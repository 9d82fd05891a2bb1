"""The parts of `make demo-agent`: the tiny tokenizer's tool tokens and tool-capable template, the multiply_tool
task's traces (calls the Hermes parser reads and the `mul` tool answers), and the builtin `mul` tool."""

from __future__ import annotations

import pytest

from gcore_rl.agents.builtin_tools import mul
from gcore_rl.agents.parsers import parse_hermes
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.data.chat import ChatRenderer
from gcore_rl.data.tasks import make_task_rows
from gcore_rl.errors import DataError
from gcore_rl.models.tiny import TOOL_TOKENS, build_char_tokenizer

TOOLS = [{"type": "function", "function": {"name": "mul", "description": "Multiply two integers.", "parameters": {}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(extra_tokens=TOOL_TOKENS)


def test_tool_tokens_are_single_tokens_that_decode_as_text(tokenizer):
    plain = build_char_tokenizer()
    text = "<tool_call>{}</tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 4 and len(plain.encode(text, add_special_tokens=False)) == len(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # a parser reads the decoded turn
    assert len(tokenizer) == len(plain) + len(TOOL_TOKENS)


def test_the_template_renders_tools_by_name_and_tool_answers(tokenizer):
    messages = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert text == "T:mul;\nU:12*34=\nA:<tool_call>{}</tool_call><eos><tool_response>408</tool_response>\nA:408<eos>"
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == "U:12*34=\nA:"
    # what a rollout inserts after a call is the template's rendering of the tool message and the next prompt
    assert tokenizer.decode(TurnRenderer(tokenizer).tool_ids(["408"])) == "<tool_response>408</tool_response>\nA:"
    prompt, segments = ChatRenderer(tokenizer, tokenizer.chat_template, TOOLS).turns(messages, "row 0")
    assert prompt == "T:mul;\nU:12*34=\nA:" and [trained for _, trained in segments] == [True, False, True]


def test_multiply_tool_rows_mix_traces_and_direct_answers():
    rows = make_task_rows("multiply_tool", 2000, seed=1, digits=4, calls=0.25)
    traces = [row for row in rows if row["via_tool"]]
    assert 0.22 < len(traces) / len(rows) < 0.28
    for row in rows:
        a, b = map(int, row["messages"][0]["content"].removesuffix("=").split("*"))
        assert 1000 <= a <= 9999 and 1000 <= b <= 9999 and row["answer"] == str(a * b) == row["messages"][-1]["content"]
    for row in traces[:50]:
        (call,) = parse_hermes(row["messages"][1]["content"])
        assert call.name == "mul" and mul(**call.arguments) == row["messages"][2]["content"] == row["answer"]
    assert not any(row["via_tool"] for row in make_task_rows("multiply_tool", 200, seed=1, calls=0))
    assert make_task_rows("multiply_tool", 5, seed=3) == make_task_rows("multiply_tool", 5, seed=3)
    with pytest.raises(DataError, match="calls must be a share"):
        make_task_rows("multiply_tool", 1, seed=0, calls=1.5)

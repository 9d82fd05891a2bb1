"""A character tokenizer with tool-call special tokens and a chat template that renders `tool` messages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tool_template import TOOL_TEMPLATE

from gcore_rl.models.tiny import build_char_tokenizer

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/ray_folder.py
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def tool_tokenizer():
    tokenizer = build_char_tokenizer(extra_special=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"))
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer

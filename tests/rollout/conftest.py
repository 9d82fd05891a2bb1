"""Fixtures of the generation tests: a tiny random policy with the character tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/ray_folder.py
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="module")
def tiny():
    """(model in eval mode, tokenizer): 64 wide, 2 layers, seed 3."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    return model.eval(), tokenizer

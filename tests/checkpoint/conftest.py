"""Checkpoint tests share a tiny model folder; the helpers beside tests/cli_helpers.py are importable here.

Test folders have no `__init__.py`, so pytest puts only a test file's own folder on `sys.path`;
the shared helpers live one level up (tests/test_bad_inputs.py builds checkpoints with them too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from checkpoint_helpers import tiny_model_dir  # noqa: E402 - importable only after the line above


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny model folder: the source of each checkpoint's config and tokenizer, and its frozen reference."""
    return tiny_model_dir(tmp_path_factory.mktemp("checkpoint-models"))

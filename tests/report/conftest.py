"""Report tests use the CLI helpers beside tests/cli_helpers.py (test folders have no `__init__.py`,
so pytest puts only a test file's own folder on `sys.path`)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

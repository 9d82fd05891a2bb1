"""The findings tables in docs/simulator.md are what benchmarks/sim_findings.py prints today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("section", ["a", "p"])  # the fast sections; (b)-(d) take 10-20 s each
def test_findings_tables_in_the_docs_reproduce(section):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sim_findings.py"), "--only", section],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    assert rows, out
    doc = (REPO / "docs" / "simulator.md").read_text()
    missing = [row for row in rows if row not in doc]
    assert not missing, "docs/simulator.md is out of date; rerun benchmarks/sim_findings.py:\n" + "\n".join(missing)

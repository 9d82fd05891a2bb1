"""The findings tables in docs/simulator-findings.md (and the model's, in docs/simulator.md) are what benchmarks/sim_findings.py prints today.

The simulator is deterministic (workload lengths from `numpy.random.default_rng([seed, step])`,
no wall clock, no thread-dependent reductions), but its last bits may differ from one CPU to another
(numpy dispatches `exp` to different SIMD code paths); a printed figure that sits on a rounding
boundary could then flip its last digit. A row therefore matches when its text outside the numbers
is the same and every number is within one unit of its last printed digit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def split_row(row: str) -> tuple[str, list[tuple[float, float]]]:
    """The row's text with numbers replaced by '#', and each number with one unit of its last digit."""
    numbers = [(float(m.group()), 10.0 ** -len(m.group().partition(".")[2])) for m in NUMBER.finditer(row)]
    return NUMBER.sub("#", row), numbers


def same_row(printed: str, documented: str) -> bool:
    text, numbers = split_row(printed)
    doc_text, doc_numbers = split_row(documented)
    return text == doc_text and all(abs(a - b) <= 1.0001 * max(ua, ub)
                                    for (a, ua), (b, ub) in zip(numbers, doc_numbers, strict=True))


def test_rows_match_within_one_unit_of_the_last_digit():
    assert same_row("| colocate | 12.35 | 4.0% |", "| colocate | 12.36 | 4.1% |")
    assert not same_row("| colocate | 12.35 | 4.0% |", "| colocate | 12.37 | 4.0% |")
    assert not same_row("| colocate | 12.35 |", "| partial | 12.35 |")


def test_findings_tables_in_the_docs_reproduce():
    # the fast sections (a), (p), (s), (t), (w), in one process; (b)-(d) take 10-20 s each
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sim_findings.py"), "--only", "apstw"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    assert rows, out
    pages = [REPO / "docs" / "simulator-findings.md", REPO / "docs" / "simulator.md"]  # (t) explains the model
    documented = [line for page in pages for line in page.read_text().splitlines() if line.startswith("| ")]
    missing = [row for row in rows if not any(same_row(row, doc) for doc in documented)]
    assert not missing, "docs/simulator-findings.md or docs/simulator.md is out of date; rerun benchmarks/sim_findings.py:\n" + "\n".join(missing)

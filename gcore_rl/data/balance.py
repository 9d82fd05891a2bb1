"""Splitting a step's rows over workers so each gets the same number of rows and similar cost."""

from __future__ import annotations

from collections.abc import Sequence


def balance_rows(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split row indices into `parts` lists of equal length with near-equal total cost.

    Greedy longest-first: rows in decreasing cost go to the part with the smallest total that
    still has room. Equal row counts keep the workers' FSDP micro-batches paired; balanced cost
    (e.g. tokens) keeps them finishing together. Each returned list is sorted. Raises ValueError
    when the rows cannot be split evenly.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} rows cannot be split evenly over {parts} workers")
    capacity = len(costs) // parts
    totals = [0.0] * parts
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(costs)), key=lambda r: (-costs[r], r)):
        part = min((p for p in range(parts) if len(assigned[p]) < capacity), key=lambda p: (totals[p], p))
        assigned[part].append(row)
        totals[part] += costs[row]
    return [sorted(rows) for rows in assigned]

"""Prompt rows for `rollout_phase` in tests: a list whose row numbers are the positions, drawn from the start."""

from __future__ import annotations

from collections.abc import Sequence


class ListedRows:
    """`PromptRows` over `rows`: each `draw(k)` hands out the first k rows again (row number = position)."""

    def __init__(self, rows: Sequence[dict]):
        self.rows = list(rows)

    def draw(self, count: int) -> list[tuple[int, dict]]:
        return list(enumerate(self.rows[:count]))

    def rows_of(self, row_ids: Sequence[int]) -> list[tuple[int, dict]]:
        return [(row, self.rows[row]) for row in row_ids]

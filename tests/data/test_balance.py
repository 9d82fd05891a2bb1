"""Equal-count, cost-balanced row splits."""

import pytest

from gcore_rl.data.balance import balance_rows


def test_split_has_equal_counts_and_covers_every_row_once():
    costs = [9, 1, 1, 1, 8, 2, 2, 7]
    parts = balance_rows(costs, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(r for p in parts for r in p) == list(range(8))
    # by hand: 9→A, 8→B, 7→B (8 < 9), 2→A, 2→A, 1→A (A now full), 1→B, 1→B: A = 14, B = 17
    assert parts == [[0, 1, 5, 6], [2, 3, 4, 7]]
    assert abs(sum(costs[r] for r in parts[0]) - sum(costs[r] for r in parts[1])) <= 3


def test_one_part_and_uneven_split():
    assert balance_rows([3, 1, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="3 rows cannot be split evenly over 2"):
        balance_rows([3, 1, 2], 2)

"""Equal-count, cost-balanced row splits."""

import pytest

from gcore_rl.data.balance import SequenceCost, balance_rows, imbalance


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


def test_sequence_cost_is_the_weights_linear_term_plus_the_attention_quadratic_term():
    cost = SequenceCost(params=1000.0, layers=2, hidden=8)
    # 6·N·L + 6·layers·hidden·L² at L = 10: 60 000 + 9 600
    assert cost(10) == 69_600.0
    # at a long length attention dominates: doubling L more than doubles the cost
    assert cost(1024) > 2 * cost(512)


def test_sequence_cost_from_a_llama_config():
    config = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 16, "vocab_size": 10}
    # per layer: q, o 2·64 + k, v 2·64·2/4 = 192; MLP 3·8·16 = 384; LM head 80 → N = 2·576 + 80
    assert SequenceCost.from_config(config) == SequenceCost(params=1232.0, layers=2, hidden=8)
    assert SequenceCost.from_config({"text_config": config}) == SequenceCost.from_config(config)


def test_imbalance_is_the_largest_part_over_the_mean_part():
    assert imbalance([1.0, 1.0, 1.0, 1.0], [[0, 1], [2, 3]]) == 1.0
    assert imbalance([3.0, 1.0, 1.0, 1.0], [[0, 1], [2, 3]]) == pytest.approx(4 / 3)  # 4 against a mean of 3


def test_the_heap_follows_the_rule_it_states():
    """Each row, longest first, goes to the part with the smallest total that has room, the lowest index
    among equal totals: the rule checked by scanning every part, on costs with many ties."""
    import random

    def by_scan(costs, parts):
        capacity, totals = len(costs) // parts, [0.0] * parts
        assigned = [[] for _ in range(parts)]
        for row in sorted(range(len(costs)), key=lambda r: (-costs[r], r)):
            part = min((p for p in range(parts) if len(assigned[p]) < capacity), key=lambda p: (totals[p], p))
            assigned[part].append(row)
            totals[part] += costs[row]
        return [sorted(rows) for rows in assigned]

    rng = random.Random(0)
    for parts in (1, 2, 3, 7, 16):
        for _ in range(20):
            costs = [rng.choice([1, 2, 3, 5, 8, 64, 512]) * rng.choice([1.0, 1.5]) for _ in range(parts * rng.randint(1, 9))]
            assert balance_rows(costs, parts) == by_scan(costs, parts)

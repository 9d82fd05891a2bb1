"""The engine's per-round timing and the fixed part of a decode step (what dynamic placement cannot divide)."""

import pytest

from gcore_rl.rollout.stats import EngineStats, fixed_step_seconds


def test_fixed_step_seconds_is_the_intercept_over_batch_sizes():
    batches = [64, 40, 20, 10, 5, 2, 1]
    seconds = [0.01 + 0.002 * b for b in batches]
    assert fixed_step_seconds(batches, seconds) == pytest.approx(0.01)
    stats = EngineStats(decode_steps=140, longest=100, round_batches=batches, round_seconds=seconds)
    assert stats.fixed_seconds == pytest.approx(1.0)  # the longest completion's 100 steps, not all 140


def test_fixed_step_seconds_needs_a_tail_and_stays_within_the_measurements():
    assert fixed_step_seconds([8, 8, 8, 8], [0.1, 0.1, 0.1, 0.1]) == 0.0  # no spread in batch sizes: unknown
    assert fixed_step_seconds([1, 2, 3], [0.3, 0.2, 0.1]) == 0.1  # a negative slope cannot exceed the fastest round
    assert fixed_step_seconds([1, 2, 3], [0.1, 0.3, 0.5]) == 0.0  # a negative intercept means nothing is fixed

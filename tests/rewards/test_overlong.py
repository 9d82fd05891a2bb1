"""DAPO's soft overlong punishment and overlong filtering, against values worked by hand."""

from __future__ import annotations

import pytest

from gcore_rl.rewards.overlong import overlong_penalties, overlong_penalty, truncated_keep_mask


def test_penalty_is_zero_before_the_buffer_and_falls_linearly_to_minus_scale():
    # max_length 10, buffer 4: the buffer starts after 10 - 4 = 6 tokens; scale 0.5
    # 7 tokens: -0.5 × (7 - 6) / 4 = -0.125; 8: -0.25; 10: -0.5 (the limit); 11 (cannot happen here): -0.5
    assert overlong_penalties([3, 6, 7, 8, 10, 11], max_length=10, buffer=4, scale=0.5) == pytest.approx(
        [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_penalty(10, max_length=10, buffer=4) == -1.0  # default scale 1: DAPO's -1 at L_max


def test_buffer_zero_turns_the_shaping_off():
    assert overlong_penalties([1, 5, 10], max_length=10, buffer=0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("buffer,scale", [(10, 1.0), (11, 1.0), (-1, 1.0), (4, -0.5)])
def test_impossible_buffers_and_negative_scales_are_refused(buffer, scale):
    with pytest.raises(ValueError):
        overlong_penalty(5, max_length=10, buffer=buffer, scale=scale)


def test_filtering_drops_only_completions_stopped_by_the_length_limit():
    assert truncated_keep_mask(["stop", "length", "stop"]) == [1.0, 0.0, 1.0]

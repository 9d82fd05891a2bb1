"""TIS / MIS weights and mismatch diagnostics on a 2 × 3 case worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gcore_rl.algos.mismatch import mismatch_weights, ratio_reference

# token ratios pi_trainer / pi_rollout: row 0 [1.5, 0.6, (padding)], row 1 [3, 1, 0.25]
TRAINER = torch.tensor([[0.6, 0.3, 1.0], [0.9, 0.3, 0.1]]).log()
ROLLOUT = torch.tensor([[0.4, 0.5, 0.7], [0.3, 0.3, 0.4]]).log()
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def _weights(correction, level, cap):
    weights, stats = mismatch_weights(TRAINER, ROLLOUT, MASK, correction, level, cap)
    return weights, stats


def test_token_tis_caps_each_ratio_at_c():
    weights, stats = _weights("tis", "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[1.5, 0.6, 0.0], [2.0, 1.0, 0.25]]))  # 3 capped to 2
    assert stats.truncated_fraction == pytest.approx(1 / 5) and stats.masked_fraction == 0.0
    assert stats.ratio_mean == pytest.approx((1.5 + 0.6 + 3 + 1 + 0.25) / 5) and stats.ratio_max == pytest.approx(3.0)


def test_token_mis_zeroes_ratios_outside_the_band():
    weights, stats = _weights("mis", "token", 2.0)
    # band [0.5, 2]: 1.5, 0.6 and 1 stay (with their ratio as weight), 3 and 0.25 go
    assert torch.allclose(weights, torch.tensor([[1.5, 0.6, 0.0], [0.0, 1.0, 0.0]]))
    assert stats.masked_fraction == pytest.approx(2 / 5) and stats.truncated_fraction == 0.0


def test_sequence_level_uses_the_product_of_the_row_ratios():
    # row 0: 1.5 × 0.6 = 0.9; row 1: 3 × 1 × 0.25 = 0.75 (padding excluded)
    weights, stats = _weights("tis", "sequence", 2.0)
    assert torch.allclose(weights, torch.tensor([[0.9, 0.9, 0.0], [0.75, 0.75, 0.75]]))
    assert stats.ratio_mean == pytest.approx((2 * 0.9 + 3 * 0.75) / 5) and stats.ratio_max == pytest.approx(0.9)
    # band [1/1.2, 1.2] = [0.833, 1.2]: row 1 (0.75) is masked whole, 3 of the 5 valid tokens
    weights, stats = _weights("mis", "sequence", 1.2)
    assert torch.allclose(weights, torch.tensor([[0.9, 0.9, 0.0], [0.0, 0.0, 0.0]]))
    assert stats.masked_fraction == pytest.approx(3 / 5)


def test_mismatch_kl_estimates():
    _, stats = _weights("none", "token", 2.0)
    # k1 = mean(log rollout - log trainer) = -(ln 1.5 + ln 0.6 + ln 3 + ln 1 + ln 0.25) / 5 = -ln(0.675) / 5
    assert stats.kl_k1 == pytest.approx(-math.log(0.675) / 5)
    # k3 = mean(r - 1 - ln r) = ((0.5 + (-0.4) + 2 + 0 + (-0.75)) - ln(0.675)) / 5 = (1.35 - ln 0.675) / 5
    assert stats.kl_k3 == pytest.approx((1.35 - math.log(0.675)) / 5)


def test_none_gives_no_weights_and_identical_log_probs_no_mismatch():
    weights, stats = mismatch_weights(TRAINER, TRAINER.clone(), MASK, "none", "token", 2.0)
    assert weights is None
    assert stats.kl_k1 == 0.0 and stats.kl_k3 == 0.0 and stats.ratio_max == 1.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="> 1"):
        mismatch_weights(TRAINER, ROLLOUT, MASK, "tis", "token", 1.0)
    with pytest.raises(ValueError, match="shape"):
        mismatch_weights(TRAINER, ROLLOUT[:, :2], MASK, "tis", "token", 2.0)


def test_with_a_correction_the_ppo_ratio_is_taken_against_the_trainer_for_stale_rows_too():
    staleness = torch.tensor([0, 1])
    assert torch.equal(ratio_reference(TRAINER, ROLLOUT, staleness, "none")[1], ROLLOUT[1])
    assert torch.equal(ratio_reference(TRAINER, ROLLOUT, staleness, "tis"), TRAINER)

"""The critic's math: KL-shaped token rewards, value targets, the clipped value loss and explained variance.

Hand-worked values on tiny cases (arithmetic in the comments), and parity with verl 0.9.1's
``core_algos.compute_value_loss`` (value, clip fraction and gradient) from the fixture written by
``tests/algos/fixtures/make_reference_fixtures.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gcore_rl.algos.value_loss import (
    ValueLossStats,
    clipped_value_loss,
    explained_variance,
    kl_shaped_token_rewards,
    value_targets,
)

F64 = torch.float64
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "value_loss_verl.json").read_text())

# Two rows of three tokens, the last token of row 0 masked (its value is NaN: padding garbage).
# value_clip = 0.5, V_clip = old + clamp(V - old, -0.5, 0.5):
#   row 0, t0: V 1.0, old 0.8, R 0.0:  V_clip 1.0   errors 1.0 / 1.0    -> 1.0   (not clipped)
#   row 0, t1: V 2.0, old 1.0, R 3.0:  V_clip 1.5   errors 1.0 / 2.25   -> 2.25  (clipped: no gradient)
#   row 1, t0: V 2.0, old 1.0, R 0.0:  V_clip 1.5   errors 4.0 / 2.25   -> 4.0   (not clipped)
#   row 1, t1: V -1.0, old 0.0, R -0.5: V_clip -0.5 errors 0.25 / 0.0   -> 0.25  (not clipped)
#   row 1, t2: V 0.3, old 0.3, R 0.3:  V_clip 0.3   errors 0.0 / 0.0    -> 0.0   (not clipped)
VALUES = [[1.0, 2.0, math.nan], [2.0, -1.0, 0.3]]
OLD = [[0.8, 1.0, 0.0], [1.0, 0.0, 0.3]]
RETURNS = [[0.0, 3.0, 0.0], [0.0, -0.5, 0.3]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def _hand_case():
    values = torch.tensor(VALUES, dtype=F64, requires_grad=True)
    return values, torch.tensor(OLD, dtype=F64), torch.tensor(RETURNS, dtype=F64), torch.tensor(MASK, dtype=F64)


def test_clipped_value_loss_hand_values_token_mean():
    values, old, returns, mask = _hand_case()
    loss, stats = clipped_value_loss(values, old, returns, mask, value_clip=0.5)
    # 0.5 * (1.0 + 2.25 + 4.0 + 0.25 + 0.0) / 5 = 0.5 * 7.5 / 5
    assert loss.item() == pytest.approx(0.75, abs=1e-12)
    assert isinstance(stats, ValueLossStats)
    assert stats.clip_fraction == pytest.approx(0.2)  # 1 of 5 valid tokens
    assert stats.values_mean == pytest.approx(0.86)  # (1 + 2 + 2 - 1 + 0.3) / 5
    assert stats.squared_error == pytest.approx(1.25)  # (1 + 1 + 4 + 0.25 + 0) / 5
    loss.backward()
    # d/dV of 0.5 * (V - R)^2 / 5 is (V - R) / 5 on unclipped tokens, 0 on the clipped and masked ones
    expected = [[0.2, 0.0, 0.0], [0.4, -0.1, 0.0]]
    torch.testing.assert_close(values.grad, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("aggregation", "norm_length", "expected"), [
    ("seq_mean_token_mean", None, 0.7604166666666666),  # 0.5 * (3.25 / 2 + 4.25 / 3) / 2 = 0.5 * (1.625 + 1.41667) / 2
    ("seq_mean_token_sum", None, 1.875),  # 0.5 * (3.25 + 4.25) / 2
    ("seq_mean_token_sum_norm", 3, 0.625),  # 0.5 * (3.25 / 3 + 4.25 / 3) / 2
])
def test_clipped_value_loss_other_aggregations(aggregation, norm_length, expected):
    values, old, returns, mask = _hand_case()
    loss, _ = clipped_value_loss(values, old, returns, mask, value_clip=0.5, aggregation=aggregation,
                                 norm_length=norm_length)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_without_a_clip_the_loss_is_half_the_squared_error():
    values, old, returns, mask = _hand_case()
    loss, stats = clipped_value_loss(values, old, returns, mask, value_clip=None)
    assert loss.item() == pytest.approx(0.625, abs=1e-12)  # 0.5 * (1 + 1 + 4 + 0.25 + 0) / 5
    assert stats.clip_fraction == 0.0


@pytest.mark.parametrize("bad", [0.0, -0.1, math.inf, math.nan])
def test_a_bad_value_clip_is_refused(bad):
    values, old, returns, mask = _hand_case()
    with pytest.raises(ValueError, match="value_clip"):
        clipped_value_loss(values, old, returns, mask, value_clip=bad)


def test_mismatched_shapes_are_refused():
    values, old, returns, mask = _hand_case()
    with pytest.raises(ValueError, match="matching"):
        clipped_value_loss(values, old[:, :2], returns, mask)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda case: case["name"])
def test_clipped_value_loss_matches_verl(case):
    x = {key: torch.tensor(value, dtype=F64) for key, value in FIXTURE["inputs"].items()}
    values = x["values"].clone().requires_grad_(True)
    settings = case["settings"]
    loss, stats = clipped_value_loss(values, x["old_values"], x["returns"], x["mask"], value_clip=settings["value_clip"],
                                     aggregation=settings["aggregation"], norm_length=settings["norm_length"])
    loss.backward()
    expected = case["outputs"]
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-6)
    assert stats.clip_fraction == pytest.approx(expected["clip_fraction"], abs=1e-6)
    torch.testing.assert_close(values.grad, torch.tensor(expected["grad"], dtype=F64), rtol=0, atol=1e-6)


def test_the_verl_fixture_exercises_the_clip():
    """The stored cases are not all trivially unclipped (so parity means something)."""
    fractions = {case["name"]: case["outputs"]["clip_fraction"] for case in FIXTURE["cases"]}
    assert 0.1 < fractions["clip0.2_token_mean"] < 0.9
    assert fractions["clip1e9_token_mean"] == 0.0


def test_explained_variance_hand_values():
    # returns 1, 2, 3, 4 (mean 2.5, variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25);
    # values 1, 2, 3, 3: residual 0, 0, 0, 1 (mean 0.25, variance (3 * 0.0625 + 0.5625) / 4 = 0.1875)
    # -> 1 - 0.1875 / 1.25 = 0.85. The masked fifth column holds garbage.
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]], dtype=F64)
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.85, abs=1e-12)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)  # a perfect critic
    assert explained_variance(torch.full_like(returns, 7.0), returns, mask).item() == pytest.approx(0.0)  # a constant one


def test_explained_variance_is_nan_when_the_returns_do_not_vary():
    returns = torch.tensor([[2.0, 2.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    assert math.isnan(explained_variance(torch.zeros_like(returns), returns, mask).item())


def test_kl_shaped_token_rewards_hand_values():
    # rows end at columns 2 and 2; row 1 starts at column 1 (a prompt column before it)
    # r_t = -0.1 * 0.5 = -0.05 on every valid token, plus the outcome on the last one:
    #   row 0: -0.05, -0.05, 1 - 0.05, 0     row 1: 0, -0.05, -2 - 0.05, 0
    rewards = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    kl = torch.full((2, 4), 0.5, dtype=F64)
    expected = torch.tensor([[-0.05, -0.05, 0.95, 0.0], [0.0, -0.05, -2.05, 0.0]], dtype=F64)
    torch.testing.assert_close(kl_shaped_token_rewards(rewards, mask, kl, kl_coef=0.1), expected, rtol=0, atol=1e-12)
    outcome_only = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, -2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(kl_shaped_token_rewards(rewards, mask, kl, kl_coef=0.0), outcome_only)
    torch.testing.assert_close(kl_shaped_token_rewards(rewards, mask), outcome_only)


def test_value_targets_hand_values():
    # the rewards of the previous test; gamma = lam = 1 gives returns = reward to go:
    #   row 0: 0.85, 0.9, 0.95        row 1: -, -2.1, -2.05
    # advantages = returns - values (values 0.5, 0.2, 0.1 and -, -1.0, 0.0)
    rewards = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    kl = torch.full((2, 4), 0.5, dtype=F64)
    values = torch.tensor([[0.5, 0.2, 0.1, 7.0], [7.0, -1.0, 0.0, 7.0]], dtype=F64)
    advantages, returns = value_targets(rewards, values, mask, gamma=1.0, lam=1.0, kl=kl, kl_coef=0.1,
                                        whiten_advantages=False)
    torch.testing.assert_close(returns, torch.tensor([[0.85, 0.9, 0.95, 0.0], [0.0, -2.1, -2.05, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(advantages, torch.tensor([[0.35, 0.7, 0.85, 0.0], [0.0, -1.1, -2.05, 0.0]], dtype=F64),
                               rtol=0, atol=1e-12)
    whitened, same_returns = value_targets(rewards, values, mask, gamma=1.0, lam=1.0, kl=kl, kl_coef=0.1)
    torch.testing.assert_close(same_returns, returns)  # the critic's targets are never whitened
    valid = whitened[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-6)

"""Parity of the advantage estimators and policy losses with TRL's and verl's own code, in fp64 to 1e-6.

The expected values were computed by TRL 1.16.0 and verl 0.9.1 in the benchmark venv and stored as
JSON by ``tests/algos/fixtures/make_reference_fixtures.py`` (see its docstring for how to re-make
them); this suite does not need either package. Inputs: 4 prompts x 3 samples, ragged responses in a
``[12, 7]`` window, one group with equal rewards. Losses are compared on value and on the gradient
with respect to the current log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gcore_rl.algos.advantages import (
    discounted_returns,
    gae_advantages,
    group_advantages,
    last_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.masked import masked_whiten
from gcore_rl.algos.registry import compute_policy_loss

F64 = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-6}
FIXTURES = Path(__file__).parent / "fixtures"
ADVANTAGES = json.loads((FIXTURES / "advantages_verl.json").read_text())
LOSSES = json.loads((FIXTURES / "policy_losses_reference.json").read_text())


def _tensors(raw: dict) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value, dtype=F64) for key, value in raw.items() if isinstance(value, list)}


def _case(fixture: dict, name: str) -> dict:
    return next(case for case in fixture["cases"] if case["name"] == name)


def _close_on_mask(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    """Equal where the mask is set (verl leaves its own values off the mask; ours are 0 there)."""
    if actual.dim() == 1:
        actual = actual.unsqueeze(-1).expand_as(mask)
    keep = mask.bool()
    torch.testing.assert_close(actual[keep], expected[keep], **TOL)


X = _tensors(ADVANTAGES["inputs"])
N = ADVANTAGES["group_size"]


def _expected(name: str) -> dict[str, torch.Tensor]:
    return _tensors(_case(ADVANTAGES, name)["outputs"])


@pytest.mark.parametrize("scale", [True, False], ids=["grpo", "dr_grpo"])
def test_group_advantages_match_verl(scale):
    """verl (and TRL) divide by the unbiased std: `unbiased_std=True` reproduces them."""
    expected = _expected("grpo_unbiased_std" if scale else "dr_grpo")["advantages"]
    ours = group_advantages(X["rewards"], N, scale_by_std=scale, eps=1e-6, unbiased_std=True)
    _close_on_mask(ours, expected, X["mask"])


def test_rloo_matches_verl():
    _close_on_mask(rloo_advantages(X["rewards"], N), _expected("rloo")["advantages"], X["mask"])


@pytest.mark.parametrize(("gamma", "kl_coef"), [(1.0, 0.0), (0.95, 0.2)])
def test_reinforce_pp_matches_verl(gamma, kl_coef):
    expected = _expected(f"reinforce_pp_gamma{gamma}_kl{kl_coef}")
    ours = reinforce_pp_advantages(X["rewards"], X["mask"], kl=X["kl"], kl_coef=kl_coef, gamma=gamma)
    _close_on_mask(ours, expected["advantages"], X["mask"])
    shaped = last_token_rewards(X["rewards"], X["mask"]) - kl_coef * X["kl"]
    _close_on_mask(discounted_returns(shaped, X["mask"], gamma), expected["returns"], X["mask"])


def test_reinforce_pp_baseline_matches_verl():
    ours = reinforce_pp_baseline_advantages(X["rewards"], N, X["mask"])
    _close_on_mask(ours, _expected("reinforce_pp_baseline")["advantages"], X["mask"])


def test_remax_matches_verl():
    ours = remax_advantages(X["rewards"], X["greedy_rewards"])
    _close_on_mask(ours, _expected("remax")["advantages"], X["mask"])


def test_gae_matches_verl():
    """verl returns its GAE advantages whitened; the returns (advantages + values) are raw."""
    case = _case(ADVANTAGES, "gae")
    expected = _tensors(case["outputs"])
    mask = expected["mask"]
    advantages, returns = gae_advantages(expected["token_rewards"], X["values"], mask, **case["settings"])
    _close_on_mask(returns, expected["returns"], mask)
    _close_on_mask(masked_whiten(advantages, mask), expected["whitened_advantages"], mask)


LOSS_INPUTS = _tensors(LOSSES["inputs"])
LOSS_CASES = [case["name"] for case in LOSSES["cases"]]


@pytest.mark.parametrize("name", LOSS_CASES)
def test_policy_loss_matches_reference(name):
    """Each case names its reference (TRL's `GRPOTrainer._compute_loss` or verl's policy loss) and settings."""
    case = _case(LOSSES, name)
    s = case["settings"]
    x = LOSS_INPUTS
    prefix = {"ppo_clip": "", "dual_clip": "", "gspo": "gspo_", "cispo": "cispo_"}[s["policy_loss"]]
    algo = AlgoConfig(policy_loss=s["policy_loss"], loss_aggregation=s["aggregation"], norm_length=s.get("norm_length"),
                      dual_clip_c=s.get("dual_clip_c", 3.0),
                      **{f"{prefix}clip_low": s["clip_low"], f"{prefix}clip_high": s["clip_high"]})
    algo.validate()
    logprobs = x["logprobs"].clone().requires_grad_(True)
    loss, _ = compute_policy_loss(algo, logprobs, x["old_logprobs"], x[s["advantages"]], x["mask"],
                                  token_weights=x["token_weights"] if s["token_weights"] else None)
    loss.backward()
    expected = case["outputs"]
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-6, rel=0), case["reference"]
    mask = x["mask"].bool()
    torch.testing.assert_close(logprobs.grad[mask], torch.tensor(expected["grad"], dtype=F64)[mask], **TOL)


def test_every_registry_entry_has_a_reference():
    """Every loss name and aggregation appears in the fixture (the estimators have a test each above)."""
    settings = [case["settings"] for case in LOSSES["cases"]]
    assert {s["policy_loss"] for s in settings} == {"ppo_clip", "dual_clip", "gspo", "cispo"}
    assert {s["aggregation"] for s in settings} == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                                    "seq_mean_token_sum_norm"}

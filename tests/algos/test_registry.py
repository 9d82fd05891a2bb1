"""The estimator and policy-loss registries: names, hand-worked values on 2 groups x 3 samples, validation."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from gcore_rl.algos.config import AdvantageName, AlgoConfig, PolicyLossName
from gcore_rl.algos.masked import masked_whiten
from gcore_rl.algos.policy_loss import aggregate
from gcore_rl.algos.registry import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    compute_advantages,
    compute_policy_loss,
)
from gcore_rl.config import JobConfig, plan_roles
from gcore_rl.configlib import load_config
from gcore_rl.errors import ConfigError

F64 = torch.float64
TOL = {"rtol": 0.0, "atol": 1e-6}
# 2 prompts x 3 samples, one-token responses: group A = [1, 0, 0], group B = [2, 2, 5]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=F64)
ONE_TOKEN = torch.ones(6, 1, dtype=F64)


def test_config_names_are_the_registry_names():
    assert set(get_args(AdvantageName)) == set(ADVANTAGES)
    assert set(get_args(PolicyLossName)) == set(POLICY_LOSSES)


def _advantages(name: str, **algo) -> torch.Tensor:
    adv = compute_advantages(AlgoConfig(advantage=name, **algo), AdvantageInputs(REWARDS, 3, ONE_TOKEN))
    return adv.reshape(6)


def test_grpo_population_std_by_hand():
    # A: mean 1/3, centred [2/3, -1/3, -1/3], population var (4/9 + 1/9 + 1/9) / 3 = 2/9, std sqrt(2)/3 = 0.4714045
    #    -> 2/3 / (0.4714045 + 1e-6) = 1.4142106, -1/3 / (0.4714045 + 1e-6) = -0.7071053
    # B: mean 3, centred [-1, -1, 2], population var 6/3 = 2, std 1.4142136
    #    -> -1 / (1.4142136 + 1e-6) = -0.7071063, 2 / (1.4142136 + 1e-6) = 1.4142126
    expected = [1.4142105623794587, -0.7071052811897294, -0.7071052811897294,
                -0.7071062811869011, -0.7071062811869011, 1.4142125623738022]
    torch.testing.assert_close(_advantages("grpo"), torch.tensor(expected, dtype=F64), **TOL)


def test_grpo_without_std_and_dr_grpo_centre_only():
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, -1.0, 2.0], dtype=F64)  # reward - group mean
    torch.testing.assert_close(_advantages("grpo", scale_rewards=False), expected, **TOL)
    torch.testing.assert_close(_advantages("dr_grpo", scale_rewards=True), expected, **TOL)  # dr_grpo never scales


def test_rloo_by_hand():
    # A: 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5 (twice); B: 2 - (2 + 5)/2 = -1.5 (twice), 5 - (2 + 2)/2 = 3
    torch.testing.assert_close(_advantages("rloo"), torch.tensor([1.0, -0.5, -0.5, -1.5, -1.5, 3.0], dtype=F64), **TOL)


def test_reinforce_pp_baseline_by_hand():
    # centred [2/3, -1/3, -1/3, -1, -1, 2] (batch mean 0), unbiased var (6/9 + 6) / 5 = 4/3, std 1.1547005
    expected = [0.5773502670245622, -0.2886751335122811, -0.2886751335122811,
                -0.8660254005368434, -0.8660254005368434, 1.7320508010736868]
    torch.testing.assert_close(_advantages("reinforce_pp_baseline"), torch.tensor(expected, dtype=F64), **TOL)


def test_reinforce_pp_whitens_the_whole_batch_by_hand():
    # no group baseline: batch mean 10/6 = 5/3, centred [-2/3, -5/3, -5/3, 1/3, 1/3, 10/3],
    # unbiased var (4 + 25 + 25 + 1 + 1 + 100) / 9 / 5 = 52/15 = 3.4666667, std 1.8618987
    expected = [-0.3580574365032875, -0.8951435912582186, -0.8951435912582186,
                0.17902871825164368, 0.17902871825164368, 1.790287182516437]
    torch.testing.assert_close(_advantages("reinforce_pp"), torch.tensor(expected, dtype=F64), **TOL)


def test_masked_whiten_ignores_masked_entries():
    values = torch.tensor([[1.0, 3.0, 99.0]], dtype=F64)
    # valid 1, 3: mean 2, unbiased var 2, std 1.4142136 -> [-0.7071068, 0.7071068, 0]
    out = masked_whiten(values, torch.tensor([[1.0, 1.0, 0.0]], dtype=F64))
    torch.testing.assert_close(out, torch.tensor([[-0.7071067794, 0.7071067794, 0.0]], dtype=F64), **TOL)


def test_dual_clip_bounds_negative_advantage_loss_by_hand():
    # clip range [0.8, 1.2], c = 2:
    #   A = -2, ratio 3:   PPO loss -min(-6, -2.4) = 6, bound -c*A = 4 -> 4 (dual clip active)
    #   A = -2, ratio 1.3: PPO loss -min(-2.6, -2.4) = 2.6 < 4 -> 2.6
    #   A = +1, ratio 3:   -min(3, 1.2) = -1.2 (positive advantages are never dual-clipped)
    # token_mean: (4 + 2.6 - 1.2) / 3 = 1.8
    ratios = torch.tensor([[3.0, 1.3, 3.0]], dtype=F64)
    old = torch.full((1, 3), -1.0, dtype=F64)
    adv = torch.tensor([[-2.0, -2.0, 1.0]], dtype=F64)
    algo = AlgoConfig(policy_loss="dual_clip", dual_clip_c=2.0)
    loss, stats = compute_policy_loss(algo, old + ratios.log(), old, adv, torch.ones(1, 3, dtype=F64))
    assert loss.item() == pytest.approx(1.8, abs=1e-12)
    assert stats.dual_clip_fraction == pytest.approx(1 / 3)
    ppo, _ = compute_policy_loss(AlgoConfig(clip_low=0.2, clip_high=0.2), old + ratios.log(), old, adv,
                                 torch.ones(1, 3, dtype=F64))
    assert ppo.item() == pytest.approx((6 + 2.6 - 1.2) / 3, abs=1e-12)


def test_token_weights_scale_each_tokens_loss():
    # ratio 1 everywhere, A = 1: per-token loss -1; weights [0.5, 2] -> token_mean (-0.5 - 2) / 2 = -1.25
    zeros = torch.zeros(1, 2, dtype=F64)
    for name in POLICY_LOSSES:
        algo = AlgoConfig(policy_loss=name, loss_aggregation="seq_mean_token_mean" if name == "gspo" else "token_mean")
        logprobs = zeros if name != "cispo" else zeros - 1.0  # CISPO's loss is -w * A * logprob: -(-1) per token
        loss, _ = compute_policy_loss(algo, logprobs, logprobs, torch.ones(1, dtype=F64), torch.ones(1, 2, dtype=F64),
                                      token_weights=torch.tensor([[0.5, 2.0]], dtype=F64))
        assert loss.item() == pytest.approx(1.25 if name == "cispo" else -1.25, abs=1e-12), name


def test_seq_mean_token_sum_norm_needs_its_constant():
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq_mean_token_sum_norm")
    # (1 + 1) / 4 per sequence, one sequence
    assert aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq_mean_token_sum_norm", norm_length=4).item() == 0.5


def _job(*overrides: str) -> JobConfig:
    return load_config(JobConfig, None, ["model.path=unused", *overrides])


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["algo.kl_in_reward=true", "algo.kl_coef=0.1"], "algo.kl_in_reward", "algo.advantage=gae"),
    (["algo.advantage=gae", "algo.kl_in_reward=true"], "algo.kl_in_reward", "kl_coef > 0"),
    (["algo.advantage=gae", "algo.lam=1.5"], "algo.lam", "[0, 1]"),
    (["algo.lam=0.9"], "algo.lam", "algo.advantage=gae"),
    (["critic.lr=0.001"], "critic.lr", "algo.advantage=gae"),
    (["algo.advantage=gae", "critic.grad_clip=nan"], "critic.grad_clip", "finite"),
    (["algo.advantage=gae", "critic.actor_freeze_steps=5", "run.steps=5"], "critic.actor_freeze_steps", "untrained"),
    (["algo.advantage=gae", "algo.gamma=0"], "algo.gamma", "(0, 1]"),
    (["algo.advantage=gae", "critic.value_clip=-1"], "critic.value_clip", "null"),
    (["algo.advantage=gae", "critic.actor_freeze_steps=-1"], "critic.actor_freeze_steps", ">= 0"),
    (["algo.advantage=rloo", "sampling.n=1"], "sampling.n", "at least 2"),
    (["algo.policy_loss=gspo"], "algo.loss_aggregation", "seq_mean_token_mean"),
    (["algo.policy_loss=dual_clip", "algo.dual_clip_c=1.0"], "algo.dual_clip_c", "> 1"),
    (["algo.cispo_clip_low=1.5"], "algo.cispo_clip_low", "[0, 1]"),
    (["algo.norm_length=0"], "algo.norm_length", "at least 1"),
])
def test_bad_combinations_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        _job(*overrides)
    assert err.value.key == key and words in err.value.message


def test_valid_combinations_load():
    for overrides in (["algo.advantage=reinforce_pp", "sampling.n=1"], ["algo.name=grpo"],
                      ["algo.policy_loss=gspo", "algo.loss_aggregation=seq_mean_token_mean"],
                      ["algo.advantage=dr_grpo", "algo.loss_aggregation=seq_mean_token_sum_norm"],
                      ["algo.advantage=remax", "sampling.n=1"], ["algo.advantage=gae", "algo.kl_coef=0.05", "algo.kl_in_reward=true", "critic.value_clip=null"]):
        _job(*overrides)
    assert "critic" in plan_roles(_job("algo.advantage=gae")) and "critic" not in plan_roles(_job())
    assert _job("algo.advantage=remax").algo.greedy_baseline and not _job().algo.greedy_baseline
    assert _job("sampling.max_new_tokens=12").algo.resolved(12).aggregation_norm_length is None
    algo = _job("algo.loss_aggregation=seq_mean_token_sum_norm").algo
    assert algo.resolved(12).aggregation_norm_length == 12 and algo.resolved(12).norm_length == 12

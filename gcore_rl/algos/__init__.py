"""RL algorithm math: advantages, policy losses, KL estimators, masked reductions (pure tensor functions)."""

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.algos.kl import KLEstimator, entropy_from_logits, kl_divergence
from gcore_rl.algos.masked import masked_mean, masked_sum
from gcore_rl.algos.policy_loss import (
    LossAggregation,
    PolicyLossStats,
    aggregate,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
)

__all__ = [
    "KLEstimator",
    "LossAggregation",
    "PolicyLossStats",
    "aggregate",
    "cispo_loss",
    "entropy_from_logits",
    "group_advantages",
    "gspo_loss",
    "kl_divergence",
    "masked_mean",
    "masked_sum",
    "ppo_clip_loss",
]

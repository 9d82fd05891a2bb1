"""Configuration of the policy-gradient objective (GRPO / DAPO family)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gcore_rl.errors import ConfigError


@dataclass
class AlgoConfig:
    """What the actor optimises each step."""

    name: Literal["grpo"] = field(default="grpo", metadata={"help": "Advantage estimator: 'grpo' (group-relative, no critic)."})
    scale_rewards: bool = field(default=True, metadata={"help": "Divide group-centred rewards by the group std (classic GRPO); false = Dr.GRPO-style centring only."})
    clip_low: float = field(default=0.2, metadata={"help": "PPO ratio clip below 1 (ratio >= 1 - clip_low)."})
    clip_high: float = field(default=0.2, metadata={"help": "PPO ratio clip above 1 (ratio <= 1 + clip_high); DAPO clip-higher uses 0.28."})
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = field(
        default="token_mean", metadata={"help": "How per-token losses reduce to one number: token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum (Dr.GRPO)."})
    kl_coef: float = field(default=0.0, metadata={"help": "Weight of the KL(policy || reference) loss term; 0 disables the reference model."})
    kl_estimator: Literal["k1", "k2", "k3"] = field(default="k3", metadata={"help": "Per-token KL estimator used in the loss (k3 is unbiased and non-negative)."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus (subtracted from the loss)."})

    def validate(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ConfigError("clip_low", f"must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ConfigError("clip_high", f"must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef}")

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0.0

"""Configuration of the policy-gradient objective (GRPO / DAPO family)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from gcore_rl.algos.policy_loss import LossAggregation
from gcore_rl.errors import ConfigError

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"]
"""Names of :data:`gcore_rl.algos.registry.ADVANTAGES` (a test keeps the two equal)."""
PolicyLossName = Literal["ppo_clip", "dual_clip", "gspo", "cispo"]
"""Names of :data:`gcore_rl.algos.registry.POLICY_LOSSES` (a test keeps the two equal)."""


@dataclass
class AlgoConfig:
    """What the actor optimises each step."""

    name: Literal["grpo"] = field(default="grpo", metadata={"help": "Deprecated, kept so older configs load: the estimator is chosen by algo.advantage."})
    advantage: AdvantageName = field(default="grpo", metadata={"help": "Advantage estimator (see docs/algorithms.md): grpo (group mean/std; algo.scale_rewards), dr_grpo (group centring only), rloo (leave-one-out baseline), reinforce_pp (global whitening of returns), reinforce_pp_baseline (group centring + global whitening), remax (baseline: the reward of one extra greedy completion per prompt, not trained on), gae (PPO with a critic; algo.gamma/lam)."})
    policy_loss: PolicyLossName = field(default="ppo_clip", metadata={"help": "Policy loss (see docs/algorithms.md): ppo_clip (clip_low/clip_high), dual_clip (plus dual_clip_c for negative advantages), gspo (sequence-level ratio; gspo_clip_*; needs loss_aggregation=seq_mean_token_mean), cispo (clipped stop-gradient IS weight, REINFORCE-style; cispo_clip_*)."})
    scale_rewards: bool = field(default=True, metadata={"help": "advantage=grpo only: divide group-centred rewards by the group std (classic GRPO); false = Dr.GRPO-style centring only."})
    clip_low: float = field(default=0.2, metadata={"help": "PPO ratio clip below 1 (ratio >= 1 - clip_low)."})
    clip_high: float = field(default=0.2, metadata={"help": "PPO ratio clip above 1 (ratio <= 1 + clip_high); DAPO clip-higher uses 0.28."})
    dual_clip_c: float = field(default=3.0, metadata={"help": "policy_loss=dual_clip: the loss of a token with negative advantage is at most -c * A (c > 1; Ye et al. 2020)."})
    gspo_clip_low: float = field(default=3e-4, metadata={"help": "policy_loss=gspo: sequence ratio clip below 1 (GSPO paper: 3e-4)."})
    gspo_clip_high: float = field(default=4e-4, metadata={"help": "policy_loss=gspo: sequence ratio clip above 1 (GSPO paper: 4e-4)."})
    cispo_clip_low: float = field(default=1.0, metadata={"help": "policy_loss=cispo: the IS weight is at least 1 - cispo_clip_low (1 = no lower bound, as in MiniMax-M1)."})
    cispo_clip_high: float = field(default=4.0, metadata={"help": "policy_loss=cispo: the IS weight is at most 1 + cispo_clip_high."})
    loss_aggregation: LossAggregation = field(
        default="token_mean", metadata={"help": "How per-token losses reduce to one number: token_mean (DAPO), seq_mean_token_mean (GRPO, GSPO), seq_mean_token_sum (sum per sequence), seq_mean_token_sum_norm (Dr.GRPO: sum per sequence / norm_length)."})
    norm_length: int | None = field(default=None, metadata={"help": "Constant divisor of loss_aggregation=seq_mean_token_sum_norm; null = sampling.max_new_tokens."})
    kl_coef: float = field(default=0.0, metadata={"help": "Weight of the KL(policy || reference) loss term; 0 disables the reference model."})
    kl_estimator: Literal["k1", "k2", "k3"] = field(default="k3", metadata={"help": "Per-token KL estimator used in the loss (k3 is unbiased and non-negative)."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus (subtracted from the loss)."})
    overlong_filter: bool = field(default=False, metadata={"help": "DAPO overlong filtering: completions stopped by sampling.max_new_tokens (finish_reason 'length') are masked out of the loss; they still count in their group's advantages."})
    mismatch_correction: Literal["none", "tis", "mis"] = field(default="none", metadata={"help": "Correct for the engine not sampling the trainer's distribution (kernels, precision, stale weights): 'tis' weights each token's loss by min(pi_old/pi_rollout, mismatch_cap) (Yao et al. 2025), 'mis' by that ratio inside [1/mismatch_cap, mismatch_cap], else 0 (Liu, Li et al. 2025); both take the PPO ratio against the trainer's pre-update log-probs. 'none': no weight, ratio against the sampler's."})
    mismatch_level: Literal["token", "sequence"] = field(default="token", metadata={"help": "Importance ratio of mismatch_correction: per token, or per completion (product of its token ratios, applied to all its tokens)."})
    gamma: float = field(default=1.0, metadata={"help": "advantage=gae: discount per token (1 = undiscounted, the usual choice for an outcome reward)."})
    lam: float = field(default=0.95, metadata={"help": "advantage=gae: GAE's lambda (1 = Monte-Carlo return minus value; smaller leans on the critic)."})
    whiten_advantages: bool = field(default=True, metadata={"help": "advantage=gae: shift and scale the advantages to mean 0, variance 1 over the valid tokens of the whole step's batch (all controllers); the critic's returns are never whitened."})
    kl_in_reward: bool = field(default=False, metadata={"help": "advantage=gae: put the KL to the reference into the per-token reward (r_t = -kl_coef * KL_t, plus the outcome at the last token; InstructGPT's form) instead of the loss. Needs kl_coef > 0."})
    mismatch_cap: float = field(default=2.0, metadata={"help": "C of mismatch_correction (> 1): the TIS cap, or the MIS band [1/C, C]."})

    def validate(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(item.name, f"must be a finite number, got {value}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ConfigError("clip_low", f"must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ConfigError("clip_high", f"must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef}")
        self._validate_policy_loss()
        self._validate_gae()
        if not self.mismatch_cap > 1.0:
            raise ConfigError("mismatch_cap", f"must be > 1 (a cap of 1 or less would down-weight tokens the engine and "
                              f"trainer agree on, ratio 1), got {self.mismatch_cap}")

    def _validate_gae(self) -> None:
        """The options of the critic's estimator (advantage=gae)."""
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError("gamma", f"must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError("lam", f"must be in [0, 1], got {self.lam}")
        changed = [key for key, default in (("gamma", 1.0), ("lam", 0.95), ("whiten_advantages", True))
                   if getattr(self, key) != default]
        if changed and self.advantage != "gae":
            raise ConfigError(changed[0], f"is an option of GAE (PPO with a critic), and advantage={self.advantage} does "
                              "not use it: set algo.advantage=gae, or leave it at its default")
        if self.kl_in_reward and self.advantage != "gae":
            raise ConfigError("kl_in_reward", f"puts the KL into the per-token rewards that GAE discounts; "
                              f"advantage={self.advantage} works on one outcome reward per sample, so set "
                              "algo.advantage=gae or keep the KL in the loss (kl_in_reward=false)")
        if self.kl_in_reward and self.kl_coef <= 0.0:
            raise ConfigError("kl_in_reward", "needs a KL weight: set algo.kl_coef > 0 (it is the reward's beta)")

    def _validate_policy_loss(self) -> None:
        """The options of `policy_loss` and `loss_aggregation` (see gcore_rl.algos.registry)."""
        if not self.dual_clip_c > 1.0:
            raise ConfigError("dual_clip_c", f"must be > 1 (the dual clip bounds the loss of a negative-advantage token "
                              f"by c times its advantage, above the PPO clip's bound), got {self.dual_clip_c}")
        if not 0.0 <= self.gspo_clip_low < 1.0:
            raise ConfigError("gspo_clip_low", f"must be in [0, 1), got {self.gspo_clip_low}")
        if self.gspo_clip_high < 0.0:
            raise ConfigError("gspo_clip_high", f"must be >= 0, got {self.gspo_clip_high}")
        if not 0.0 <= self.cispo_clip_low <= 1.0:
            raise ConfigError("cispo_clip_low", f"must be in [0, 1] (1 = no lower bound), got {self.cispo_clip_low}")
        if self.cispo_clip_high < 0.0:
            raise ConfigError("cispo_clip_high", f"must be >= 0, got {self.cispo_clip_high}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ConfigError("norm_length", f"must be null or at least 1, got {self.norm_length}")
        if self.policy_loss == "gspo" and self.loss_aggregation != "seq_mean_token_mean":
            raise ConfigError("loss_aggregation", f"policy_loss=gspo optimises one clipped ratio per sequence, which "
                              f"only seq_mean_token_mean reduces as the GSPO objective (every sequence weighs the same); "
                              f"{self.loss_aggregation} would weight sequences by their length. Set "
                              "algo.loss_aggregation=seq_mean_token_mean")

    def resolved(self, max_new_tokens: int) -> AlgoConfig:
        """This config with `norm_length` filled in (`max_new_tokens` when null), for the trainer."""
        return replace(self, norm_length=self.norm_length or max_new_tokens)

    @property
    def aggregation_norm_length(self) -> int | None:
        """The `norm_length` argument of `aggregate` for this `loss_aggregation` (None where unused)."""
        return self.norm_length if self.loss_aggregation == "seq_mean_token_sum_norm" else None

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0.0

    @property
    def kl_in_loss(self) -> bool:
        """The KL to the reference is a loss term (not folded into GAE's per-token rewards)."""
        return self.uses_reference and not self.kl_in_reward

    @property
    def greedy_baseline(self) -> bool:
        """The estimator's baseline is a greedy completion's reward (ReMax): the rollout adds one per prompt."""
        from gcore_rl.algos.registry import ADVANTAGES  # the registry refers back to this config

        return "greedy_rewards" in ADVANTAGES[self.advantage].needs

    @property
    def uses_critic(self) -> bool:
        """The estimator needs a value model (GAE): the job gets a `critic` role."""
        return self.advantage == "gae"

"""Correction of the rollout/trainer mismatch: truncated and masked importance sampling (TIS / MIS).

The engine samples from its own distribution μ (its kernels, its precision, and under one-step-off
its older weights) while the trainer computes π; their log-probs differ even for the same weights.
Recomputing the old log-probs on the trainer (the default here and in most frameworks) takes the
PPO ratio against π_old, but the samples still come from μ, so the policy gradient is taken on
the wrong distribution (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training"). The fix multiplies each token's loss by a detached importance weight built from
``ratio = π_old / μ`` (trainer's pre-update log-prob over the engine's), while the PPO clip keeps
π_θ near π_old (AReaL's decoupled objective: π_old is the proximal policy, μ the behaviour one).

- ``tis`` (truncated IS, Yao et al.): weight ``min(ratio, C)``; large ratios, which dominate the
  variance, are capped.
- ``mis`` (masked IS, Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
  from the Training-Inference Mismatch"): weight ``ratio`` where ``1/C ≤ ratio ≤ C``, else 0 —
  a token (or sequence) the two sides disagree on that much is dropped rather than down-weighted.

Level: ``token`` uses each token's ratio; ``sequence`` uses one ratio per completion, the
**product** of its token ratios (``exp`` of the summed log-ratios), broadcast to its tokens. The
reward belongs to the whole sequence, and the product is the likelihood ratio of that sequence —
the only sequence weight whose expectation corrects the sampling distribution (Liu, Li et al.
show token-level weights leave a bias for sequence-level rewards). The geometric mean
(length-normalised, as in GSPO) is no importance weight; it only makes a fixed [1/C, C] band
length-independent. The product's variance grows with length, which the cap or the mask bounds;
the completions this project trains on are short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gcore_rl.algos.masked import masked_mean
from gcore_rl.algos.policy_loss import behaviour_logprobs

MismatchCorrection = Literal["none", "tis", "mis"]
MismatchLevel = Literal["token", "sequence"]

# exp() of a log-ratio beyond this overflows; such a ratio is past any sensible cap anyway
_LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class MismatchStats:
    """Diagnostics of one `mismatch_weights` call, python floats over the valid tokens (0.0 if none).

    The actor passes the log-probs its PPO ratio divides by as `trainer_logprobs`, so without a
    correction, stale rows (whose ratio is taken against the engine's log-probs) count as matched.

    Attributes:
        kl_k1: mean of ``log μ - log π_old``, the k1 estimate of KL(μ || π_old) on tokens sampled from μ.
        kl_k3: mean of ``ratio - 1 - log ratio`` (token ratios), the non-negative k3 estimate of the same KL.
        ratio_mean / ratio_max: mean and maximum of the ratio at the correction's level (token or
            sequence ratio, broadcast to its tokens).
        truncated_fraction: fraction of valid tokens whose weight the cap lowered (``tis``).
        masked_fraction: fraction of valid tokens given weight 0 by the band (``mis``).
    """

    kl_k1: float
    kl_k3: float
    ratio_mean: float
    ratio_max: float
    truncated_fraction: float
    masked_fraction: float

    def as_metrics(self) -> dict[str, float]:
        """The stats as step metrics (``mismatch/<name>``)."""
        return {f"mismatch/{name}": value for name, value in self.__dict__.items()}


def mismatch_weights(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                     correction: MismatchCorrection, level: MismatchLevel, cap: float) -> tuple[Tensor | None, MismatchStats]:
    """Detached per-token importance weights correcting for sampling from the engine, and diagnostics.

    Args:
        trainer_logprobs: ``[B, T]`` log-probs of the sampled tokens under the trainer's pre-update weights.
        rollout_logprobs: ``[B, T]`` the engine's log-probs of the same tokens (its sampling distribution).
        mask: ``[B, T]`` 0/1 or bool, 1 on the tokens that count.
        correction: ``none`` (weights None; the stats are still measured), ``tis`` or ``mis``.
        level: ``token`` or ``sequence`` (product of the row's token ratios), see the module docstring.
        cap: ``C > 1``: the TIS cap, or the MIS band ``[1/C, C]``.

    Returns:
        ``(weights, stats)``: ``weights`` ``[B, T]`` (no grad, 0 on invalid tokens) or None for ``none``.

    Raises:
        ValueError: shape mismatch, unknown correction or level, or ``cap <= 1``.
    """
    if trainer_logprobs.dim() != 2 or rollout_logprobs.shape != trainer_logprobs.shape or mask.shape != trainer_logprobs.shape:
        raise ValueError(f"trainer_logprobs, rollout_logprobs and mask must share shape [B, T]; got "
                         f"{tuple(trainer_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}")
    if correction not in ("none", "tis", "mis") or level not in ("token", "sequence"):
        raise ValueError(f"unknown mismatch correction {correction!r} or level {level!r}")
    if not cap > 1.0:
        raise ValueError(f"the mismatch cap must be > 1, got {cap}")
    with torch.no_grad():
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=trainer_logprobs.device)
        log_ratio = torch.where(valid, trainer_logprobs.double() - rollout_logprobs.to(trainer_logprobs.device).double(), zero)
        token_ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        if level == "sequence":
            seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
            ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)
        else:
            ratio = token_ratio
        truncated = valid & (ratio > cap) if correction == "tis" else torch.zeros_like(valid)
        masked = valid & ((ratio > cap) | (ratio < 1.0 / cap)) if correction == "mis" else torch.zeros_like(valid)
        weights = None
        if correction == "tis":
            weights = torch.where(valid, ratio.clamp(max=cap), zero)
        elif correction == "mis":
            weights = torch.where(valid & ~masked, ratio, zero)
        stats = MismatchStats(
            kl_k1=float(masked_mean(-log_ratio, valid)),
            kl_k3=float(masked_mean(token_ratio - 1.0 - log_ratio, valid)),
            ratio_mean=float(masked_mean(ratio, valid)),
            ratio_max=float(ratio[valid].max()) if bool(valid.any()) else 0.0,
            truncated_fraction=float(masked_mean(truncated.double(), valid)),
            masked_fraction=float(masked_mean(masked.double(), valid)),
        )
    return (None if weights is None else weights.to(trainer_logprobs.dtype)), stats


def ratio_reference(trainer_logprobs: Tensor, rollout_logprobs: Tensor, staleness: Tensor | None,
                    correction: MismatchCorrection) -> Tensor:
    """The log-probs ``[B, T]`` the PPO ratio divides by.

    Without a correction, those of the policy that sampled each row (`behaviour_logprobs`: the
    trainer's for fresh rows, the engine's for stale ones). With one, always the trainer's
    pre-update log-probs (the proximal policy); the importance weight of `mismatch_weights` then
    carries the whole engine-vs-trainer difference, stale rows' older weights included, so it is
    not counted twice.
    """
    if correction == "none":
        return behaviour_logprobs(trainer_logprobs, rollout_logprobs, staleness)
    return trainer_logprobs

"""PPO-style clipped policy-gradient loss and the ways of reducing a per-token loss to a scalar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from gcore_rl.algos.masked import masked_mean, masked_sum

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]

# exp() of a log-ratio beyond this would overflow / give inf * 0 = NaN gradients.
_LOG_RATIO_LIMIT = 20.0


def aggregate(per_token: Tensor, mask: Tensor, mode: LossAggregation, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over the valid tokens.

    Modes:
        * ``"token_mean"``: sum over every valid token of the batch / number of valid tokens (DAPO).
          Every token weighs the same, so long sequences weigh more.
        * ``"seq_mean_token_mean"``: mean over the valid tokens of each sequence, then mean over sequences
          (original GRPO). Every sequence weighs the same.
        * ``"seq_mean_token_sum"``: sum over the valid tokens of each sequence, divided by the constant
          ``norm_length`` when given, then mean over sequences (Dr.GRPO-like, no length normalisation).

    In both ``seq_mean_*`` modes the outer mean runs over the sequences that have at least one valid token,
    so all-padding rows do not dilute it. Whenever nothing is valid the result is 0.

    Args:
        per_token: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` 0/1 (or bool), 1 for tokens that count.
        mode: one of :data:`LossAggregation`.
        norm_length: positive constant divisor, only accepted with ``"seq_mean_token_sum"``.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: unknown ``mode``, non-positive ``norm_length``, ``norm_length`` with another mode, or
            inputs that are not matching 2-D tensors.
    """
    if per_token.dim() != 2 or per_token.shape != mask.shape:
        raise ValueError(
            f"per_token and mask must both be [B, T], got {tuple(per_token.shape)} and {tuple(mask.shape)}"
        )
    if norm_length is not None:
        if mode != "seq_mean_token_sum":
            raise ValueError(f"norm_length is only used by 'seq_mean_token_sum', not by {mode!r}")
        if norm_length <= 0:
            raise ValueError(f"norm_length must be positive, got {norm_length}")

    if mode == "token_mean":
        return masked_mean(per_token, mask)
    seq_valid = mask.bool().any(dim=-1)
    if mode == "seq_mean_token_mean":
        return masked_mean(masked_mean(per_token, mask, dim=-1), seq_valid)
    if mode == "seq_mean_token_sum":
        seq_loss = masked_sum(per_token, mask, dim=-1)
        if norm_length is not None:
            seq_loss = seq_loss / norm_length
        return masked_mean(seq_loss, seq_valid)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {get_args(LossAggregation)}")


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one :func:`ppo_clip_loss` call, as python floats over the valid tokens.

    Attributes:
        clip_fraction: fraction of valid tokens whose clipped objective was strictly smaller than the
            unclipped one (i.e. the clip was active and removed that token's gradient).
        approx_kl: masked mean of ``0.5 * (logprobs - old_logprobs)**2``, Schulman's k2 estimator of
            ``KL(pi_old || pi)`` on tokens sampled from ``pi_old``.
        ratio_mean: masked mean of ``exp(logprobs - old_logprobs)``.
        ratio_max: maximum ratio over valid tokens.

    With no valid token every field is 0.0.
    """

    clip_fraction: float
    approx_kl: float
    ratio_mean: float
    ratio_max: float


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: LossAggregation = "token_mean",
    norm_length: int | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss with separate lower and upper clip ranges (DAPO "clip-higher").

    Per valid token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``::

        loss = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)

    then reduced with :func:`aggregate`. The log-ratio is set to 0 on masked tokens and clamped to
    ``[-20, 20]`` before ``exp`` so padding garbage or extreme values cannot produce inf/NaN values or
    gradients (a token beyond that range gets zero gradient).

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under the policy that generated the samples; detached.
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``; detached.
        mask: ``[B, T]`` 0/1 or bool, 1 for response tokens that count in the loss.
        clip_low: ratio lower bound is ``1 - clip_low``.
        clip_high: ratio upper bound is ``1 + clip_high``.
        aggregation: how the per-token loss is reduced, see :func:`aggregate`.
        norm_length: forwarded to :func:`aggregate` (only for ``"seq_mean_token_sum"``).

    Returns:
        ``(loss, stats)``: ``loss`` a 0-dim tensor differentiable w.r.t. ``logprobs`` only, and
        :class:`PolicyLossStats` computed without grad over valid tokens.

    Raises:
        ValueError: on shape mismatches or negative clip ranges (and whatever :func:`aggregate` raises).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share shape [B, T]; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] with [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be non-negative, got clip_low={clip_low}, clip_high={clip_high}")

    valid = mask.bool()
    old_logprobs = old_logprobs.detach()
    advantages = advantages.detach().to(logprobs.dtype)

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    raw_log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    ratio = torch.exp(raw_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, norm_length=norm_length)

    with torch.no_grad():
        clip_fraction = masked_mean((clipped < unclipped).to(ratio.dtype), valid)
        approx_kl = masked_mean(0.5 * raw_log_ratio.square(), valid)
        ratio_mean = masked_mean(ratio, valid)
        ratio_max = ratio.masked_fill(~valid, float("-inf")).max() if bool(valid.any()) else ratio.new_zeros(())
        stats = PolicyLossStats(
            clip_fraction=float(clip_fraction),
            approx_kl=float(approx_kl),
            ratio_mean=float(ratio_mean),
            ratio_max=float(ratio_max),
        )
    return loss, stats


def behaviour_logprobs(trainer_logprobs: Tensor, rollout_logprobs: Tensor, staleness: Tensor | None) -> Tensor:
    """The log-probs the PPO ratio divides by: those of the policy that actually sampled each row.

    Fresh rows (`staleness == 0`) were sampled by the weights the trainer holds before the update,
    so the trainer's own recomputation (`trainer_logprobs`, `[B, T]`) is used: it equals the
    engine's up to numerics. Stale rows (sampled by an older policy, `disaggregated`) use the
    engine's `rollout_logprobs` (`[B, T]`), so the clipped ratio is taken against the behaviour
    policy and corrects for the lag; dividing by the newer trainer weights instead would drop the
    importance weight of the last update. `staleness` is `[B]` (None: all fresh).
    """
    if staleness is None:
        return trainer_logprobs
    stale = (staleness > 0).unsqueeze(-1)
    return torch.where(stale, rollout_logprobs, trainer_logprobs)


def logprob_gap_max(rollout_logprobs: Tensor, trainer_logprobs: Tensor, response_mask: Tensor,
                    staleness: Tensor | None) -> float:
    """Largest |engine − trainer| log-prob over the response tokens of fresh rows (`[B, T]` inputs,
    `staleness` `[B]` or None); stale rows are left out, their weights differ by design. 0 if empty."""
    fresh = response_mask if staleness is None else response_mask * (staleness == 0).to(response_mask.device).unsqueeze(-1)
    if fresh.numel() == 0:
        return 0.0
    return float(((rollout_logprobs.to(trainer_logprobs.device) - trainer_logprobs).abs() * fresh).max())

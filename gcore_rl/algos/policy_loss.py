"""PPO-style clipped policy-gradient loss and the ways of reducing a per-token loss to a scalar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from gcore_rl.algos.masked import masked_mean, masked_sum

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]

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
          ``norm_length`` when given, then mean over sequences (no length normalisation).
        * ``"seq_mean_token_sum_norm"``: the same with ``norm_length`` required: Dr.GRPO's constant
          normaliser (Liu et al. 2025), the generation's maximum length.

    In the ``seq_mean_*`` modes the outer mean runs over the sequences that have at least one valid token,
    so all-padding rows do not dilute it. Whenever nothing is valid the result is 0.

    Args:
        per_token: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` 0/1 (or bool), 1 for tokens that count.
        mode: one of :data:`LossAggregation`.
        norm_length: positive constant divisor of the ``seq_mean_token_sum*`` modes.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: unknown ``mode``, non-positive or missing ``norm_length``, ``norm_length`` with a mode
            that does not use it, or inputs that are not matching 2-D tensors.
    """
    if per_token.dim() != 2 or per_token.shape != mask.shape:
        raise ValueError(
            f"per_token and mask must both be [B, T], got {tuple(per_token.shape)} and {tuple(mask.shape)}"
        )
    sums_tokens = mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm")
    if norm_length is not None:
        if not sums_tokens:
            raise ValueError(f"norm_length is only used by the seq_mean_token_sum modes, not by {mode!r}")
        if norm_length <= 0:
            raise ValueError(f"norm_length must be positive, got {norm_length}")
    elif mode == "seq_mean_token_sum_norm":
        raise ValueError("'seq_mean_token_sum_norm' needs norm_length (the generation's maximum length)")

    if mode == "token_mean":
        return masked_mean(per_token, mask)
    seq_valid = mask.bool().any(dim=-1)
    if mode == "seq_mean_token_mean":
        return masked_mean(masked_mean(per_token, mask, dim=-1), seq_valid)
    if sums_tokens:
        seq_loss = masked_sum(per_token, mask, dim=-1)
        if norm_length is not None:
            seq_loss = seq_loss / norm_length
        return masked_mean(seq_loss, seq_valid)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {get_args(LossAggregation)}")


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one policy-loss call, as python floats over the valid tokens.

    Attributes:
        clip_fraction: fraction of valid tokens whose objective the clip changed: for PPO-style losses the
            clipped objective was strictly smaller than the unclipped one (that token's gradient was
            removed); for CISPO the importance weight was truncated; for GSPO the token's sequence ratio
            was clipped.
        approx_kl: masked mean of ``0.5 * (logprobs - old_logprobs)**2``, Schulman's k2 estimator of
            ``KL(pi_old || pi)`` on tokens sampled from ``pi_old``.
        ratio_mean: masked mean of ``exp(logprobs - old_logprobs)``.
        ratio_max: maximum ratio over valid tokens.
        dual_clip_fraction: dual-clip only: fraction of valid tokens bounded by ``-c * A`` (else None).
        seq_clip_fraction: GSPO only: fraction of sequences whose sequence ratio was clipped (else None).

    With no valid token every number is 0.0.
    """

    clip_fraction: float
    approx_kl: float
    ratio_mean: float
    ratio_max: float
    dual_clip_fraction: float | None = None
    seq_clip_fraction: float | None = None

    def extra_metrics(self) -> dict[str, float]:
        """The loss-specific statistics that are set, by metric name."""
        extra = {"dual_clip_fraction": self.dual_clip_fraction, "seq_clip_fraction": self.seq_clip_fraction}
        return {key: value for key, value in extra.items() if value is not None}


@dataclass(frozen=True)
class _Prepared:
    """Checked, detached inputs of a policy loss: ``advantages`` and ``weights`` broadcastable to ``[B, T]``."""

    valid: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    log_ratio: Tensor  # [B, T], 0 on masked tokens, not clamped
    weights: Tensor | None


def _prepare(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             token_weights: Tensor | None) -> _Prepared:
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
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(f"token_weights must be [B, T] = {tuple(logprobs.shape)}, got {tuple(token_weights.shape)}")
    valid = mask.bool()
    old_logprobs = old_logprobs.detach()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return _Prepared(
        valid=valid,
        old_logprobs=old_logprobs,
        advantages=advantages.detach().to(logprobs.dtype),
        log_ratio=torch.where(valid, logprobs - old_logprobs, zero),
        weights=None if token_weights is None else token_weights.detach().to(logprobs.dtype),
    )


def _finish(per_token: Tensor, prep: _Prepared, mask: Tensor, aggregation: LossAggregation,
            norm_length: int | None) -> Tensor:
    """Apply the optional per-token weights and reduce with :func:`aggregate`."""
    if prep.weights is not None:
        per_token = per_token * prep.weights
    return aggregate(per_token, mask, aggregation, norm_length=norm_length)


@torch.no_grad()
def _stats(prep: _Prepared, ratio: Tensor, clipped: Tensor, **extra: Tensor) -> PolicyLossStats:
    """Stats over the valid tokens; ``clipped`` ``[B, T]`` bool, ``extra`` named 0-dim tensors."""
    valid = prep.valid
    ratio_max = ratio.masked_fill(~valid, float("-inf")).max() if bool(valid.any()) else ratio.new_zeros(())
    return PolicyLossStats(
        clip_fraction=float(masked_mean(clipped.to(ratio.dtype), valid)),
        approx_kl=float(masked_mean(0.5 * prep.log_ratio.square(), valid)),
        ratio_mean=float(masked_mean(ratio, valid)),
        ratio_max=float(ratio_max),
        **{key: float(value) for key, value in extra.items()},
    )


def _token_ratio(prep: _Prepared) -> Tensor:
    return torch.exp(prep.log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))


def _check_clips(clip_low: float, clip_high: float) -> None:
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be non-negative, got clip_low={clip_low}, clip_high={clip_high}")


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: LossAggregation = "token_mean",
    norm_length: int | None = None,
    token_weights: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7) with separate lower and upper clip ranges
    (DAPO "clip-higher", Yu et al. 2025, §3.1), optionally dual-clipped (Ye et al. 2020, "Mastering
    complex control in MOBA games with deep RL", the dual-clip PPO objective).

    Per valid token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``::

        loss = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)
        dual clip, where A < 0:  loss = min(loss, -c * A)     (c > 1 bounds the loss of a huge ratio)

    times ``token_weights`` when given, then reduced with :func:`aggregate`. The log-ratio is set to 0 on
    masked tokens and clamped to ``[-20, 20]`` before ``exp`` so padding garbage or extreme values cannot
    produce inf/NaN values or gradients (a token beyond that range gets zero gradient).

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy being trained (requires grad).
        old_logprobs: ``[B, T]`` log-probs under the policy that generated the samples; detached.
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``; detached.
        mask: ``[B, T]`` 0/1 or bool, 1 for response tokens that count in the loss.
        clip_low: ratio lower bound is ``1 - clip_low``.
        clip_high: ratio upper bound is ``1 + clip_high``.
        aggregation: how the per-token loss is reduced, see :func:`aggregate`.
        norm_length: forwarded to :func:`aggregate` (the ``seq_mean_token_sum*`` modes).
        token_weights: optional ``[B, T]`` per-token weights (detached), e.g. truncated importance weights.
        dual_clip_c: the dual-clip constant ``c > 1``; None disables the dual clip.

    Returns:
        ``(loss, stats)``: ``loss`` a 0-dim tensor differentiable w.r.t. ``logprobs`` only, and
        :class:`PolicyLossStats` computed without grad over valid tokens.

    Raises:
        ValueError: on shape mismatches, negative clip ranges or ``dual_clip_c <= 1`` (and whatever
            :func:`aggregate` raises).
    """
    prep = _prepare(logprobs, old_logprobs, advantages, mask, token_weights)
    _check_clips(clip_low, clip_high)
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    ratio = _token_ratio(prep)
    adv = prep.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    extra = {}
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
        extra["dual_clip_fraction"] = masked_mean(dual.to(ratio.dtype), prep.valid)
    loss = _finish(per_token, prep, mask, aggregation, norm_length)
    return loss, _stats(prep, ratio, clipped < unclipped, **extra)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    aggregation: LossAggregation = "seq_mean_token_mean",
    norm_length: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", the GSPO objective): one importance ratio per
    sequence, the geometric mean of its token ratios ``s_i = exp(mean_{t valid} log(pi / pi_old))``,
    clipped at sequence level: ``loss_i = -min(s_i * A_i, clamp(s_i, 1 - clip_low, 1 + clip_high) * A_i)``.

    Computed in the paper's GSPO-token form: the per-token ratio is
    ``sg[s_i] * pi(y_t) / sg[pi(y_t)]``, equal in value to ``s_i`` on every token of the sequence, so with
    ``seq_mean_token_mean`` aggregation loss and gradient equal the sequence-level objective's (the paper's
    clip ranges are small, 3e-4 / 4e-4, because a sequence ratio moves much less than a token ratio).
    Token-level advantages ``[B, T]`` are allowed (the GSPO-token variant).

    Args: as :func:`ppo_clip_loss`; ``clip_low`` / ``clip_high`` bound the sequence ratio.

    Returns:
        ``(loss, stats)`` with ``stats.seq_clip_fraction`` the fraction of sequences (with a valid token)
        whose ratio was clipped in the direction that removes their gradient; ``ratio_mean`` /
        ``ratio_max`` describe the token ratios.
    """
    prep = _prepare(logprobs, old_logprobs, advantages, mask, token_weights)
    _check_clips(clip_low, clip_high)
    seq_valid = prep.valid.any(dim=-1)
    seq_log_ratio = masked_mean(prep.log_ratio, prep.valid, dim=-1).detach()  # [B]
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.unsqueeze(-1)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    token_log_ratio = torch.where(prep.valid, token_log_ratio, zero)
    seq_ratio = torch.exp(token_log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
    adv = prep.advantages
    unclipped = seq_ratio * adv
    clipped = seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = _finish(per_token, prep, mask, aggregation, norm_length)
    token_clipped = (clipped < unclipped) & prep.valid
    seq_clip = masked_mean(token_clipped.any(dim=-1).to(logprobs.dtype), seq_valid)
    return loss, _stats(prep, _token_ratio(prep), token_clipped, seq_clip_fraction=seq_clip)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    aggregation: LossAggregation = "token_mean",
    norm_length: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """CISPO (MiniMax 2025, "MiniMax-M1", the CISPO objective): REINFORCE with a clipped, stop-gradient importance weight,
    ``loss_t = -sg(clamp(ratio_t, 1 - clip_low, 1 + clip_high)) * A * logprobs_t``.

    Unlike PPO's clip, which drops the gradient of a clipped token, every token keeps its gradient
    (``A * grad log pi``); only its weight is bounded. MiniMax-M1 sets no lower bound in practice
    (``clip_low = 1`` here: the weight only has to be >= 0) and tunes the upper one.

    Args: as :func:`ppo_clip_loss`.

    Returns:
        ``(loss, stats)`` with ``stats.clip_fraction`` the fraction of valid tokens whose weight was
        truncated.
    """
    prep = _prepare(logprobs, old_logprobs, advantages, mask, token_weights)
    _check_clips(clip_low, clip_high)
    ratio = _token_ratio(prep)
    weight = ratio.clamp(max(1.0 - clip_low, 0.0), 1.0 + clip_high).detach()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    per_token = -weight * prep.advantages * torch.where(prep.valid, logprobs, zero)
    loss = _finish(per_token, prep, mask, aggregation, norm_length)
    return loss, _stats(prep, ratio, weight != ratio)


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
    stale = (staleness > 0).to(trainer_logprobs.device).unsqueeze(-1)  # the mask may come from the host
    return torch.where(stale, rollout_logprobs, trainer_logprobs)


def logprob_gap_max(rollout_logprobs: Tensor, trainer_logprobs: Tensor, response_mask: Tensor,
                    staleness: Tensor | None) -> float:
    """Largest |engine − trainer| log-prob over the response tokens of fresh rows (`[B, T]` inputs,
    `staleness` `[B]` or None); stale rows are left out, their weights differ by design. 0 if empty."""
    fresh = response_mask if staleness is None else response_mask * (staleness == 0).to(response_mask.device).unsqueeze(-1)
    if fresh.numel() == 0:
        return 0.0
    return float(((rollout_logprobs.to(trainer_logprobs.device) - trainer_logprobs).abs() * fresh).max())

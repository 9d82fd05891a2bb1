"""The critic's side of PPO: per-token value targets, the clipped value loss, explained variance.

Shapes: every per-token tensor is ``[B, T]`` in the trainer's layout (`gcore_rl.records.TokenBatch`:
entry ``t`` belongs to token ``t``; a value there is ``V`` of the state before token ``t``, see
`gcore_rl.models.value.token_values`), and ``mask`` is the response mask (1 on tokens that count).
``rewards`` is ``[B]``, one outcome reward per sample. All functions are pure.

How one PPO step with a critic uses them::

    values = token_values(critic, ids, attention, first)                   # rollout, no grad
    advantages, returns = value_targets(rewards, values, mask, gamma, lam, kl=kl, kl_coef=beta)
    ...                                                                      # update, per mini-batch:
    loss, stats = clipped_value_loss(token_values(critic, ...), values, returns, mask, value_clip)
    explained_variance(values, returns, mask)                                # metric
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gcore_rl.algos.advantages import gae_advantages, last_token_rewards
from gcore_rl.algos.masked import masked_mean, masked_whiten
from gcore_rl.algos.policy_loss import LossAggregation, aggregate


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected matching [B, T] tensors, got {shapes}")


def kl_shaped_token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards of the KL-penalised RLHF objective: ``r_t = -kl_coef * KL_t`` on every valid token,
    plus the outcome reward on each row's last valid token.

    The reward ``R(x, y) = r(x, y) - beta * KL(pi || pi_ref)`` of Ziegler et al. 2019 ("Fine-tuning
    language models from human preferences", §2.2) and Ouyang et al. 2022 (InstructGPT, eq. 2), with
    the KL spread over the tokens that produce it, as verl's ``apply_kl_penalty`` and OpenRLHF's
    ``compute_reward`` place it.

    Args:
        rewards: ``[B]`` outcome reward per sample.
        mask: ``[B, T]`` response mask; a row without a valid token gets no reward.
        kl: ``[B, T]`` per-token KL estimate (e.g. `gcore_rl.algos.kl.kl_divergence` of the sampled
            tokens), detached; None, or ``kl_coef == 0``, leaves only the outcome reward.
        kl_coef: ``beta``.

    Returns:
        ``[B, T]`` token rewards, 0 off the mask.
    """
    token_rewards = last_token_rewards(rewards, mask)
    if kl is None or kl_coef == 0.0:
        return token_rewards
    _check_same_shape(kl=kl, mask=mask)
    penalty = kl_coef * kl.detach().to(token_rewards.dtype)
    return torch.where(mask.bool(), token_rewards - penalty, torch.zeros_like(token_rewards))


def value_targets(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95,
                  kl: Tensor | None = None, kl_coef: float = 0.0, whiten_advantages: bool = True,
                  turn_rewards: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """PPO's advantages and the critic's regression targets from outcome rewards and rollout values.

    `kl_shaped_token_rewards`, then `gcore_rl.algos.advantages.gae_advantages` (``returns = A + V``, taken
    before any whitening, so the critic regresses on the unscaled return), then optionally whitening
    the advantages over the valid tokens of the batch (`masked_whiten`, as verl's
    ``compute_gae_advantage_return`` and OpenRLHF's PPO trainer do).

    Args:
        rewards: ``[B]``; values: ``[B, T]`` the critic's values at rollout time (detached); mask: ``[B, T]``.
        gamma, lam: GAE's discount and lambda (``lam = 1``: Monte-Carlo returns minus values).
        kl, kl_coef: the KL-in-reward option (see `kl_shaped_token_rewards`).
        whiten_advantages: shift and scale the advantages to mean 0 and variance 1 over the mask.
        turn_rewards: ``[B, T]`` rewards given within a trajectory (an environment's per turn, each at the last
            token of the turn it rewards, on the mask), added to the token rewards; `rewards` then holds the
            rest of each row's reward, which stays on its last token.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, 0 off the mask.
    """
    _check_same_shape(values=values, mask=mask)
    token_rewards = kl_shaped_token_rewards(rewards, mask, kl, kl_coef)
    if turn_rewards is not None:
        _check_same_shape(turn_rewards=turn_rewards, mask=mask)
        token_rewards = token_rewards + turn_rewards.to(token_rewards.dtype) * mask.to(token_rewards.dtype)
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


@dataclass(frozen=True)
class ValueLossStats:
    """Diagnostics of one value-loss call, as python floats over the valid tokens.

    Attributes:
        clip_fraction: fraction of valid tokens whose clipped squared error was strictly larger than the
            unclipped one, i.e. the loss took the clipped branch and that token's value gets no gradient
            (verl's ``vf_clipfrac``).
        values_mean: mean of the predicted values.
        squared_error: mean of ``(values - returns)^2`` (unclipped, without the 0.5).
    """

    clip_fraction: float
    values_mean: float
    squared_error: float


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                       value_clip: float | None = 0.2, aggregation: LossAggregation = "token_mean",
                       norm_length: int | None = None) -> tuple[Tensor, ValueLossStats]:
    """PPO's clipped value loss: per valid token ::

        V_clip = old_V + clamp(V - old_V, -value_clip, value_clip)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

    reduced with `gcore_rl.algos.policy_loss.aggregate`. The form of OpenAI baselines' PPO2
    (``ppo2/model.py``, the clipped value function), analysed by Engstrom et al. 2020 ("Implementation
    matters in deep policy gradients", value function clipping), and used by verl
    (``core_algos.compute_value_loss``: ``0.5 * agg_loss(max(...))``) and OpenRLHF (``ValueLoss``). The clip
    keeps one update from moving a value more than ``value_clip`` away from what the critic said at
    rollout time, the way the policy clip bounds the ratio. ``value_clip=None`` gives the plain
    ``0.5 * (V - R)^2``.

    Args:
        values: ``[B, T]`` the critic's values now (requires grad).
        old_values: ``[B, T]`` its values at rollout time (detached).
        returns: ``[B, T]`` targets, e.g. from `value_targets` (detached).
        mask: ``[B, T]`` response mask.
        value_clip: ``> 0``, in the units of the returns; None disables the clip.
        aggregation, norm_length: as for `aggregate`.

    Returns:
        ``(loss, stats)``: a 0-dim tensor differentiable w.r.t. ``values`` only, and `ValueLossStats`.

    Raises:
        ValueError: shapes that differ, ``value_clip <= 0`` (or not finite), and whatever `aggregate` raises.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if value_clip is not None and not (math.isfinite(value_clip) and value_clip > 0):
        raise ValueError(f"value_clip must be a finite number > 0 or None, got {value_clip}")
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # padding may hold anything: keep it out of the arithmetic, so no NaN reaches a gradient through 0 * NaN
    values = torch.where(valid, values, zero)
    old_values = torch.where(valid, old_values.detach().to(values.dtype), zero)
    returns = torch.where(valid, returns.detach().to(values.dtype), zero)
    unclipped = (values - returns).square()
    if value_clip is None:
        per_token, clipped = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        moved = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (moved - returns).square()
        per_token = torch.maximum(unclipped, clipped_error)
        clipped = clipped_error > unclipped
    loss = 0.5 * aggregate(per_token, mask, aggregation, norm_length=norm_length)
    with torch.no_grad():
        stats = ValueLossStats(clip_fraction=float(masked_mean(clipped.to(values.dtype), valid)),
                               values_mean=float(masked_mean(values.detach(), valid)),
                               squared_error=float(masked_mean(unclipped.detach(), valid)))
    return loss, stats


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over the valid tokens (the critic's fit; 1 is perfect,
    0 no better than the mean return, negative worse), as OpenAI baselines' ``explained_variance``
    (``common/math_util.py``) and CleanRL's ``ppo.py`` report it.

    Both variances divide by the same count, so the biased/unbiased convention cancels. The ratio of a
    batch is not the mean of its parts' ratios: a distributed caller must reduce the sums first.

    Args: values, returns, mask ``[B, T]``.
    Returns: a 0-dim tensor (no grad); NaN when the returns have no variance over the mask (fewer
    than two valid tokens, or all equal), where the quantity is undefined.
    """
    _check_same_shape(values=values, returns=returns, mask=mask)
    returns = returns.to(values.dtype)
    keep = mask.bool()

    def variance(x: Tensor) -> Tensor:
        return masked_mean((x - masked_mean(x, keep)).square(), keep)

    total = variance(returns)
    if not bool(total > 0):
        return torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    return 1.0 - variance(returns - values) / total

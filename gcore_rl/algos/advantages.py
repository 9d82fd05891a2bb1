"""Advantage estimators: pure functions from rewards (and values) to per-sample or per-token advantages.

Shape conventions shared by every function here:

* ``rewards`` ``[B]``: one scalar (outcome) reward per sample, ``B = num_groups * group_size``, groups
  contiguous (rows ``g * n .. (g + 1) * n - 1`` are the ``n`` samples of prompt ``g``).
* ``mask`` ``[B, T]``: 1 on the response tokens that count (the trainer's ``response_mask``); prompt
  columns and padding are 0. Token-level estimators return ``[B, T]`` with 0 outside the mask.

Which estimator a run uses is chosen by name in :mod:`gcore_rl.algos.registry` (``algo.advantage``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gcore_rl.algos.masked import masked_whiten


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``rewards`` ``[B]`` as ``[B / n, n]`` floats; ValueError on a bad shape or size."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.shape[0]}) is not divisible by group_size ({group_size}); "
            "expected num_groups * group_size contiguous samples"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards.reshape(-1, group_size)


def _check_mask(rewards: Tensor, mask: Tensor) -> None:
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must be [B, T] with B = {rewards.shape[0]}, got {tuple(mask.shape)}")


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6,
                     unbiased_std: bool = False) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3 with §4.1.2's outcome-supervision advantage) and Dr.GRPO
    (Liu et al. 2025, "Understanding R1-Zero-Like Training", the Dr.GRPO advantage without std): advantage of each sample relative to the other
    samples drawn for the same prompt, ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``.

    Args:
        rewards: ``[B]`` scalar reward per sample (groups contiguous, see the module docstring).
        group_size: number of samples per prompt (``n``).
        scale_by_std: if True, divide the centred reward by ``(std + eps)`` of its group (GRPO); if False,
            only subtract the group mean (Dr.GRPO).
        eps: added to the group standard deviation before dividing.
        unbiased_std: divide the variance by ``n - 1`` (what TRL and verl do) instead of ``n`` (the
            default here: a group of size 1 stays well defined).

    Returns:
        ``[B]`` advantages, floating point (integer/bool rewards are promoted to the default float dtype).
        Any group whose rewards are all identical gets advantage exactly 0 (no signal, and no amplified
        round-off from dividing by a near-zero std).

    Raises:
        ValueError: if ``rewards`` is not 1-D, ``group_size < 1``, or ``B`` is not divisible by ``group_size``.
    """
    grouped = _grouped(rewards, group_size)
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = grouped.std(dim=1, unbiased=unbiased_std and group_size > 1, keepdim=True)
        adv = adv / (std + eps)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", the RLOO estimator; Kool et al. 2019): each sample's baseline is
    the mean reward of the *other* samples of its prompt, ``A_i = r_i - 1/(n-1) * sum_{j != i} r_j``.

    Args:
        rewards: ``[B]`` scalar reward per sample (groups contiguous).
        group_size: ``n >= 2`` samples per prompt.

    Returns:
        ``[B]`` advantages (equal to ``n / (n - 1)`` times the group-centred reward).
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got group_size={group_size}")
    grouped = _grouped(rewards, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sample's scalar reward on its last valid token: ``[B]`` + mask ``[B, T]`` -> ``[B, T]``.

    Rows with no valid token get no reward at all.
    """
    _check_mask(rewards, mask)
    keep = mask.bool()
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(keep)
    last = torch.where(keep, columns, torch.full_like(columns, -1)).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype(),
                      device=rewards.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows].to(out.dtype)
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t, mask_s} gamma^(k(s) - k(t)) r_s`` over the valid tokens of each row, where ``k``
    counts valid tokens (masked columns are skipped, not discounted). ``[B, T]`` in, ``[B, T]`` out, 0
    outside the mask."""
    keep = mask.bool()
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    out = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(keep[:, t], token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return out


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                            gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: a simple and efficient approach for aligning LLMs", its token
    reward with KL penalty and global advantage normalisation):
    token rewards ``r_t = -kl_coef * KL_t`` plus the outcome reward on the last token, discounted returns
    ``G_t``, then whitened over every valid token of the *global batch* (no per-prompt baseline).

    Args:
        rewards: ``[B]`` outcome reward per sample.
        mask: ``[B, T]`` response mask.
        kl: ``[B, T]`` per-token KL(policy || reference) estimate for the KL-shaped reward, or None.
        kl_coef: weight of ``kl`` in the reward (0 leaves the outcome reward alone).
        gamma: discount over tokens (1 in the paper).

    Returns:
        ``[B, T]`` advantages, whitened with :func:`~gcore_rl.algos.masked.masked_whiten`, 0 off the mask.
    """
    token_rewards = last_token_rewards(rewards, mask)
    if kl is not None and kl_coef != 0.0:
        if kl.shape != mask.shape:
            raise ValueError(f"kl must be [B, T] = {tuple(mask.shape)}, got {tuple(kl.shape)}")
        token_rewards = token_rewards - kl_coef * kl.to(token_rewards.dtype)
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_size: int, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, §3 "REINFORCE++-baseline"): subtract the mean reward of the prompt's
    group, broadcast the centred reward over the sample's valid tokens, then whiten over the valid
    tokens of the global batch (the global std replaces GRPO's per-group std).

    Args:
        rewards: ``[B]`` outcome reward per sample (groups contiguous).
        group_size: samples per prompt.
        mask: ``[B, T]`` response mask.

    Returns:
        ``[B, T]`` advantages, 0 off the mask.
    """
    _check_mask(rewards, mask)
    centred = group_advantages(rewards, group_size, scale_by_std=False)
    per_token = centred.unsqueeze(-1).expand(mask.shape).to(centred.dtype)
    return masked_whiten(per_token, mask)


def remax_advantages(rewards: Tensor, greedy_rewards: Tensor) -> Tensor:
    """ReMax (Li et al. 2023, "ReMax: a simple, effective and efficient RL method for aligning LLMs",
    Algorithm 1): the baseline of a sampled completion is the reward of the greedy completion
    of the same prompt, ``A_i = r(x, y_i) - r(x, y_greedy)``.

    Args:
        rewards: ``[B]`` reward of each sampled completion.
        greedy_rewards: ``[B]`` reward of the greedy completion of each row's prompt (repeated over the
            prompt's samples).

    Returns:
        ``[B]`` advantages.
    """
    if rewards.dim() != 1 or greedy_rewards.shape != rewards.shape:
        raise ValueError(f"rewards and greedy_rewards must both be [B], got {tuple(rewards.shape)} and "
                         f"{tuple(greedy_rewards.shape)}")
    return rewards - greedy_rewards.to(rewards.dtype)


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-dimensional continuous control
    using GAE", eq. 16 with the TD residual of §3): ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = sum_k (gamma * lam)^k delta_{t+k}``, over the valid tokens of each row (masked columns are
    skipped; the value after the last valid token is 0, the episode ends there).

    Args:
        token_rewards: ``[B, T]`` per-token rewards, usually :func:`last_token_rewards` of the outcome
            reward (minus a per-token KL penalty when the KL goes into the reward).
        values: ``[B, T]`` critic values ``V_t`` of the state before each token; detached.
        mask: ``[B, T]`` response mask.
        gamma: discount; ``lam``: GAE's lambda (1 gives Monte-Carlo returns minus values, 0 one-step TD).

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and 0 off the mask; ``returns = advantages + values``
        (the critic's regression target). Advantages are not whitened here.
    """
    if values.shape != token_rewards.shape or mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards, values and mask must share shape [B, T]; got {tuple(token_rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    keep = mask.bool()
    values = values.detach().to(token_rewards.dtype)
    next_value = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(keep[:, t], step, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns

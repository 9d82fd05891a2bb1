"""Group-relative advantages (GRPO-style) computed from scalar rewards."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantage of each sample relative to the other samples drawn for the same prompt.

    Args:
        rewards: ``[B]`` scalar reward per sample, with ``B = num_groups * group_size``. Groups are
            contiguous: rows ``g * group_size .. (g + 1) * group_size - 1`` are the samples of prompt ``g``.
        group_size: number of samples per prompt (``n``).
        scale_by_std: if True, divide the centred reward by ``(std + eps)`` of its group (GRPO); if False,
            only subtract the group mean (Dr.GRPO).
        eps: added to the group standard deviation before dividing.

    Returns:
        ``[B]`` advantages, floating point (integer/bool rewards are promoted to the default float dtype).
        The standard deviation is the *population* one (``unbiased=False``, divide by ``n``), so a group of
        size 1 is well defined. Any group whose rewards are all identical gets advantage exactly 0
        (no signal, and no amplified round-off from dividing by a near-zero std).

    Raises:
        ValueError: if ``rewards`` is not 1-D, ``group_size < 1``, or ``B`` is not divisible by ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    batch = rewards.shape[0]
    if batch % group_size != 0:
        raise ValueError(
            f"number of rewards ({batch}) is not divisible by group_size ({group_size}); "
            "expected num_groups * group_size contiguous samples"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())

    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    adv = grouped - mean
    if scale_by_std:
        std = grouped.std(dim=1, unbiased=False, keepdim=True)
        adv = adv / (std + eps)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(batch)

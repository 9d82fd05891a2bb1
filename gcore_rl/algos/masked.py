"""Reductions over the valid (mask == 1) entries of a tensor.

All functions here treat ``mask`` as a 0/1 selector (bool or any float/int dtype). Entries where the
mask is 0 are ignored entirely, even if ``values`` holds NaN/inf there (e.g. padding garbage).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _select(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have the same shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    keep = mask.bool()
    # torch.where (rather than values * mask) so that NaN/inf in masked-out slots cannot leak into
    # the result or its gradient.
    selected = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected, keep


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` over entries where ``mask`` is set.

    Args:
        values: any shape ``[...]``.
        mask: same shape as ``values``; 0/1 float/int or bool.
        dim: dimension to reduce; ``None`` reduces over every element.

    Returns:
        A scalar when ``dim is None``, otherwise ``values`` with ``dim`` removed. An all-zero mask gives 0.
    """
    selected, _ = _select(values, mask)
    if dim is None:
        return selected.sum()
    return selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over entries where ``mask`` is set.

    Args:
        values: any shape ``[...]``.
        mask: same shape as ``values``; 0/1 float/int or bool.
        dim: dimension to reduce; ``None`` reduces over every element.

    Returns:
        A scalar when ``dim is None``, otherwise ``values`` with ``dim`` removed. Wherever the mask selects
        nothing (the whole tensor, or one slice along ``dim``) the result is 0 rather than NaN, and its
        gradient is 0 as well.
    """
    selected, keep = _select(values, mask)
    count = keep.sum() if dim is None else keep.sum(dim=dim)
    total = selected.sum() if dim is None else selected.sum(dim=dim)
    nonempty = count > 0
    denom = torch.where(nonempty, count, torch.ones_like(count)).to(total.dtype)
    return torch.where(nonempty, total / denom, torch.zeros((), dtype=total.dtype, device=total.device))


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale ``values`` to mean 0 and variance 1 over the entries where ``mask`` is set.

    ``(values - mean) / sqrt(var + eps)`` with the masked mean and the *unbiased* masked variance
    (``sum((x - mean)^2) / (count - 1)``, the convention of verl's ``masked_whiten`` and OpenRLHF's
    advantage whitening). Masked-out entries come back as 0, and so does everything when fewer than
    two entries are valid (a single entry centres to 0).

    Args:
        values: any shape ``[...]``.
        mask: same shape as ``values``; 0/1 float/int or bool.
        eps: added to the variance before the square root.

    Returns:
        Tensor shaped like ``values``.
    """
    selected, keep = _select(values, mask)
    mean = masked_mean(values, mask)
    centred = torch.where(keep, selected - mean, torch.zeros((), dtype=values.dtype, device=values.device))
    count = keep.sum()
    var = centred.square().sum() / torch.clamp(count - 1, min=1).to(values.dtype)
    return centred * torch.rsqrt(var + eps)

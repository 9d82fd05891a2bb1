"""Per-token KL estimators and entropy of a categorical distribution given its logits."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]

_K3_LOG_RATIO_LIMIT = 20.0


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``r = logprobs - ref_logprobs`` (log pi(x) - log pi_ref(x) for the sampled token x), the
    estimators from J. Schulman, "Approximating KL Divergence" (2020) are:

    * ``"k1"``: ``r`` -- unbiased, high variance, can be negative per token.
    * ``"k2"``: ``0.5 * r**2`` -- biased, low variance, always >= 0.
    * ``"k3"``: ``exp(-r) - 1 + r`` -- unbiased, low variance, always >= 0. ``r`` is clamped to
      ``[-20, 20]`` before this formula so that ``exp(-r)`` cannot overflow (and gradients stay finite);
      tokens with ``|r| > 20`` therefore get a constant value and zero gradient.

    Args:
        logprobs: ``[B, T]`` (any shape) log-probs of the sampled tokens under the current policy.
        ref_logprobs: same shape, log-probs of the same tokens under the reference policy.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.

    Returns:
        Same shape as the inputs, one estimate per token, with no reduction and no masking (combine with
        :func:`gcore_rl.algos.masked.masked_mean` or :func:`gcore_rl.algos.policy_loss.aggregate`).
        Gradients flow into both inputs; detach ``ref_logprobs`` yourself if it requires grad.

    Raises:
        ValueError: for an unknown estimator name or mismatched shapes.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have the same shape, got {tuple(logprobs.shape)} "
            f"and {tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        r = log_ratio.clamp(-_K3_LOG_RATIO_LIMIT, _K3_LOG_RATIO_LIMIT)
        return torch.exp(-r) - 1.0 + r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {get_args(KLEstimator)}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` along the last dimension.

    Computed as ``logsumexp(l) - sum(softmax(l) * l)``, which never forms ``log(0)``. Entries equal to
    ``-inf`` (masked-out vocabulary) are allowed: they contribute zero probability, and neither the value
    nor the gradient becomes NaN.

    Args:
        logits: ``[..., V]`` unnormalised log-probabilities, e.g. ``[B, T, V]``.

    Returns:
        ``[...]`` entropy in nats (e.g. ``[B, T]``), same dtype as ``logits``.
    """
    # Replace -inf by the most negative finite value: its probability is still exactly 0 and the
    # product p * l is 0 instead of 0 * -inf = NaN.
    logits = logits.clamp(min=torch.finfo(logits.dtype).min)
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - log_z)
    return log_z.squeeze(-1) - (probs * logits).sum(dim=-1)

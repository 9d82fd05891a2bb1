"""A trust region on the actor's optimiser steps: an update that takes the policy too far from the policy
that sampled the batch is shrunk back toward the weights before it, halving the step until it fits.

PPO's clip bounds what each token's ratio contributes to the gradient, not how far an AdamW step moves
the policy: an early or unlucky step can still land at ~1 nat/token from the sampling policy (issue 51).
`train.max_kl` bounds that directly, as TRPO's line search does: after each optimiser step the policy's
approx_kl (the k2 estimate the update reports) to the policy before the update (the sampling policy for
fresh rows; for a stale row the trainer's policy at the update's start, not its older sampler) is measured,
without gradients, on each of the update's mini-batches, and while the largest exceeds the bound the
parameters move halfway back to where the step started, at most `MAX_HALVINGS` times, after which the step
is undone. The optimiser's moments keep the step's gradient; only the parameters move back.

Every mini-batch, not the step's own: a step can move the policy further on rows it did not train on
(measured: a step within 0.1 on its own mini-batch reached 0.35 on the other). The largest, not the batch's
mean: the update reports `approx_kl` as the mean over its steps of each mini-batch's KL measured before its
step, which a bound on every mini-batch bounds too (a mean over the batch let one step report 0.102 under a
bound of 0.1). The KL is to the policy before the update, so it is cumulative over the update's steps, and
each probe bounds where the policy stands, not just what the step added.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gcore_rl.training.optim_step import all_reduce_sums

MAX_HALVINGS = 4
"""Halvings tried before a step is undone (the last kept step is 1/16 of the full one)."""


def group_approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, device: torch.device,
                    parts: list[slice] | None = None) -> float:
    """Token mean over the trainer group of `0.5 * (logprobs - old_logprobs)**2` (Schulman's k2, the update's
    `approx_kl`) on the tokens where `mask` `[B, T]` is set; with `parts` (row slices: the update's mini-batches),
    the largest of the parts' means. A collective (one all-reduce). 0 without tokens."""
    valid = mask.bool()
    diff = torch.where(valid, logprobs.float() - old_logprobs.float(), torch.zeros((), dtype=torch.float32))
    per_row, tokens = (0.5 * diff.square()).sum(-1), valid.sum(-1)
    parts = parts or [slice(0, mask.shape[0])]
    sums = all_reduce_sums([float(x[part].sum()) for part in parts for x in (per_row, tokens)], device)
    return max((total / count if count > 0 else 0.0) for total, count in zip(sums[::2], sums[1::2], strict=True))


@dataclass(frozen=True)
class Backtrack:
    """What the trust region did to one optimiser step: the probe's KL after the full step (`full_kl`), the
    halvings it took (`halvings`) and whether the step was undone (`undone`)."""

    full_kl: float
    halvings: int
    undone: bool

    def as_metrics(self) -> dict[str, float]:
        """Per-step metrics: averaged over an update's optimiser steps, `kl_probe_max` kept as the maximum."""
        return {"kl_backtracks": float(self.halvings), "kl_undone": float(self.undone), "kl_probe_max": self.full_kl}


def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the parameters (each rank's own shards under FSDP) before an optimiser step."""
    return [p.detach().clone() for p in params]


@torch.no_grad()
def backtrack(params: list[torch.Tensor], before: list[torch.Tensor], measure: Callable[[], float],
              max_kl: float, max_halvings: int = MAX_HALVINGS) -> Backtrack:
    """Shrink the step from `before` to `params` (in place) until `measure()` (the current parameters' KL to the policy
    before the update; a collective, so every rank takes the same decisions) is at most `max_kl`: each try
    moves the parameters halfway back to `before`; after `max_halvings` tries past the bound they become `before`."""
    kl = full_kl = measure()
    halvings = 0
    while kl > max_kl and halvings < max_halvings:
        for p, b in zip(params, before, strict=True):
            p.lerp_(b, 0.5)
        halvings += 1
        kl = measure()
    if kl <= max_kl:
        return Backtrack(full_kl, halvings, undone=False)
    for p, b in zip(params, before, strict=True):
        p.copy_(b)
    return Backtrack(full_kl, halvings, undone=True)

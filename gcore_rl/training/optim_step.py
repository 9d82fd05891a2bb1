"""What every trained model here (the actor, the critic) does the same way: AdamW with a linear
warm-up (and, with a KL target, a rate that follows the update's KL), optimiser steps that accumulate
gradients over micro-batches so that the step's gradient is that of the whole global mini-batch, and
the epochs x mini-batches loop of a PPO update.

Every function that reduces over the trainer group is a collective: every trainer rank calls it,
with the same number of rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gcore_rl.records import TokenBatch
from gcore_rl.training.micro_batches import MicroBatching
from gcore_rl.training.shapes import mini_batch_slices

LossFn = Callable[[TokenBatch], tuple[torch.Tensor, dict[str, float]]]
"""``loss_fn(micro_batch) -> (loss, stats)``: the loss of a micro-batch normalised by its own units."""


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Sum a number over the trainer group (identity without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def all_reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sum several numbers over the trainer group in one collective (identity without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter; a collective when sharded."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class OptimiserSettings:
    """AdamW and its schedule: peak `lr`, `betas`, `weight_decay`, `warmup_steps` of linear warm-up
    from 0, global-norm clip `grad_clip` (0 = off)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    grad_clip: float


KL_RATE_STEP = 1.5
"""How much a KL-adapted rate moves per RL step (down past twice the target, up below half of it)."""

MIN_KL_SCALE = 0.01
"""The KL-adapted rate never falls below this fraction of the peak rate."""


LrSchedule = Literal["constant", "linear", "cosine"]
"""The rate after the warm-up (`rate_factor`), as `gcore-rl sft` and `gcore-rl rm` take it (`lr_schedule`)."""
LR_SCHEDULE_HELP = "The rate after the warm-up: constant, or down towards 0 at `steps` in a line or a half cosine."


def rate_factor(step: int, warmup: int, total: int = 0, schedule: str = "constant") -> float:
    """What the peak rate is multiplied by at optimiser step `step` (0-based) of `total`: ``(step + 1) / warmup``
    during the warm-up, then 1 (``constant``), or falling from 1 after the warm-up towards 0 at `total` along a
    line (``linear``) or a half cosine (``cosine``); the last step keeps a small positive rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class RateFactor:
    """What LambdaLR multiplies the peak rate by at optimiser step `step`: the linear warm-up over `warmup`
    steps, times `kl_scale` (1 unless `adapt_rate_to_kl` moved it). An object, not a lambda, so that
    LambdaLR's `state_dict` carries `kl_scale` into checkpoints and a resumed run continues at the same rate."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.kl_scale = 1.0

    def __call__(self, step: int) -> float:
        return rate_factor(step, self.warmup) * self.kl_scale


def kl_rate_scale(scale: float, kl: float, target: float) -> float:
    """The next RL step's rate scale after a step whose update reached `kl` (nat/token) to the policy that
    sampled its batch: divided by `KL_RATE_STEP` past 2 × `target`, multiplied by it below `target` / 2 (never
    above 1, the configured rate, nor below `MIN_KL_SCALE`), else kept. The adaptive PPO schedule of
    rl_games and RSL-RL (a "desired KL"), with the configured rate as its ceiling."""
    if kl > 2.0 * target:
        return max(scale / KL_RATE_STEP, MIN_KL_SCALE)
    if kl < 0.5 * target:
        return min(scale * KL_RATE_STEP, 1.0)
    return scale


def build_optimizer(model: nn.Module, settings: OptimiserSettings) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `model`'s parameters that train (a LoRA policy's adapters) and its LambdaLR schedule (`RateFactor`)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=tuple(settings.betas),
                                  weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, RateFactor(settings.warmup_steps))
    return optimizer, scheduler


def adapt_rate_to_kl(scheduler: torch.optim.lr_scheduler.LambdaLR, kl: float, target: float) -> float:
    """Move the rate's KL scale after an RL step whose update reached `kl` (`kl_rate_scale`) and apply it to
    the next optimiser step at once; returns the new scale. Every trainer rank must pass the same `kl`."""
    factor = scheduler.lr_lambdas[0]
    factor.kl_scale = kl_rate_scale(factor.kl_scale, kl, target)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    return factor.kl_scale


def clip_and_norm(model: nn.Module, grad_clip: float) -> float:
    """Clip the global gradient norm to `grad_clip` (0 = no clip); returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    return float(full_tensor(norm))


def accumulate_gradients(mini: TokenBatch, batching: MicroBatching, loss_units: Callable[[TokenBatch], float],
                         loss_fn: LossFn, loss_stats: frozenset[str], device: torch.device) -> dict[str, float]:
    """Backward passes over the micro-batches of a mini-batch (`batching.passes`), weighted so that the
    accumulated gradient is exactly that of the loss over the whole *global* mini-batch (all trainer ranks).

    Each micro-batch's loss (normalised by its own `loss_units`, e.g. valid tokens) is weighted by
    its share of the units over ALL trainer ranks, times the world size because FSDP averages
    gradients over ranks; so the result does not depend on how rows are split into micro-batches or
    ranks. A dummy pass (a rank with fewer rows than another rank has passes) runs the first row with
    weight 0, so FSDP's collectives stay paired. Returns the step's statistics: `loss_stats` keys
    weighted like the loss and summed over ranks, `*_max` keys as maxima, the others as token-weighted
    means of this rank's micro-batches.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    global_units = max(all_reduce_sum(loss_units(mini), device), 1.0)
    local_tokens = max(float(mini.response_mask.sum()), 1.0)
    sums: dict[str, float] = {}
    for rows, part, _ in batching.parts(mini, device):
        loss_weight = 0.0 if rows is None else loss_units(part) * world / global_units
        token_weight = float(part.response_mask.sum()) / local_tokens
        loss, stats = loss_fn(part)
        (loss * loss_weight).backward()
        if rows is None:
            continue
        for key, value in stats.items():
            if key.endswith("_max"):  # a maximum stays one
                sums[key] = max(sums.get(key, value), value)
                continue
            weight = loss_weight / world if key in loss_stats else token_weight
            sums[key] = sums.get(key, 0.0) + value * weight
    # each rank holds its share of the global loss; sorted, because a set's order differs between
    # processes (string hashing) and every rank must all-reduce the same key in the same call
    for key in sorted(loss_stats & sums.keys()):
        sums[key] = all_reduce_sum(sums[key], device)
    return sums


def optimizer_step(mini: TokenBatch, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float, batching: MicroBatching,
                   loss_units: Callable[[TokenBatch], float], loss_fn: LossFn, loss_stats: frozenset[str],
                   device: torch.device) -> dict[str, float]:
    """One optimiser step over a mini-batch (`accumulate_gradients`, clip, AdamW, schedule); its
    statistics plus `grad_norm` (before clipping) and `lr` (the rate the step used)."""
    optimizer.zero_grad(set_to_none=True)
    lr = optimizer.param_groups[0]["lr"]
    sums = accumulate_gradients(mini, batching, loss_units, loss_fn, loss_stats, device)
    sums["grad_norm"] = clip_and_norm(model, grad_clip)
    optimizer.step()
    scheduler.step()
    sums["lr"] = lr
    return sums


def epochs_of_mini_batches(batch: TokenBatch, mini_batches: int, epochs: int,
                           step: Callable[[TokenBatch], dict[str, float]]) -> dict[str, float]:
    """Call `step` on each of `mini_batches` contiguous mini-batches, `epochs` times over; the mean of
    its statistics over the calls (maxima for `*_max` keys)."""
    totals: dict[str, float] = {}
    steps = 0
    for _ in range(epochs):
        for rows in mini_batch_slices(batch.size, mini_batches):
            for key, value in step(batch.select(rows)).items():
                totals[key] = max(totals.get(key, value), value) if key.endswith("_max") else totals.get(key, 0.0) + value
            steps += 1
    return {key: value if key.endswith("_max") else value / steps for key, value in totals.items()}

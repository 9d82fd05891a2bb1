"""The actor role: log-prob passes and the clipped policy-gradient update under FSDP2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gcore_rl.algos import aggregate, kl_divergence, masked_mean
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.mismatch import mismatch_weights, ratio_reference
from gcore_rl.algos.policy_loss import logprob_gap_max
from gcore_rl.algos.registry import compute_policy_loss
from gcore_rl.errors import ConfigError
from gcore_rl.records import TokenBatch
from gcore_rl.training.logprobs import first_response_column, token_logprobs
from gcore_rl.training.shapes import mini_batch_slices


@dataclass
class TrainConfig:
    """Optimiser and batching of the actor update."""

    lr: float = field(default=1e-4, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "AdamW (beta1, beta2)."})
    warmup_steps: int = field(default=0, metadata={"help": "Optimiser steps of linear learning-rate warm-up from 0."})
    grad_clip: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value (0 = off)."})
    micro_batch_size: int = field(default=64, metadata={"help": "Rows per forward/backward pass; gradients accumulate over micro-batches."})
    mini_batches: int = field(default=1, metadata={"help": "Optimiser steps per RL step (the step's batch is split into this many mini-batches)."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over the step's batch."})
    bf16: bool = field(default=True, metadata={"help": "On CUDA, run forward/backward under bf16 autocast (ignored on CPU)."})

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"expected two numbers in [0, 1), got {self.betas}")
        for key in ("micro_batch_size", "mini_batches", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("warmup_steps" if self.warmup_steps < 0 else "grad_clip", "must be >= 0")


#: statistics that are loss values (weighted like the loss); the others are token means
LOSS_STATS = frozenset({"pg_loss", "kl"})


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Sum a number over the trainer group (identity without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter; a collective when sharded."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class Actor:
    """Holds the trained policy (FSDP-wrapped), its optimiser and LR schedule."""

    def __init__(self, model: nn.Module, train: TrainConfig, algo: AlgoConfig, temperature: float, device: torch.device):
        self.model = model
        self.train_cfg = train
        self.algo = algo
        self.temperature = temperature
        self.device = device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                           weight_decay=train.weight_decay)
        warmup = train.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda" and self.train_cfg.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's tokens under the current weights (no grad)."""
        return compute_logprobs(self.model, batch, self.temperature, self.train_cfg.micro_batch_size, self.device, self._autocast)

    @property
    def single_pass(self) -> bool:
        """One optimiser step per batch (one epoch, one mini-batch): every micro-batch's forward sees
        the weights that existed before the update, so the separate old-log-prob pass can be skipped
        (`update` takes the detached log-probs of its own forward as the old ones)."""
        return self.train_cfg.ppo_epochs == 1 and self.train_cfg.mini_batches == 1

    def update(self, batch: TokenBatch) -> dict[str, float]:
        """Run `ppo_epochs` × `mini_batches` optimiser steps on the batch; returns mean metrics.

        `batch.old_logprobs` may be None only for a `single_pass` update: the old log-probs of fresh
        rows are then the detached log-probs of the training forward itself (the ratio is 1, its
        gradient that of the policy gradient), those of stale rows the engine's unless a mismatch
        correction is on (`ratio_reference`). Maxima among the metrics (`*_max`) stay maxima.
        `self.logprob_gap_max` then holds the largest |engine − trainer| log-prob gap on fresh rows.
        """
        assert batch.advantages is not None
        if batch.old_logprobs is None and not self.single_pass:
            raise ValueError("old_logprobs are needed when the update takes more than one optimiser step")
        self.logprob_gap_max = 0.0
        self.model.train()
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(self.train_cfg.ppo_epochs):
            for rows in mini_batch_slices(batch.size, self.train_cfg.mini_batches):
                stats = self._optimizer_step(batch.select(rows))
                for key, value in stats.items():
                    totals[key] = max(totals.get(key, value), value) if key.endswith("_max") else totals.get(key, 0.0) + value
                steps += 1
        return {key: value if key.endswith("_max") else value / steps for key, value in totals.items()}

    def _optimizer_step(self, mini: TokenBatch) -> dict[str, float]:
        """One optimiser step over a mini-batch, accumulating gradients over micro-batches.

        Each micro-batch loss is weighted by its share of the loss denominator over ALL trainer
        ranks (valid tokens for token_mean, rows with a response otherwise), times the world size
        because FSDP averages gradients over ranks. The accumulated gradient is then exactly that
        of the whole, global mini-batch, however rows are split into micro-batches or ranks.
        Token-level statistics are weighted by token share, loss terms by loss weight.
        """
        self.optimizer.zero_grad(set_to_none=True)
        world = dist.get_world_size() if dist.is_initialized() else 1
        global_count = max(all_reduce_sum(self._loss_units(mini), self.device), 1.0)
        local_tokens = max(float(mini.response_mask.sum()), 1.0)
        sums: dict[str, float] = {}
        micro = self.train_cfg.micro_batch_size
        lr = self.optimizer.param_groups[0]["lr"]
        for start in range(0, mini.size, micro):
            part = mini.select(slice(start, start + micro))
            loss_weight = self._loss_units(part) * world / global_count
            token_weight = float(part.response_mask.sum()) / local_tokens
            loss, stats = self._loss(part)
            (loss * loss_weight).backward()
            for key, value in stats.items():
                if key.endswith("_max"):  # a maximum stays one
                    sums[key] = max(sums.get(key, value), value)
                    continue
                weight = loss_weight / world if key in LOSS_STATS else token_weight
                sums[key] = sums.get(key, 0.0) + value * weight
        # each rank holds its share of the global loss; sorted, because a set's order differs between
        # processes (string hashing) and every rank must all-reduce the same key in the same call
        for key in sorted(LOSS_STATS & sums.keys()):
            sums[key] = all_reduce_sum(sums[key], self.device)
        grad_norm = self._clip_and_norm()
        self.optimizer.step()
        self.scheduler.step()
        sums["grad_norm"] = grad_norm
        sums["lr"] = lr
        return sums

    def _loss_units(self, part: TokenBatch) -> float:
        """What the loss averages over: valid tokens (token_mean) or rows with a response."""
        if self.algo.loss_aggregation == "token_mean":
            return float(part.response_mask.sum())
        return float(part.response_mask.bool().any(dim=-1).sum())

    def _loss(self, part: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        ids, attn = part.input_ids.to(self.device), part.attention_mask.to(self.device)
        mask = part.response_mask.to(self.device)
        with self._autocast():
            logprobs, entropy = token_logprobs(self.model, ids, attn, self.temperature, with_entropy=True,
                                               entropy_grad=self.algo.entropy_coef > 0,
                                               first_scored=first_response_column(part.response_mask))
        old = part.old_logprobs
        if old is None:  # single pass: this forward runs on the pre-update weights
            current = logprobs.detach()
            old = ratio_reference(current, part.rollout_logprobs.to(self.device), part.staleness, self.algo.mismatch_correction)
            gap = logprob_gap_max(part.rollout_logprobs, current, mask, part.staleness)
            self.logprob_gap_max = max(self.logprob_gap_max, gap)
        # TIS/MIS weights (None without a correction) of the engine's samples; `old` is then the trainer's
        weights, mismatch = mismatch_weights(old.to(self.device), part.rollout_logprobs.to(self.device), mask,
                                             self.algo.mismatch_correction, self.algo.mismatch_level, self.algo.mismatch_cap)
        pg_loss, pg = compute_policy_loss(self.algo, logprobs, old.to(self.device), part.advantages.to(self.device),
                                          mask, token_weights=weights)
        loss = pg_loss
        stats = {"pg_loss": float(pg_loss.detach()), "clip_fraction": pg.clip_fraction, "approx_kl": pg.approx_kl,
                 "entropy": float(masked_mean(entropy.detach(), mask)), **pg.extra_metrics(), **mismatch.as_metrics()}
        norm_length = self.algo.aggregation_norm_length
        if self.algo.uses_reference:
            kl = aggregate(kl_divergence(logprobs, part.ref_logprobs.to(self.device), self.algo.kl_estimator), mask,
                           self.algo.loss_aggregation, norm_length)
            loss = loss + self.algo.kl_coef * kl
            stats["kl"] = float(kl.detach())
        if self.algo.entropy_coef > 0:
            loss = loss - self.algo.entropy_coef * aggregate(entropy, mask, self.algo.loss_aggregation, norm_length)
        return loss, stats

    def _clip_and_norm(self) -> float:
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(full_tensor(norm))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, full tensor) one parameter at a time, for the in-memory weight sync.

        Every rank must consume the iterator in full: gathering a sharded parameter is a collective.
        """
        for name, param in self.model.named_parameters():
            yield name, full_tensor(param.detach())


def compute_logprobs(model: nn.Module, batch: TokenBatch, temperature: float, micro_batch_size: int,
                     device: torch.device, autocast=contextlib.nullcontext) -> torch.Tensor:
    """Log-probs `[B, T]` (CPU, fp32) of a batch under `model`, in micro-batches, without grad."""
    was_training = model.training
    model.eval()
    parts = []
    with torch.no_grad():
        for start in range(0, batch.size, micro_batch_size):
            part = batch.select(slice(start, start + micro_batch_size))
            with autocast():
                logprobs, _ = token_logprobs(model, part.input_ids.to(device), part.attention_mask.to(device), temperature,
                                             first_scored=first_response_column(part.response_mask))
            parts.append(logprobs.float().cpu())
    model.train(was_training)
    return torch.cat(parts, dim=0)

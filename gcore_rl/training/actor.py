"""The actor role: log-prob passes and the clipped policy-gradient update under FSDP2."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from gcore_rl.algos import aggregate, kl_divergence, masked_mean
from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.mismatch import mismatch_weights, ratio_reference
from gcore_rl.algos.policy_loss import logprob_gap_max
from gcore_rl.algos.registry import compute_policy_loss
from gcore_rl.distributed import all_reduce_mean
from gcore_rl.errors import ConfigError
from gcore_rl.models.lora import is_lora, merged_weights
from gcore_rl.records import TokenBatch
from gcore_rl.training.fsdp import reshard
from gcore_rl.training.logprobs import first_response_column, token_logprobs
from gcore_rl.training.micro_batches import MicroBatching
from gcore_rl.training.offload import OffloadLevel
from gcore_rl.training.optim_step import (
    OptimiserSettings,
    adapt_rate_to_kl,
    all_reduce_sum,
    build_optimizer,
    epochs_of_mini_batches,
    full_tensor,
    optimizer_step,
)
from gcore_rl.training.packing import packed_token_logprobs
from gcore_rl.training.sequence_parallel import sequence_parallel_group, sp_token_logprobs
from gcore_rl.training.shapes import mini_batch_slices
from gcore_rl.training.trust_region import backtrack, group_approx_kl, snapshot


@dataclass
class TrainConfig:
    """Optimiser and batching of the actor update."""

    lr: float = field(default=1e-4, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "AdamW (beta1, beta2)."})
    warmup_steps: int = field(default=0, metadata={"help": "Optimiser steps of linear learning-rate warm-up from 0."})
    grad_clip: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value (0 = off)."})
    target_kl: float = field(default=0.0, metadata={
        "help": "Adapt the learning rate to the update's KL to the sampling policy (approx_kl, nat/token; 0 = off): "
                "after an RL step past twice this the rate is divided by 1.5, below half of it multiplied by 1.5, "
                "never above train.lr. Needs more than one optimiser step per RL step (mini_batches or ppo_epochs)."})
    max_kl: float = field(default=0.0, metadata={
        "help": "A trust region on every optimiser step (nat/token; 0 = off): after the step, its approx_kl to the "
                "policy before the update is measured on each mini-batch (a forward over the batch); past this "
                "bound on any, the step is halved back, up to 4 times, then undone. docs/architecture.md."})
    micro_batch_size: int = field(default=64, metadata={"help": "Rows per forward/backward pass; gradients accumulate over micro-batches."})
    max_tokens_per_micro_batch: int = field(default=0, metadata={
        "help": "Token budget of a forward/backward pass (0 = off): passes are filled by token count (first-fit "
                "decreasing), with at most micro_batch_size rows; tokens are the rows' real lengths when packed, "
                "rows x the longest row when padded."})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "Recompute each transformer block's activations in the backward instead of keeping them (the actor "
                "and the critic): activation memory of one block instead of all, for about one more forward."})
    packing: bool = field(default=False, metadata={
        "help": "Run the actor's and the reference's passes packed: a micro-batch's rows concatenated without "
                "padding, attention kept within each row (varlen on flash attention, a block-diagonal mask "
                "otherwise). Same log-probs and gradients as padded, without the padding's compute."})
    sequence_parallel: int = field(default=1, metadata={
        "help": "Ulysses sequence parallelism: groups of this many trainer devices of a slice share each pass, "
                "each holding 1/N of its packed tokens (activations ~1/N per device; attention's heads split "
                "by all-to-all). Must divide the policy's attention and key/value heads and each slice's "
                "trainer devices; passes are packed. Text policies without a critic (1 = off)."})
    mini_batches: int = field(default=1, metadata={"help": "Optimiser steps per RL step (the step's batch is split into this many mini-batches)."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over the step's batch."})
    offload: OffloadLevel = field(default="none", metadata={
        "help": "Where a trainer's device also generates or scores (colocate, partial, interleave, dynamic): move "
                "its AdamW state ('optimizer') or also its parameters ('all') to host memory while the other roles "
                "use the device, and back for the update (pinned copies on CUDA; a CPU device frees nothing)."})
    bf16: bool = field(default=True, metadata={"help": "On CUDA, run forward/backward under bf16 autocast with bf16 parameter gathers and fp32 gradient reductions (FSDP2's MixedPrecisionPolicy); master weights stay in model.dtype. On a CPU device only with bf16_cpu."})
    bf16_cpu: bool = field(default=False, metadata={"help": "Apply train.bf16 on a CPU device too (a CPU with native bf16, AVX512-BF16 or AMX, runs it fast; others emulate it)."})
    added_seconds_per_update: float = field(default=0.0, metadata={"help": "Testing and demonstration: every trainer also waits this long in each update (counted as training time), to emulate an update slower than generation, as judge.added_seconds_per_sample makes a slower judge."})

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"expected two numbers in [0, 1), got {self.betas}")
        for key in ("micro_batch_size", "mini_batches", "ppo_epochs", "sequence_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("warmup_steps" if self.warmup_steps < 0 else "grad_clip", "must be >= 0")
        if not (math.isfinite(self.added_seconds_per_update) and self.added_seconds_per_update >= 0):
            raise ConfigError("added_seconds_per_update", f"must be a finite number >= 0, got {self.added_seconds_per_update}")
        if not (math.isfinite(self.target_kl) and self.target_kl >= 0):
            raise ConfigError("target_kl", f"must be a finite number >= 0 (0 = a fixed rate), got {self.target_kl}")
        if self.target_kl > 0 and self.mini_batches == 1 and self.ppo_epochs == 1:
            raise ConfigError("target_kl", "needs more than one optimiser step per RL step (train.mini_batches > 1 "
                              "or train.ppo_epochs > 1): with one, the update's KL to the sampling policy is measured "
                              "before the update and is always 0")
        if not (math.isfinite(self.max_kl) and self.max_kl >= 0):
            raise ConfigError("max_kl", f"must be a finite number >= 0 (0 = no trust region), got {self.max_kl}")
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError("max_tokens_per_micro_batch", f"must be >= 0 (0 = no token budget), got "
                              f"{self.max_tokens_per_micro_batch}")

    def bf16_on(self, device: torch.device) -> bool:
        """Whether the trainer on `device` runs in bf16 mixed precision (`bf16`, and `bf16_cpu` off CUDA)."""
        return self.bf16 and (torch.device(device).type == "cuda" or self.bf16_cpu)

    @property
    def batching(self) -> MicroBatching:
        """The passes of the actor's (and the reference's) forward and backward computations."""
        return MicroBatching(self.micro_batch_size, self.max_tokens_per_micro_batch,
                             self.packing or self.sequence_parallel > 1)


#: statistics that are loss values (weighted like the loss); the others are token means
LOSS_STATS = frozenset({"pg_loss", "kl"})

__all__ = ["LOSS_STATS", "Actor", "TrainConfig", "all_reduce_sum", "compute_logprobs", "full_tensor"]


class Actor:
    """Holds the trained policy (FSDP-wrapped), its optimiser and LR schedule."""

    def __init__(self, model: nn.Module, train: TrainConfig, algo: AlgoConfig, temperature: float, device: torch.device):
        self.model = model
        self.train_cfg = train
        self.algo = algo
        self.temperature = temperature
        self.device = device
        self.optimizer, self.scheduler = build_optimizer(model, OptimiserSettings(
            lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, warmup_steps=train.warmup_steps,
            grad_clip=train.grad_clip))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.train_cfg.bf16_on(self.device):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's tokens under the current weights (no grad)."""
        return compute_logprobs(self.model, batch, self.temperature, self.train_cfg.batching, self.device, self._autocast)

    @property
    def single_pass(self) -> bool:
        """One optimiser step per batch (one epoch, one mini-batch): every micro-batch's forward sees
        the weights that existed before the update, so the separate old-log-prob pass can be skipped
        (`update` takes the detached log-probs of its own forward as the old ones). Not with a trust region
        (`train.max_kl`), which measures the step against the old log-probs."""
        return self.train_cfg.ppo_epochs == 1 and self.train_cfg.mini_batches == 1 and self.train_cfg.max_kl == 0

    def update(self, batch: TokenBatch, start_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Run `ppo_epochs` × `mini_batches` optimiser steps on the batch; returns mean metrics.

        `batch.old_logprobs` may be None only for a `single_pass` update: the old log-probs of fresh
        rows are then the detached log-probs of the training forward itself (the ratio is 1, its
        gradient that of the policy gradient), those of stale rows the engine's unless a mismatch
        correction is on (`ratio_reference`). Maxima among the metrics (`*_max`) stay maxima.
        `self.logprob_gap_max` then holds the largest |engine − trainer| log-prob gap on fresh rows.
        `start_logprobs` `[B, T]`: the batch's log-probs under the weights before the update, from which the trust
        region (`train.max_kl`) measures its steps (default `batch.old_logprobs`, the same on fresh rows; a stale
        row's old log-probs may be its sampler's, whose distance is not the update's).
        """
        assert batch.advantages is not None
        if batch.old_logprobs is None and not self.single_pass:
            raise ValueError("old_logprobs are needed when the update takes more than one optimiser step")
        self.logprob_gap_max = 0.0
        self.model.train()
        if self.train_cfg.max_kl > 0:
            start = start_logprobs if start_logprobs is not None else batch.old_logprobs

            def step(mini: TokenBatch) -> dict[str, float]:
                return self._bounded_step(mini, batch, start)
        else:
            step = self._optimizer_step
        stats = epochs_of_mini_batches(batch, self.train_cfg.mini_batches, self.train_cfg.ppo_epochs, step)
        if self.train_cfg.target_kl > 0:  # every rank adapts its rate to the same KL: the mean over the group
            kl = all_reduce_mean({"approx_kl": stats["approx_kl"]}, self.device)["approx_kl"]
            stats["lr_kl_scale"] = adapt_rate_to_kl(self.scheduler, kl, self.train_cfg.target_kl)
        return stats

    def _optimizer_step(self, mini: TokenBatch) -> dict[str, float]:
        """One optimiser step over a mini-batch (`optimizer_step`): the loss is normalised by valid tokens
        (token_mean) or rows with a response over all trainer ranks; loss terms are weighted by loss
        weight, token-level statistics by token share."""
        return optimizer_step(mini, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                              grad_clip=self.train_cfg.grad_clip, batching=self.train_cfg.batching,
                              loss_units=self._loss_units, loss_fn=self._loss, loss_stats=LOSS_STATS, device=self.device)

    def _bounded_step(self, mini: TokenBatch, batch: TokenBatch, start: torch.Tensor) -> dict[str, float]:
        """An optimiser step on `mini` inside the trust region `train.max_kl` (`trust_region.backtrack`): the largest
        KL over the update's mini-batches of `batch` from its log-probs before the update, `start` `[B, T]`."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        parts = mini_batch_slices(batch.size, self.train_cfg.mini_batches)
        before = snapshot(params)
        stats = self._optimizer_step(mini)

        def measure() -> float:  # of the parameters as they are now (`reshard`: not as last gathered)
            reshard(self.model)
            return group_approx_kl(self.compute_logprobs(batch), start, batch.response_mask, self.device, parts)

        result = backtrack(params, before, measure, self.train_cfg.max_kl)
        reshard(self.model)  # an undone step leaves the root gathered at the last weights measured
        return stats | result.as_metrics()

    def _loss_units(self, part: TokenBatch) -> float:
        """What the loss averages over: valid tokens (token_mean) or rows with a response."""
        if self.algo.loss_aggregation == "token_mean":
            return float(part.response_mask.sum())
        return float(part.response_mask.bool().any(dim=-1).sum())

    def _loss(self, part: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        ids, attn = part.input_ids.to(self.device), part.attention_mask.to(self.device)
        mask = part.response_mask.to(self.device)
        with self._autocast():
            logprobs, entropy = forward_logprobs(self.model, self.train_cfg.packing)(
                self.model, ids, attn, self.temperature, with_entropy=True, entropy_grad=self.algo.entropy_coef > 0,
                first_scored=first_response_column(part.response_mask), images=part.images)
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
        if self.algo.kl_in_loss:
            kl = aggregate(kl_divergence(logprobs, part.ref_logprobs.to(self.device), self.algo.kl_estimator), mask,
                           self.algo.loss_aggregation, norm_length)
            loss = loss + self.algo.kl_coef * kl
            stats["kl"] = float(kl.detach())
        if self.algo.entropy_coef > 0:
            loss = loss - self.algo.entropy_coef * aggregate(entropy, mask, self.algo.loss_aggregation, norm_length)
        return loss, stats

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, full tensor) one parameter at a time, for the in-memory weight sync.

        Every rank must consume the iterator in full: gathering a sharded parameter is a collective.
        """
        if is_lora(self.model):  # the engines hold a plain model: the adapters merged in, the base's names
            yield from merged_weights(self.model, full_tensor)
            return
        for name, param in self.model.named_parameters():
            yield name, full_tensor(param.detach())


def forward_logprobs(model: nn.Module, packed: bool):
    """`token_logprobs`, its packed equivalent `packed_token_logprobs`, or, for a model whose attention is
    Ulysses (`train.sequence_parallel`), `sp_token_logprobs` (same arguments and results)."""
    if sequence_parallel_group(model) is not None:
        return sp_token_logprobs
    return packed_token_logprobs if packed else token_logprobs


def compute_logprobs(model: nn.Module, batch: TokenBatch, temperature: float, batching: MicroBatching | int,
                     device: torch.device, autocast=contextlib.nullcontext) -> torch.Tensor:
    """Log-probs `[B, T]` (CPU, fp32, 0 on padding) of a batch under `model`, in the passes of `batching`
    (an int: that many rows per pass), without grad."""
    batching = MicroBatching(batching) if isinstance(batching, int) else batching

    def forward(part: TokenBatch) -> torch.Tensor:
        with autocast():
            logprobs, _ = forward_logprobs(model, batching.packed)(
                model, part.input_ids.to(device), part.attention_mask.to(device), temperature,
                first_scored=first_response_column(part.response_mask), images=part.images)
        # 0 on padding (whatever a pass computes there depends on which rows share it)
        return logprobs.float().cpu() * part.attention_mask

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = batching.gather(batch, device, forward)
    model.train(was_training)
    return out

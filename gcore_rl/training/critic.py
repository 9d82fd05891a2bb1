"""The critic role of PPO: a value model (`gcore_rl.models.value`) trained next to the actor.

The critic shares the actor's devices and trainer group (the plan puts the `critic` role wherever it
puts `actor`), but it is a model of its own: its own FSDP2 wrapping, AdamW and learning-rate
schedule. Per RL step the trainer calls `values` in the preparation pass (no grad; the values GAE
and the value clip start from) and `update` after the advantages are known: the clipped value loss
(`gcore_rl.algos.value_loss.clipped_value_loss`) over the same epochs x mini-batches as the actor,
each mini-batch's gradient that of the whole global mini-batch (`optimizer_step`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from gcore_rl.algos.value_loss import clipped_value_loss
from gcore_rl.errors import ConfigError
from gcore_rl.models.lora import CRITIC_HEAD, LoraSettings, apply_lora
from gcore_rl.models.value import load_value_model, token_values
from gcore_rl.records import TokenBatch
from gcore_rl.training.logprobs import first_response_column
from gcore_rl.training.micro_batches import MicroBatching
from gcore_rl.training.optim_step import (
    OptimiserSettings,
    all_reduce_sums,
    build_optimizer,
    epochs_of_mini_batches,
    optimizer_step,
)

VALUE_LOSS_STATS = frozenset({"value_loss"})

# FSDP2 warns that a token-classification model's output is a view (in-place ops on it would skip a
# hook); the critic only reads it (`token_values` slices and pads out of place)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w*ForTokenClassification\) returned a view")


@dataclass
class CriticConfig:
    """The value model of PPO (used when algo.advantage=gae; ignored otherwise)."""

    model_path: str | None = field(default=None, metadata={"help": "Folder to start the critic from: a causal LM (body reused, a zero-initialised value head: every value starts at 0), a scalar reward model from `gcore-rl rm` (body and head reused), or a saved critic. null = model.path (the policy's start)."})
    lr: float = field(default=1e-4, metadata={"help": "Peak AdamW learning rate of the critic."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of the critic."})
    warmup_steps: int = field(default=0, metadata={"help": "Critic optimiser steps of linear learning-rate warm-up from 0."})
    grad_clip: float = field(default=1.0, metadata={"help": "Clip the critic's global gradient norm to this value (0 = off)."})
    value_clip: float | None = field(default=0.2, metadata={"help": "PPO value clipping: one update moves a value at most this far from the value at preparation time (in reward units); null = unclipped squared error."})
    actor_freeze_steps: int = field(default=0, metadata={"help": "Critic warm-up: for the first N RL steps only the critic trains and the actor's weights stay as they are (verl's critic_warmup)."})
    lora: LoraSettings = field(default_factory=LoraSettings, metadata={"help": "Train the critic as LoRA adapters on its frozen body, its value head whole (`sync` does not apply: nothing is synced from a critic)."})

    def validate(self) -> None:
        for key in ("lr", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(key, f"must be a finite number, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be a finite number > 0, got {self.lr}")
        if self.value_clip is not None and not (math.isfinite(self.value_clip) and self.value_clip > 0):
            raise ConfigError("value_clip", f"must be a number > 0, or null for no clip, got {self.value_clip}")
        for key in ("warmup_steps", "actor_freeze_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("weight_decay" if self.weight_decay < 0 else "grad_clip", "must be >= 0")


def load_critic_model(cfg: CriticConfig, model_path: str | Path, dtype: str, attn_implementation: str,
                      device: torch.device) -> nn.Module:
    """The critic's value model from `cfg.model_path` (default `model_path`; `load_value_model`), wrapped with
    LoRA adapters and a whole trained value head under `cfg.lora`; not yet sharded."""
    model = load_value_model(cfg.model_path or model_path, dtype, attn_implementation, device)
    return apply_lora(model, cfg.lora, CRITIC_HEAD, "critic.lora.target_modules") if cfg.lora.enabled else model


class Critic:
    """The critic's FSDP-wrapped value model, its AdamW and schedule.

    Args:
        model: an ``AutoModelForTokenClassification`` with one label (`load_value_model`), already sharded.
        cfg: its optimiser and value clip.
        batching, mini_batches, epochs: the batching of the update (the actor's `TrainConfig`; the
            value model's passes run padded).
        device: where the model lives.
    """

    def __init__(self, model: nn.Module, cfg: CriticConfig, *, batching: MicroBatching, mini_batches: int, epochs: int,
                 device: torch.device):
        self.model = model
        self.cfg = cfg
        self.batching = replace(batching, packed=False)
        self.mini_batches = mini_batches
        self.epochs = epochs
        self.device = device
        self.optimizer, self.scheduler = build_optimizer(model, OptimiserSettings(
            lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
            grad_clip=cfg.grad_clip))

    def _forward(self, part: TokenBatch) -> torch.Tensor:
        return token_values(self.model, part.input_ids.to(self.device), part.attention_mask.to(self.device),
                            first_response_column(part.response_mask))

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Values `[B, T]` (CPU fp32) of the batch under the current weights: entry ``[b, t]`` is V of
        the state before token ``t``; 0 before the first response column and on padding."""
        was_training = self.model.training
        self.model.eval()
        out = self.batching.gather(batch, self.device, self._forward)
        self.model.train(was_training)
        return out

    def update(self, batch: TokenBatch) -> dict[str, float]:
        """Regress the values on `batch.returns` with the clipped value loss (clip around `batch.old_values`).

        Returns the critic's metrics: ``critic/value_loss`` (the global loss), ``critic/clip_fraction``,
        ``critic/values_mean``, ``critic/squared_error`` (token means), ``critic/grad_norm``, ``critic/lr``.
        """
        if batch.returns is None or batch.old_values is None:
            raise ValueError("the critic update needs batch.returns and batch.old_values (PolicyTrainer.prepare)")
        self.model.train()
        stats = epochs_of_mini_batches(batch, self.mini_batches, self.epochs, self._optimizer_step)
        return {f"critic/{key}": value for key, value in stats.items()}

    def _optimizer_step(self, mini: TokenBatch) -> dict[str, float]:
        return optimizer_step(mini, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                              grad_clip=self.cfg.grad_clip, batching=self.batching,
                              loss_units=lambda part: float(part.response_mask.sum()), loss_fn=self._loss,
                              loss_stats=VALUE_LOSS_STATS, device=self.device)

    def _loss(self, part: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = part.response_mask.to(self.device)
        loss, stats = clipped_value_loss(self._forward(part), part.old_values.to(self.device), part.returns.to(self.device),
                                         mask, self.cfg.value_clip)
        return loss, {"value_loss": float(loss.detach()), "clip_fraction": stats.clip_fraction,
                      "values_mean": stats.values_mean, "squared_error": stats.squared_error}


def global_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                              device: torch.device) -> float:
    """`gcore_rl.algos.value_loss.explained_variance` over the valid tokens of the whole global batch
    (every trainer rank's rows): ``1 - Var[R - V] / Var[R]``, from all-reduced sums. NaN when the
    returns have no variance. A collective over the trainer group.

    Args: values, returns, mask ``[B, T]`` (this rank's rows).
    """
    keep = mask.double()
    r, e = returns.double() * keep, (returns.double() - values.double()) * keep
    count, r_sum, r_sq, e_sum, e_sq = all_reduce_sums(
        [float(keep.sum()), float(r.sum()), float((r * r).sum()), float(e.sum()), float((e * e).sum())], device)
    if count < 2:
        return float("nan")
    var_r = r_sq / count - (r_sum / count) ** 2
    var_e = e_sq / count - (e_sum / count) ** 2
    return 1.0 - var_e / var_r if var_r > 1e-12 else float("nan")


def global_whiten(values: torch.Tensor, mask: torch.Tensor, device: torch.device, eps: float = 1e-8) -> torch.Tensor:
    """`gcore_rl.algos.masked.masked_whiten` over the valid entries of the whole global batch (all trainer
    ranks): the same mean and unbiased variance on every rank, from all-reduced sums; 0 off the mask.
    A collective over the trainer group.

    Args: values, mask ``[B, T]`` (this rank's rows). Returns ``[B, T]``.
    """
    keep = mask.bool()
    x = torch.where(keep, values.double(), torch.zeros((), dtype=torch.float64))
    count, total = all_reduce_sums([float(keep.sum()), float(x.sum())], device)
    mean = total / max(count, 1.0)
    centred = torch.where(keep, x - mean, torch.zeros((), dtype=torch.float64))
    (squares,) = all_reduce_sums([float(centred.square().sum())], device)
    var = squares / max(count - 1.0, 1.0)
    return (centred / math.sqrt(var + eps)).to(values.dtype)

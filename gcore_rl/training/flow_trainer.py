"""The Flow-GRPO update of a diffusion policy: replay sampled trajectories, PPO-clip each denoising step.

For a batch of B trajectories (`gcore_rl.rollout.flow_sampler.Trajectory`) with advantages ``[B]``,
each trained denoising step j recomputes the policy's velocity at ``x_{t_j}``, the Gaussian step it
defines (`gcore_rl.models.flow_sde.sde_step`) and the log-probability of the recorded ``x_{t_{j+1}}``;
the step's ratio to the sampling log-prob enters the PPO-clipped loss (`ppo_clip_loss`, the
denoising steps in the place of tokens), plus ``kl_coef`` × the step's exact KL to the frozen
reference's Gaussian. "Denoising reduction": with `train_steps` < S only that many of the S steps
(a seeded random subset, the same for the whole batch) are trained. Each step's loss is back-propagated
on its own (the loss is a mean over steps), so memory holds one step's graph at a time.

With `shard`, the transformer is wrapped with FSDP2 (`training/fsdp.py`) over the process group of
the job's controllers; each holds the same number of trajectories and runs the same number of
passes (the trained steps come from a seed shared by all), so the averaged gradient is that of
the whole step's batch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gcore_rl.algos.policy_loss import ppo_clip_loss
from gcore_rl.errors import ConfigError
from gcore_rl.models.flow import FlowModel, TextCondition, guided_velocity
from gcore_rl.models.flow_sde import SdeStep, sde_step, step_kl, step_log_prob
from gcore_rl.models.lora import LoraSettings, adapters_disabled, apply_lora, merged_weights
from gcore_rl.rollout.flow_sampler import Trajectory, t_cap
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.optim_step import OptimiserSettings, build_optimizer, clip_and_norm, full_tensor
from gcore_rl.training.policy_trainer import load_model_state, model_state


@dataclass
class FlowTrainConfig:
    """The policy update of a Flow-GRPO step."""

    lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate of the transformer."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    grad_clip: float = field(default=1.0, metadata={"help": "Global gradient-norm clip (0 = off)."})
    mini_batches: int = field(default=2, metadata={"help": "Optimiser steps per RL step, each on an equal share of the trajectories (after the first the ratios move off 1 and the clip acts)."})
    micro_batch: int = field(default=32, metadata={"help": "Trajectories per forward/backward pass (gradients are accumulated: the result does not depend on it)."})
    train_steps: int = field(default=0, metadata={"help": "Denoising reduction: train this many of the sampled denoising steps per trajectory, a seeded random subset (0 = all)."})
    clip_range: float = field(default=0.01, metadata={"help": "PPO ratio clip: the ratio is kept within [1 - clip_range, 1 + clip_range] (>= 0). A step's log-prob is a mean over its latent elements, so ratios stay near 1 and the clip must be narrow to act (Flow-GRPO: 1e-4 for SD3.5 at 512 px)."})
    adv_clip: float = field(default=5.0, metadata={"help": "Advantages are clipped to [-adv_clip, adv_clip] (Flow-GRPO: 5)."})
    kl_coef: float = field(default=0.0, metadata={"help": "Weight of the per-step KL to the frozen initial policy (Flow-GRPO: 0.04); > 0 keeps a reference copy."})

    def validate(self) -> None:
        for key in ("lr", "weight_decay", "grad_clip", "clip_range", "adv_clip", "kl_coef"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(key, f"must be a finite number >= 0, got {value}")
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        for key in ("mini_batches", "micro_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.train_steps < 0:
            raise ConfigError("train_steps", f"must be >= 0 (0 = every sampled step), got {self.train_steps}")


@dataclass
class ImageRows:
    """A trainer device's rows of a step, as its controller sends them (`WorkerAPI.train`): each trajectory's prompt
    (the device encodes them), the trajectories, their advantages ``[B]``, and the seed of the update (the same on
    every trainer: the trained denoising steps must agree, since FSDP pairs the passes)."""

    prompts: list[str]
    trajectory: Trajectory
    advantages: Tensor
    seed: int


@dataclass
class ImageBatch:
    """What a Flow-GRPO update trains on: trajectories, their prompts' conditioning and advantages.

    `cond` has one row per trajectory; `uncond` is the empty prompt's conditioning (one row) when
    the images were sampled with classifier-free guidance `guidance` != 1, which the replay repeats.
    """

    trajectory: Trajectory
    cond: TextCondition
    advantages: Tensor  # [B]
    guidance: float = 1.0
    uncond: TextCondition | None = None
    noise_level: float = 0.7

    def __len__(self) -> int:
        return len(self.trajectory)


def trained_steps(total: int, train_steps: int, seed: int) -> list[int]:
    """The denoising steps to train (sorted): all when `train_steps` is 0 or >= total, else a seeded subset."""
    if train_steps == 0 or train_steps >= total:
        return list(range(total))
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(total, generator=generator)[:train_steps].tolist())


def replay_step(transformer: nn.Module, model: FlowModel, batch: ImageBatch, rows: Tensor, j: int,
                device: torch.device | None = None) -> SdeStep:
    """The Gaussian law of denoising step j for trajectories `rows`, under `transformer`'s current weights, on
    `device` (default: where the trajectory is)."""
    traj = batch.trajectory
    device = device or traj.latents.device
    x = traj.latents[rows, j].to(device)
    t = traj.times[j].expand(len(rows)).to(device)
    uncond = batch.uncond.repeat(len(rows)).to(device) if batch.uncond is not None else None
    velocity = guided_velocity(transformer, model.arch, x, t, batch.cond.select(rows).to(device), uncond, batch.guidance)
    return sde_step(x, velocity, float(traj.times[j]), float(traj.times[j + 1]), batch.noise_level, t_cap(traj.times))


class FlowGrpoTrainer:
    """Owns the trained transformer, its optimiser and (with kl_coef > 0) the frozen reference, on `device`
    (the batch's trajectories stay on the host: each pass moves its rows there).

    With `lora` enabled the transformer is the frozen base plus peft adapters (`models.lora`): only the adapters
    train and are in `state_dict`, the reference is the same transformer with its adapters off (no copy), and
    `sync_weights` sends the merged weights under the plain transformer's names."""

    def __init__(self, model: FlowModel, cfg: FlowTrainConfig, shard: bool = False,
                 device: torch.device | str = "cpu", lora: LoraSettings | None = None):
        cfg.validate()
        self.flow = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.lora = lora if lora is not None and lora.enabled else None
        self.transformer = model.transformer.to(self.device).train()
        self.reference = None  # kl_coef > 0: a frozen copy, or a LoRA transformer's base (its adapters off)
        if self.lora is not None:
            self.transformer = apply_lora(self.transformer, self.lora)
        elif cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.transformer).eval().requires_grad_(False)
        if shard:  # FSDP2 over the process group: each block's parameters sharded, gradients averaged over ranks
            self.transformer = shard_model(self.transformer)
        settings = OptimiserSettings(lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay, warmup_steps=0,
                                     grad_clip=cfg.grad_clip)
        self.optimizer, self.scheduler = build_optimizer(self.transformer, settings)
        self.version = 0

    def state_dict(self) -> dict:
        """What the next update depends on, in `PolicyTrainer.state_dict`'s form (so `TrainerCheckpointer` saves
        it): `model` (the transformer's parameters, sharded DTensors when sharded), `optimizer` (AdamW by
        parameter name), `scheduler`, and the updates made (`optimiser_steps`, `updates`: this trainer's version).
        The frozen reference is not in it: it is the start model, which the job's config names."""
        return {**model_state(self.transformer, self.optimizer, self.scheduler),
                "optimiser_steps": self.version, "updates": self.version}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict` (of a trainer with the same model and configs; values are copied)."""
        load_model_state(self.transformer, self.optimizer, self.scheduler, state)
        self.version = int(state["updates"])

    @property
    def model(self) -> nn.Module:
        """The trained transformer (FSDP2-sharded with `shard`)."""
        return self.transformer

    def sync_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The transformer's current whole weights, one tensor at a time (what the engines load; a LoRA
        transformer's merged, under the plain transformer's names); a collective when sharded: every trainer of
        the group takes part."""
        if self.lora is not None:
            yield from merged_weights(self.transformer, full_tensor)
            return
        for name, tensor in self.transformer.state_dict().items():
            yield name, full_tensor(tensor.detach())

    def _reference_step(self, batch: ImageBatch, rows: Tensor, j: int) -> SdeStep:
        """Denoising step j's law under the frozen reference (a LoRA transformer's base: its adapters off)."""
        with torch.no_grad():
            if self.reference is not None:
                return replay_step(self.reference, self.flow, batch, rows, j, self.device)
            with adapters_disabled(self.transformer):
                return replay_step(self.transformer, self.flow, batch, rows, j, self.device)

    def train(self, batch: ImageBatch, seed: int) -> dict[str, float]:
        """One RL step's update: `mini_batches` optimiser steps over shares of the batch; mean statistics, named as a
        language policy's (`pg_loss`, `kl`, `clip_fraction`, `ratio_mean`, `approx_kl`, `grad_norm`), with the engine /
        trainer gap before the first optimiser step (`rollout/logprob_gap_max`) and the denoising steps trained
        (`train/trained_steps`)."""
        steps = trained_steps(batch.trajectory.logprobs.shape[1], self.cfg.train_steps, seed)
        advantages = batch.advantages.clamp(-self.cfg.adv_clip, self.cfg.adv_clip).to(self.device)
        order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
        totals: dict[str, float] = {}
        shares = order.chunk(self.cfg.mini_batches)
        for index, rows in enumerate(shares):
            stats = self._optimizer_step(batch, rows, steps, advantages)
            gap = stats.pop("logprob_gap_max")
            if index == 0:  # before this update's first optimiser step: the engine's weights, recomputed here
                totals["rollout/logprob_gap_max"] = gap
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value / len(shares)
        self.version += 1
        return totals

    def _optimizer_step(self, batch: ImageBatch, rows: Tensor, steps: list[int], advantages: Tensor) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "logprob_gap_max": 0.0}
        for part in rows.split(self.cfg.micro_batch):
            weight = len(part) / len(rows) / len(steps)
            old = batch.trajectory.logprobs[part].to(self.device)
            for j in steps:
                step = replay_step(self.transformer, self.flow, batch, part, j, self.device)
                logprob = step_log_prob(batch.trajectory.latents[part, j + 1].to(self.device), step)
                pg_loss, stats = ppo_clip_loss(logprob[:, None], old[:, j:j + 1], advantages[part],
                                               torch.ones(len(part), 1, device=self.device),
                                               clip_low=self.cfg.clip_range, clip_high=self.cfg.clip_range)
                loss = pg_loss
                if self.cfg.kl_coef > 0:
                    kl = step_kl(step, self._reference_step(batch, part, j)).mean()
                    loss = loss + self.cfg.kl_coef * kl
                    sums["kl"] += kl.item() * weight
                (loss * weight).backward()
                sums["pg_loss"] += pg_loss.item() * weight
                sums["clip_fraction"] += float(stats.clip_fraction) * weight
                sums["ratio_mean"] += float(stats.ratio_mean) * weight
                sums["approx_kl"] = sums.get("approx_kl", 0.0) + float(stats.approx_kl) * weight
                gap = float((logprob.detach() - old[:, j]).abs().max())
                sums["logprob_gap_max"] = max(sums["logprob_gap_max"], gap)
        sums["grad_norm"] = clip_and_norm(self.transformer, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        sums["train/trained_steps"] = float(len(steps))
        return sums

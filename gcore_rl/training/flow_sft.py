"""Flow-matching warm start of a diffusion policy on the synthetic shapes task.

The rectified-flow objective (Liu et al. 2022; Lipman et al. 2022): for an image x_0, noise ε and a
time t, the model's velocity at ``x_t = (1 - t)·x_0 + t·ε`` regresses onto ``ε - x_0`` (mean squared
error). Times are drawn from a logit-normal law (SD3's choice, Esser et al. 2024 §3.1). The run stops
when the loss on a fixed held-out batch (fixed images, noise and times) reaches `target_loss`, or
after `max_steps`; the policy is then written as a model folder (the transformer trained, the other
parts copied) with a PNG grid of deterministic samples.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from gcore_rl.configlib import dump_yaml
from gcore_rl.data.flow_images import to_model_range, write_grid
from gcore_rl.data.shape_task import draw, shape_rows
from gcore_rl.errors import ConfigError
from gcore_rl.models.flow import MODEL_PARTS, FlowModel, TextCondition, load_flow_model, predict_velocity
from gcore_rl.telemetry.loggers import open_loggers


@dataclass
class FlowSftConfig:
    """Flow-matching supervised warm start (`gcore-rl sft RECIPE` with ``kind: flow_matching``)."""

    kind: Literal["flow_matching"] = field(default="flow_matching", metadata={"help": "Selects this recipe type."})
    model_path: str = field(default="runs/tiny-flow", metadata={"help": "The flow model folder to start from (`gcore-rl init-tiny-diffusion`)."})
    output_dir: str = field(default="runs/tiny-flow-sft", metadata={"help": "Where the trained model folder, metrics.jsonl and samples.png go."})
    resolution: int = field(default=16, metadata={"help": "Image side in pixels."})
    max_steps: int = field(default=400, metadata={"help": "Optimiser steps at most."})
    target_loss: float = field(default=0.0, metadata={"help": "Stop once the held-out loss is at or below this (0 = run max_steps)."})
    batch_size: int = field(default=64, metadata={"help": "Images per optimiser step."})
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate."})
    eval_every: int = field(default=25, metadata={"help": "Held-out loss every this many steps."})
    min_fraction: float = field(default=0.2, metadata={"help": "Smallest shape side as a fraction of the image."})
    max_fraction: float = field(default=0.4, metadata={"help": "Largest shape side as a fraction of the image."})
    seed: int = field(default=0, metadata={"help": "Seed of images, noise, times and the data order."})

    def validate(self) -> None:
        for key in ("resolution", "max_steps", "batch_size", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("lr", f"must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.target_loss) and self.target_loss >= 0):
            raise ConfigError("target_loss", f"must be a finite number >= 0, got {self.target_loss}")
        if not 0 < self.min_fraction <= self.max_fraction <= 1:
            raise ConfigError("min_fraction", f"need 0 < min_fraction <= max_fraction <= 1, got {self.min_fraction}, "
                              f"{self.max_fraction}")


@dataclass
class FlowSftResult:
    steps: int
    loss: float
    held_out_loss: float
    wall_seconds: float
    target_reached: bool


def _shape_batch(rows: list[dict], size: int, resolution: int, rng: np.random.Generator, cfg: FlowSftConfig) -> tuple[list[str], Tensor]:
    picked = [rows[i] for i in rng.integers(0, len(rows), size=size)]
    images = [draw(row, resolution, rng, cfg.min_fraction, cfg.max_fraction) for row in picked]
    return [row["prompt"] for row in picked], to_model_range(images)


def flow_matching_loss(model: FlowModel, x0: Tensor, cond: TextCondition, noise: Tensor, t: Tensor) -> Tensor:
    """Mean squared error of the velocity at ``x_t = (1 - t)·x0 + t·noise`` against ``noise - x0``; x0, noise ``[B, C, H, W]``, t ``[B]``."""
    t_b = t.reshape(-1, 1, 1, 1)
    x_t = (1.0 - t_b) * x0 + t_b * noise
    return ((predict_velocity(model.transformer, model.arch, x_t, t, cond) - (noise - x0)) ** 2).mean()


def _logit_normal(size: int, generator: torch.Generator) -> Tensor:
    return torch.sigmoid(torch.randn(size, generator=generator))


def save_flow_model(transformer: torch.nn.Module, source: str | Path, out_dir: str | Path) -> Path:
    """Write `transformer` (whole, not sharded) to `out_dir`/transformer and copy the other parts (`MODEL_PARTS`:
    every text encoder and tokenizer of a release layout too) from the folder `source`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for part in MODEL_PARTS:
        src = Path(source) / part
        if src.is_dir():
            shutil.copytree(src, out / part, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, out / part)
    transformer.save_pretrained(out / "transformer")
    return out


def run_flow_sft(cfg: FlowSftConfig) -> FlowSftResult:
    cfg.validate()
    if (Path(cfg.output_dir) / "transformer").exists():
        raise ConfigError("output_dir", f"'{cfg.output_dir}' already holds a model; choose a new directory or remove it")
    model = load_flow_model(cfg.model_path)
    channels, _, _ = model.latent_shape(cfg.resolution, key="resolution")
    if model.vae is not None or channels != 3:
        raise ConfigError("model_path", f"the shapes warm start trains a pixel-space model (3 channels, no vae/); "
                          f"'{cfg.model_path}' has {channels} latent channels{' and a VAE' if model.vae is not None else ''}")
    torch.manual_seed(cfg.seed)
    rows = shape_rows()
    rng = np.random.default_rng([cfg.seed, 1])
    held_rng, generator = np.random.default_rng([cfg.seed, 2]), torch.Generator().manual_seed(cfg.seed)
    held_prompts, held_x0 = _shape_batch(rows, 256, cfg.resolution, held_rng, cfg)
    held_noise, held_t = torch.randn(held_x0.shape, generator=generator), _logit_normal(len(held_x0), generator)
    held_cond = model.text(held_prompts)
    optimizer = torch.optim.AdamW(model.transformer.parameters(), lr=cfg.lr)
    dump_yaml(cfg, Path(cfg.output_dir) / "sft_config.yaml")  # first, so a run that misses its target keeps it too
    start = time.perf_counter()
    held_out, loss_value, step, reached = float("nan"), float("nan"), 0, False
    with open_loggers([], cfg.output_dir, Path(cfg.output_dir) / "metrics.jsonl") as sink:
        for step in range(1, cfg.max_steps + 1):
            prompts, x0 = _shape_batch(rows, cfg.batch_size, cfg.resolution, rng, cfg)
            model.transformer.train()
            loss = flow_matching_loss(model, x0, model.text(prompts), torch.randn(x0.shape, generator=generator),
                                      _logit_normal(len(x0), generator))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.transformer.parameters(), 1.0)
            optimizer.step()
            loss_value = loss.item()
            metrics = {"loss": loss_value}
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                model.transformer.eval()
                with torch.no_grad():
                    held_out = float(flow_matching_loss(model, held_x0, held_cond, held_noise, held_t))
                metrics["eval/loss"] = held_out
                reached = cfg.target_loss > 0 and held_out <= cfg.target_loss
            sink.write(step, metrics)
            if reached:
                break
    model.transformer.eval()
    save_flow_model(model.transformer, cfg.model_path, cfg.output_dir)
    _write_samples(model, cfg, rows)
    return FlowSftResult(steps=step, loss=loss_value, held_out_loss=held_out, wall_seconds=time.perf_counter() - start,
                         target_reached=reached)


def _write_samples(model: FlowModel, cfg: FlowSftConfig, rows: list[dict]) -> None:
    from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig

    sampler = FlowSampler(model, model.transformer)
    prompts = [row["prompt"] for row in rows for _ in range(4)]
    images = sampler.sample(prompts, ImageSamplingConfig(resolution=cfg.resolution), seed=cfg.seed, deterministic=True).images
    write_grid(images, Path(cfg.output_dir) / "samples.png", columns=4, labels=prompts)

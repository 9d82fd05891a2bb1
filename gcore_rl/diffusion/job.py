"""A Flow-GRPO job: sample image groups → reward them → group-relative advantages → update → sync.

One step, for P prompts and groups of n images::

    engine.sample(P·n prompts, SDE)  → trajectories, images
    rule rewards on pixels (+ the image reward model's weighted score) → rewards [P·n]
    group_advantages(rewards, n)     → advantages (GRPO; constant groups get 0)
    trainer.train(...)               → mini-batch PPO-clip over the denoising steps (+ KL to the reference)
    engine.load_weights(trainer.weights())

Every `run.eval_every` steps the engine samples the held-out prompts deterministically (ODE, fixed
seed) and their mean reward is `eval/reward`; the run stops when it reaches
`run.stop_at_eval_reward`, else after `run.steps`. The run directory gets metrics.jsonl, the
resolved config, PNG grids of the held-out samples before and after, and the final model folder.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.configlib import dump_yaml, to_dict
from gcore_rl.diffusion.images import to_arrays, write_grid
from gcore_rl.diffusion.model import load_flow_model
from gcore_rl.diffusion.sampler import FlowSampler, ImageSamplingConfig, Trajectory
from gcore_rl.diffusion.sft import save_flow_model
from gcore_rl.diffusion.shapes import shape_rows
from gcore_rl.diffusion.trainer import FlowGrpoTrainer, FlowTrainConfig, ImageBatch
from gcore_rl.distributed import all_reduce_mean, destroy_process_group, init_process_group
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.image_model import ImageRewardModel, ImageRewardModelConfig
from gcore_rl.rewards.rule import RewardConfig, RuleRewards
from gcore_rl.telemetry.loggers import check_loggers, open_loggers
from gcore_rl.telemetry.progress import TrainProgress

TEXT_ONLY_REWARDS = ("gcore_rl.rewards.builtin:",)
"""Import-path prefixes of built-in rewards that score text, which a diffusion job cannot use."""


@dataclass
class FlowRunConfig:
    """Length of the run and where its outputs go."""

    output_dir: str = field(default="runs/flow-grpo", metadata={"help": "Run directory: resolved config, metrics.jsonl, sample grids, final model."})
    steps: int = field(default=60, metadata={"help": "RL steps at most (sample → reward → update → sync)."})
    prompts_per_step: int = field(default=8, metadata={"help": "Prompts per step (each yields sampling.n images)."})
    seed: int = field(default=0, metadata={"help": "Seed of the data order, the sampling noise and the trained steps."})
    eval_every: int = field(default=5, metadata={"help": "Deterministic samples of the held-out prompts every this many steps (eval/reward)."})
    stop_at_eval_reward: float = field(default=0.0, metadata={"help": "End the run after the evaluation at which eval/reward reaches this (0 = run all steps)."})
    save_final: bool = field(default=True, metadata={"help": "Write the final policy as a model folder to OUTPUT_DIR/final."})
    progress: bool = field(default=True, metadata={"help": "Show a rich progress bar (plain lines when not on a terminal)."})
    loggers: list[str] = field(default_factory=lambda: ["jsonl"], metadata={"help": "Metric sinks: jsonl (always), tensorboard, wandb, mlflow."})

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not (math.isfinite(self.stop_at_eval_reward)):
            raise ConfigError("stop_at_eval_reward", f"must be a finite number, got {self.stop_at_eval_reward}")
        check_loggers(self.loggers)


@dataclass
class FlowModelConfig:
    path: str = field(default="runs/tiny-flow-sft", metadata={"help": "The policy's model folder (transformer/, scheduler/, text_encoder/, tokenizer/; `gcore-rl init-tiny-diffusion`)."})


@dataclass
class FlowDataConfig:
    """The prompts: the built-in shapes task (every colour × shape prompt)."""

    task: Literal["shapes"] = field(default="shapes", metadata={"help": "Built-in prompt set: shapes (\"a red circle\", ...; rows carry colour and shape)."})
    eval_prompts: int = field(default=12, metadata={"help": "Held-out evaluation prompts (the task's first this many rows, each sampled 4 times)."})

    def validate(self) -> None:
        if self.eval_prompts < 1:
            raise ConfigError("eval_prompts", f"must be at least 1, got {self.eval_prompts}")


@dataclass
class FlowRuntimeConfig:
    """The controller processes of a diffusion job."""

    controllers: int = field(default=1, metadata={"help": "K SPMD controllers (processes on this machine), each with its own shard of the prompts, its own image engine and an FSDP2 shard of the trained transformer; gradients are averaged over all (1 = everything in this process)."})
    threads_per_process: int = field(default=0, metadata={"help": "torch intra-op threads per process (0 = CPU cores divided by controllers)."})

    def validate(self) -> None:
        if self.controllers < 1:
            raise ConfigError("controllers", f"must be at least 1, got {self.controllers}")
        if self.threads_per_process < 0:
            raise ConfigError("threads_per_process", f"must be >= 0 (0 = cores / controllers), got {self.threads_per_process}")


def _default_image_rewards() -> RewardConfig:
    from gcore_rl.rewards.rule import RewardFnConfig

    return RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.image:colour_coverage")],
                        accuracy_fn="gcore_rl.rewards.image:colour_accuracy")


@dataclass
class FlowGrpoJobConfig:
    """A Flow-GRPO job for a text-to-image flow model (`gcore-rl train RECIPE` with ``kind: flow_grpo``)."""

    kind: Literal["flow_grpo"] = field(default="flow_grpo", metadata={"help": "Selects this recipe type."})
    run: FlowRunConfig = field(default_factory=FlowRunConfig, metadata={"help": "Length and outputs."})
    model: FlowModelConfig = field(default_factory=FlowModelConfig, metadata={"help": "The diffusion policy."})
    data: FlowDataConfig = field(default_factory=FlowDataConfig, metadata={"help": "Prompts."})
    sampling: ImageSamplingConfig = field(default_factory=ImageSamplingConfig, metadata={"help": "Image sampling."})
    reward: RewardConfig = field(default_factory=_default_image_rewards, metadata={"help": "Rule rewards on pixels: fn(prompt, image, **row) with image a [H, W, 3] array in [0, 1]."})
    reward_model: ImageRewardModelConfig = field(default_factory=ImageRewardModelConfig, metadata={"help": "Scalar image reward model."})
    train: FlowTrainConfig = field(default_factory=FlowTrainConfig, metadata={"help": "The policy update."})
    runtime: FlowRuntimeConfig = field(default_factory=FlowRuntimeConfig, metadata={"help": "Controller processes."})

    def validate(self) -> None:
        if self.run.prompts_per_step % self.runtime.controllers:
            raise ConfigError("run.prompts_per_step", f"{self.run.prompts_per_step} prompts cannot be split evenly over "
                              f"runtime.controllers={self.runtime.controllers} controllers")
        paths = [(f"reward.rules.{i}.fn", rule.fn) for i, rule in enumerate(self.reward.rules)]
        paths.append(("reward.accuracy_fn", self.reward.accuracy_fn or ""))
        for key, path in paths:
            if path.startswith(TEXT_ONLY_REWARDS):
                raise ConfigError(key, f"`{path}` scores text, and a diffusion policy's samples are images: use an image "
                                  "reward such as gcore_rl.rewards.image:colour_coverage (reward.accuracy_fn: "
                                  "gcore_rl.rewards.image:colour_accuracy, or null)")


@dataclass
class FlowRunSummary:
    steps: int
    wall_seconds: float
    first_rewards: float  # mean reward of the first (up to) 10 steps
    last_rewards: float  # mean reward of the last (up to) 10 steps
    eval_reward_before: float
    eval_reward_after: float
    output_dir: str


class _Rewards:
    """The job's reward stack for images: weighted rule rewards on pixels plus the image reward model."""

    def __init__(self, cfg: FlowGrpoJobConfig):
        self.model = ImageRewardModel(cfg.reward_model) if cfg.reward_model.enabled else None
        if self.model is not None:  # a model with the wrong head or broken weights fails here, before any step
            resolution = cfg.sampling.resolution
            self.model(torch.zeros(1, 3, resolution, resolution))
        self.model_weight = cfg.reward_model.weight
        self.rules = RuleRewards(cfg.reward)

    def __call__(self, rows: list[dict], images: torch.Tensor) -> tuple[list[float], dict[str, float]]:
        inputs = [RewardInput(prompt=row["prompt"], completion=image, row=row) for row, image in zip(rows, to_arrays(images), strict=True)]
        scored = self.rules(inputs)
        rewards = list(scored.rewards)
        stats = {"reward/errors": float(scored.error_count)}
        if scored.accuracy is not None:
            stats["accuracy"] = sum(scored.accuracy) / len(scored.accuracy)
        if self.model is not None:
            scores = self.model(images)
            stats["reward_model/mean_score"] = sum(scores) / len(scores)
            rewards = [r + self.model_weight * s for r, s in zip(rewards, scores, strict=True)]
        return rewards, stats

    def close(self) -> None:
        self.rules.close()


def check_output_dir(cfg: FlowGrpoJobConfig) -> None:
    """ConfigError when `run.output_dir` holds a finished run (the driver checks before starting controllers)."""
    out = Path(cfg.run.output_dir)
    if (out / "final").exists():
        raise ConfigError("run.output_dir", f"'{out}' already holds a finished run (final/); choose a new directory or remove it")


def flow_controller(rank: int, cfg_dict: dict, port: int) -> FlowRunSummary:
    """Controller `rank` of a diffusion job (see the module docstring): its shard of the prompts, its engine,
    its FSDP2 shard of the transformer; joins the group of `runtime.controllers` processes at `port`.

    Every controller draws `prompts_per_step / K` prompts from its own shard of the task's rows
    (rows rank, rank + K, ...), samples and rewards them itself (groups never leave their controller),
    and trains on them; FSDP2 averages the gradients over the controllers, which hold equally many
    trajectories, so the update is that of the whole step's batch. Metrics are averaged over the
    controllers; controller 0 writes the run directory. Each controller evaluates all held-out prompts
    (the same weights give the same result), and the stop decision is all-reduced.
    """
    from gcore_rl.configlib import from_dict

    cfg = from_dict(FlowGrpoJobConfig, cfg_dict)
    world = cfg.runtime.controllers
    torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world))
    info = init_process_group(rank, world, port, torch.device("cpu")) if world > 1 else None
    try:
        return _run(cfg, rank, world, info)
    finally:
        if info is not None:
            destroy_process_group()


def run_flow_grpo(cfg: FlowGrpoJobConfig) -> FlowRunSummary:
    """The job in this process, as its only controller (`gcore_rl.runtime.flow.run_flow_job` starts K of them)."""
    check_output_dir(cfg)
    return flow_controller(0, to_dict(cfg), port=0)


def _run(cfg: FlowGrpoJobConfig, rank: int, world: int, info) -> FlowRunSummary:
    out = Path(cfg.run.output_dir)
    main = rank == 0
    model = load_flow_model(cfg.model.path)
    model.latent_shape(cfg.sampling.resolution)
    torch.manual_seed(cfg.run.seed)
    rows = shape_rows()
    shard = rows[rank::world]
    eval_rows = [rows[i % len(rows)] for i in range(cfg.data.eval_prompts)]
    engine = FlowSampler(model, copy.deepcopy(model.transformer))
    trainer = FlowGrpoTrainer(model, cfg.train, shard=world > 1)
    rewards = _Rewards(cfg)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, out / "config.yaml")
    uncond = model.text([""]) if cfg.sampling.guidance != 1.0 else None
    order = torch.Generator().manual_seed(cfg.run.seed * 7919 + rank)
    per_controller = cfg.run.prompts_per_step // world
    history: list[float] = []
    start = time.perf_counter()
    progress = TrainProgress(cfg.run.steps, cfg.run.progress, quiet=not main, description="flow-grpo")
    sink = open_loggers(cfg.run.loggers, out, config=None) if main else None
    try:
        before = _evaluate(engine, rewards, eval_rows, cfg, out / "grid_before.png" if main else None)
        if sink is not None:
            sink.write(0, {f"eval/{k}": v for k, v in before.items()})
        after, step = before, 0
        progress.start()
        for step in range(1, cfg.run.steps + 1):
            picked = [shard[int(i)] for i in torch.randint(len(shard), (per_controller,), generator=order)]
            local = _step(picked, engine, trainer, rewards, cfg, uncond, seed=(cfg.run.seed * 100_003 + step) * 64 + rank,
                          train_seed=cfg.run.seed * 100_003 + step)
            metrics = all_reduce_mean(local, torch.device("cpu"), sum_keys=SUMMED_FLOW_METRICS)
            history.append(metrics["reward/mean"])
            if step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                after = _evaluate(engine, rewards, eval_rows, cfg, None)
                metrics.update({f"eval/{k}": v for k, v in after.items()})
            if sink is not None:
                sink.write(step, metrics)
            progress.update(step, metrics)
            reached = bool(cfg.run.stop_at_eval_reward) and "eval/reward" in metrics and after["reward"] >= cfg.run.stop_at_eval_reward
            if all_reduce_mean({"stop_max": float(reached)}, torch.device("cpu"))["stop_max"] > 0:
                break
        _evaluate(engine, rewards, eval_rows, cfg, out / "grid_after.png" if main else None)
    finally:
        progress.close()
        rewards.close()
        if sink is not None:
            sink.close()
    if cfg.run.save_final and main:
        save_flow_model(engine.model, cfg.model.path, out / "final")
    window = min(10, len(history))
    return FlowRunSummary(steps=step, wall_seconds=time.perf_counter() - start,
                          first_rewards=sum(history[:window]) / max(window, 1),
                          last_rewards=sum(history[-window:]) / max(window, 1),
                          eval_reward_before=before["reward"], eval_reward_after=after["reward"], output_dir=str(out))


SUMMED_FLOW_METRICS = frozenset({"reward/errors", "throughput/images_per_s"})
"""Step metrics that add up over controllers; the others are averaged (maxima for keys ending in max)."""


def _step(picked: list[dict], engine: FlowSampler, trainer: FlowGrpoTrainer, rewards: _Rewards, cfg: FlowGrpoJobConfig,
          uncond, seed: int, train_seed: int) -> dict[str, float]:
    """One step on this controller: sample with `seed` (its own), train with `train_seed` (the same on every
    controller: the trained denoising steps must agree, since FSDP pairs the passes)."""
    n = cfg.sampling.n
    group_rows = [row for row in picked for _ in range(n)]
    t0 = time.perf_counter()
    trajectory = engine.sample([row["prompt"] for row in group_rows], cfg.sampling, seed=seed)
    t1 = time.perf_counter()
    values, stats = rewards(group_rows, trajectory.images)
    _check_rewards(values, group_rows)
    t2 = time.perf_counter()
    reward = torch.tensor(values, dtype=torch.float32)
    batch = ImageBatch(trajectory=trajectory, cond=engine.flow.text([row["prompt"] for row in group_rows]),
                       advantages=group_advantages(reward, n), guidance=cfg.sampling.guidance, uncond=uncond,
                       noise_level=cfg.sampling.noise_level)
    train_stats = trainer.train(batch, seed=train_seed)
    engine.load_weights(trainer.weights(), trainer.version)
    t3 = time.perf_counter()
    grouped = reward.reshape(-1, n)
    return {"reward/mean": float(reward.mean()), "reward/std": float(reward.std(unbiased=False)),
            "reward/group_std": float(grouped.std(dim=1, unbiased=False).mean()), **stats,
            **{f"train/{k}": v for k, v in train_stats.items()},
            "time/rollout_s": t1 - t0, "time/reward_s": t2 - t1, "time/update_s": t3 - t2,
            "throughput/images_per_s": len(group_rows) / (t1 - t0)}


def _check_rewards(values: list[float], rows: list[dict]) -> None:
    for value, row in zip(values, rows, strict=True):
        if not math.isfinite(value):
            raise DataError(f"the reward of an image for prompt {row['prompt']!r} is {value}; rewards must be finite")


def _evaluate(engine: FlowSampler, rewards: _Rewards, rows: list[dict], cfg: FlowGrpoJobConfig,
              grid: Path | None) -> dict[str, float]:
    """Deterministic samples of the held-out prompts (4 each, fixed seed): mean reward and accuracy; optionally a PNG grid."""
    group_rows = [row for row in rows for _ in range(4)]
    trajectory: Trajectory = engine.sample([row["prompt"] for row in group_rows], cfg.sampling, seed=cfg.run.seed,
                                           deterministic=True)
    values, stats = rewards(group_rows, trajectory.images)
    if grid is not None:
        write_grid(trajectory.images, grid, columns=4, labels=[row["prompt"] for row in group_rows])
    out = {"reward": sum(values) / len(values)}
    if "accuracy" in stats:
        out["accuracy"] = stats["accuracy"]
    return out

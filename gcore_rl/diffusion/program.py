"""The Flow-GRPO program one controller runs over its prompt shard and its device slice (`FlowSlice`).

One step, for this controller's P prompts and groups of n images::

    slice.sample_and_score(P·n prompts, SDE)   → trajectories, images; rule rewards here as chunks finish,
                                                 the image reward model's scores from its devices
    group_advantages(rewards, n)               → advantages (GRPO; constant groups get 0)
    slice.train(...)                           → mini-batch PPO-clip over the denoising steps on the trainers
    slice.sync(version)                        → new weights in every engine of the slice

Under a rebalancing plan (`dynamic`) the split of the slice between sampling and scoring devices is
re-chosen after each step from its counted work (`diffusion/dynamic.py`); the move takes effect from the
next sampling. Under a plan that overlaps steps (`disaggregated`), the next step's sampling starts before this
step trains, on the weights of the update before (one step off-policy: the PPO ratio is taken
against the log-probs the images were sampled with); `rollout/staleness_max` says how far behind.

Every controller runs it (SPMD) on its own shard; groups never leave their controller; the only
traffic between controllers is the trainers' FSDP collectives and the all-reduce of the step's
metrics and stop decision. Every `run.eval_every` steps the held-out prompts are sampled with the
ODE (fixed seed) and their mean reward is `eval/reward`; the run stops when it reaches
`run.stop_at_eval_reward`, else after `run.steps`. Controller 0 writes the run directory:
metrics.jsonl, the resolved config, PNG grids of the held-out samples before and after, the final model;
every controller writes its devices' recorded sample / score calls to timeline/device-<d>.jsonl.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.configlib import dump_yaml
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.dynamic import FlowRebalancer
from gcore_rl.diffusion.images import to_arrays, write_grid
from gcore_rl.diffusion.shapes import shape_rows
from gcore_rl.diffusion.slice import FlowSlice, Sampling
from gcore_rl.distributed import all_reduce_mean
from gcore_rl.errors import DataError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.telemetry.loggers import open_loggers
from gcore_rl.telemetry.progress import TrainProgress

SUMMED_FLOW_METRICS = frozenset({"reward/errors", "throughput/images_per_s"})
"""Step metrics that add up over controllers; the others are averaged (maxima for keys ending in max)."""
CPU = torch.device("cpu")


@dataclass
class FlowRunSummary:
    steps: int
    wall_seconds: float
    first_rewards: float  # mean reward of the first 10 steps (`first_last_window`)
    last_rewards: float  # mean reward of the last 10 steps
    eval_reward_before: float
    eval_reward_after: float
    output_dir: str


def first_last_window(steps: int) -> int:
    """Steps in each of the "first" and "last" reward windows of a run: 10, or half the steps if fewer (never overlapping)."""
    return max(1, min(10, steps // 2))


class _Scored:
    """Rule rewards of a step's images, computed as their chunks arrive, and the reward model's weighted scores."""

    def __init__(self, rules: RuleRewards, rows: list[dict]):
        self.rules = rules
        self.rows = rows
        self.rewards: list[float] = [math.nan] * len(rows)
        self.accuracy: list[float] = []
        self.errors = 0

    def __call__(self, start: int, images: Tensor) -> None:
        rows = self.rows[start:start + len(images)]
        scored = self.rules([RewardInput(prompt=row["prompt"], completion=image, row=row)
                             for row, image in zip(rows, to_arrays(images), strict=True)])
        self.rewards[start:start + len(images)] = scored.rewards
        self.accuracy.extend(scored.accuracy or [])
        self.errors += scored.error_count

    def total(self, model_scores: list[float] | None, weight: float) -> tuple[list[float], dict[str, float]]:
        rewards = list(self.rewards)
        stats = {"reward/errors": float(self.errors)}
        if self.accuracy:
            stats["accuracy"] = sum(self.accuracy) / len(self.accuracy)
        if model_scores is not None:
            stats["reward_model/mean_score"] = sum(model_scores) / len(model_scores)
            rewards = [r + weight * s for r, s in zip(rewards, model_scores, strict=True)]
        for value, row in zip(rewards, self.rows, strict=True):
            if not math.isfinite(value):
                raise DataError(f"the reward of an image for prompt {row['prompt']!r} is {value}; rewards must be finite")
        return rewards, stats


def run_flow_controller(cfg: FlowGrpoJobConfig, rank: int, world: int, devices: FlowSlice,
                        collectives: torch.device = CPU) -> FlowRunSummary:
    """Controller `rank` of `world` (see the module docstring); its shard is the task's rows rank, rank + world, ...
    `collectives`: the device of the controllers' group's tensors (CUDA for the local runtime's NCCL group)."""
    out = Path(cfg.run.output_dir)
    main = rank == 0
    rows = shape_rows()
    shard = rows[rank::world]
    eval_rows = [rows[i % len(rows)] for i in range(cfg.data.eval_prompts)]
    rules = RuleRewards(cfg.reward)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        dump_yaml(cfg, out / "config.yaml")
    order = torch.Generator().manual_seed(cfg.run.seed * 7919 + rank)
    per_controller = cfg.run.prompts_per_step // world
    history: list[float] = []
    start = time.perf_counter()
    progress = TrainProgress(cfg.run.steps, cfg.run.progress, quiet=not main, description="flow-grpo")
    sink = open_loggers(cfg.run.loggers, out, config=None) if main else None
    try:
        before = _evaluate(devices, rules, eval_rows, cfg, out / "grid_before.png" if main else None)
        if sink is not None:
            sink.write(0, {f"eval/{k}": v for k, v in before.items()})
        after, step = before, 0
        progress.start()
        overlap = devices.plan.traits.overlaps_steps
        rebalancer = (FlowRebalancer(cfg.placement.rebalance, len(devices.plan.slices[0]), collectives)
                      if devices.plan.traits.rebalances else None)
        draw = _Draws(shard, per_controller, cfg, rank, order)
        ahead: _Batch | None = None
        for step in range(1, cfg.run.steps + 1):
            current, ahead = ahead or draw.start(devices, step), None
            if overlap and step < cfg.run.steps:  # one step off: the next batch samples on the old weights meanwhile
                ahead = draw.start(devices, step + 1)
            local = _step(current, devices, rules, cfg, step, train_seed=cfg.run.seed * 100_003 + step)
            metrics = all_reduce_mean(local, collectives, sum_keys=SUMMED_FLOW_METRICS)
            if rebalancer is not None:  # every controller decides alike from the same all-reduced work
                next_plan, placement = rebalancer.after_rollout(devices.chunk_work(current.sampling),
                                                                local["time/rollout_s"], devices.plan)
                devices.apply_plan(next_plan)
                metrics.update(placement)
            history.append(metrics["reward/mean"])
            if step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                after = _evaluate(devices, rules, eval_rows, cfg, None)
                metrics.update({f"eval/{k}": v for k, v in after.items()})
            if sink is not None:
                sink.write(step, metrics)
            progress.update(step, metrics)
            reached = bool(cfg.run.stop_at_eval_reward) and "eval/reward" in metrics and after["reward"] >= cfg.run.stop_at_eval_reward
            if all_reduce_mean({"stop_max": float(reached)}, collectives)["stop_max"] > 0:
                break
        if ahead is not None:  # a batch sampled for a step that will not run
            devices.finish_sampling(ahead.sampling, lambda start, images: None)
        _evaluate(devices, rules, eval_rows, cfg, out / "grid_after.png" if main else None)
        if cfg.run.save_final and main:
            devices.save_policy(str(out / "final"))
        _write_timelines(out, devices)
    finally:
        progress.close()
        rules.close()
        if sink is not None:
            sink.close()
    window = first_last_window(len(history))
    return FlowRunSummary(steps=step, wall_seconds=time.perf_counter() - start,
                          first_rewards=sum(history[:window]) / window, last_rewards=sum(history[-window:]) / window,
                          eval_reward_before=before["reward"], eval_reward_after=after["reward"], output_dir=str(out))


def _write_timelines(out: Path, devices: FlowSlice) -> None:
    """``timeline/device-<d>.jsonl`` for each device of this controller's slice: one line per sample / score call."""
    folder = out / "timeline"
    folder.mkdir(parents=True, exist_ok=True)
    for device, events in devices.timelines().items():
        lines = [json.dumps({"device": device, "what": what, "start": start, "end": end}) for what, start, end in events]
        (folder / f"device-{device}.jsonl").write_text("".join(line + "\n" for line in lines))


@dataclass
class _Batch:
    """A step's images being sampled: the rows (each repeated n times), the sampling, the weights' version."""

    rows: list[dict]
    sampling: Sampling
    version: int
    started: float


class _Draws:
    """Draws each step's prompts from the controller's shard and starts their sampling."""

    def __init__(self, shard: list[dict], count: int, cfg: FlowGrpoJobConfig, rank: int, order: torch.Generator):
        self.shard, self.count, self.cfg, self.rank, self.order = shard, count, cfg, rank, order

    def start(self, devices: FlowSlice, step: int) -> _Batch:
        """Start sampling step `step`'s images with the engines' current weights (those of update `step - 1`,
        or older while an update is in flight) and this controller's own seed."""
        picked = [self.shard[int(i)] for i in torch.randint(len(self.shard), (self.count,), generator=self.order)]
        rows = [row for row in picked for _ in range(self.cfg.sampling.n)]
        seed = (self.cfg.run.seed * 100_003 + step) * 64 + self.rank
        started = time.perf_counter()  # in-process the sampling runs inside start_sampling
        return _Batch(rows, devices.start_sampling([row["prompt"] for row in rows], seed), devices.version, started)


def _step(batch: _Batch, devices: FlowSlice, rules: RuleRewards, cfg: FlowGrpoJobConfig, step: int,
          train_seed: int) -> dict[str, float]:
    """One step on this controller: finish the batch's sampling (started with its own seed), reward, train
    with `train_seed` (the same on every controller: the trained denoising steps must agree, since FSDP
    pairs the passes), sync."""
    n = cfg.sampling.n
    group_rows = batch.rows
    prompts = [row["prompt"] for row in group_rows]
    scored = _Scored(rules, group_rows)
    t0 = batch.started
    trajectory, model_scores = devices.finish_sampling(batch.sampling, scored)
    t1 = time.perf_counter()
    rewards, stats = scored.total(model_scores, cfg.model_reward_weight)
    reward = torch.tensor(rewards, dtype=torch.float32)
    train_stats = devices.train(prompts, trajectory, group_advantages(reward, n), seed=train_seed)
    t2 = time.perf_counter()
    devices.sync(step)
    t3 = time.perf_counter()
    grouped = reward.reshape(-1, n)
    return {"reward/mean": float(reward.mean()), "reward/std": float(reward.std(unbiased=False)),
            "reward/group_std": float(grouped.std(dim=1, unbiased=False).mean()), **stats,
            **{f"train/{k}": v for k, v in train_stats.items()},
            "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/sync_s": t3 - t2,
            "throughput/images_per_s": len(prompts) / (t1 - t0),
            "rollout/staleness_max": float(step - 1 - batch.version)}


def _evaluate(devices: FlowSlice, rules: RuleRewards, rows: list[dict], cfg: FlowGrpoJobConfig,
              grid: Path | None) -> dict[str, float]:
    """ODE samples of the held-out prompts (4 each, fixed seed): mean reward and accuracy; optionally a PNG grid.
    Every controller computes the same (identical weights and seed), so the stop decision agrees."""
    group_rows = [row for row in rows for _ in range(4)]
    scored = _Scored(rules, group_rows)
    trajectory, model_scores = devices.sample_and_score([row["prompt"] for row in group_rows], cfg.run.seed, scored,
                                                        deterministic=True)
    rewards, stats = scored.total(model_scores, cfg.model_reward_weight)
    if grid is not None:
        write_grid(trajectory.images, grid, columns=4, labels=[row["prompt"] for row in group_rows])
    out = {"reward": sum(rewards) / len(rewards)}
    if "accuracy" in stats:
        out["accuracy"] = stats["accuracy"]
    return out

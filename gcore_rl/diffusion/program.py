"""The Flow-GRPO program one controller runs over its prompt shard and its device slice (`FlowSlice`).

One step, for this controller's P prompts and groups of n images::

    slice.sample_and_score(P·n prompts, SDE)   → trajectories, images; rule rewards here as chunks finish,
                                                 the image reward model's scores from its devices
    image_advantages(rewards, n)               → advantages (`algo.advantage` of the shared registry; GRPO by default)
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
metrics.jsonl, PNG grids of the held-out samples before and after, the final model; each device's worker
writes its timeline/device-<d>.jsonl.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.registry import AdvantageInputs, compute_advantages
from gcore_rl.checkpoint.layout import controller_file
from gcore_rl.controller.checkpointing import RunCheckpoints
from gcore_rl.diffusion.checkpointing import FlowControllerState, SampledBatch
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.dynamic import FlowRebalancer
from gcore_rl.diffusion.images import to_arrays, write_grid
from gcore_rl.diffusion.sampler import Trajectory
from gcore_rl.diffusion.shapes import shape_rows
from gcore_rl.diffusion.slice import FlowSlice, Sampling
from gcore_rl.distributed import DistInfo, all_reduce_mean
from gcore_rl.errors import CheckpointError, DataError
from gcore_rl.placement.rebalance import RolloutLoad
from gcore_rl.records import RewardInput
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.telemetry.health import HealthWatch
from gcore_rl.telemetry.loggers import open_loggers
from gcore_rl.telemetry.metrics import read_metrics
from gcore_rl.telemetry.progress import TrainProgress

SUMMED_FLOW_METRICS = frozenset({"reward/errors", "reward/count", "throughput/images_per_s"})
"""Step metrics that add up over controllers; the others are averaged (maxima for keys ending in max)."""


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

    def sampled(self, version: int, trajectory: Trajectory, model_scores: list[float] | None) -> SampledBatch:
        """The rows with their images (sampled with the weights of update `version`) and the rewards found for them."""
        return SampledBatch(self.rows, version, trajectory, model_scores, list(self.rewards), list(self.accuracy),
                            self.errors)


def _rewards(sampled: SampledBatch, weight: float) -> tuple[list[float], dict[str, float]]:
    """Each image's reward (the rules' plus `weight` × the scoring model's) and the batch's reward statistics."""
    rewards = list(sampled.rewards)
    stats = {"reward/errors": float(sampled.errors)}
    if sampled.accuracy:
        stats["accuracy"] = sum(sampled.accuracy) / len(sampled.accuracy)
    if sampled.model_scores is not None:
        stats["reward_model/mean_score"] = sum(sampled.model_scores) / len(sampled.model_scores)
        rewards = [r + weight * s for r, s in zip(rewards, sampled.model_scores, strict=True)]
    for value, row in zip(rewards, sampled.rows, strict=True):
        if not math.isfinite(value):
            raise DataError(f"the reward of an image for prompt {row['prompt']!r} is {value}; rewards must be finite")
    return rewards, stats


def _finish(batch: _Batch, devices: FlowSlice, rules: RuleRewards) -> SampledBatch:
    """Wait for a started batch's images, rewarding each chunk by the rules as it arrives (or take the batch as
    a checkpoint kept it)."""
    if batch.done is not None:
        return batch.done
    scored = _Scored(rules, batch.rows)
    trajectory, model_scores = devices.finish_sampling(batch.sampling, scored)
    return scored.sampled(batch.version, trajectory, model_scores)


def run_flow_controller(cfg: FlowGrpoJobConfig, info: DistInfo, devices: FlowSlice) -> FlowRunSummary:
    """Controller `info.rank` of `info.world_size` (see the module docstring); its shard is the task's rows rank,
    rank + world, ...; `info.device` carries the controllers' collectives (CUDA for the local runtime's NCCL group).
    With `run.resume` (a checkpoint folder the driver chose) the run continues after the checkpoint's step."""
    rank, world, collectives = info.rank, info.world_size, info.device
    out = Path(cfg.run.output_dir)
    main = rank == 0
    rows = shape_rows()
    shard = rows[rank::world]
    eval_rows = [rows[i % len(rows)] for i in range(cfg.data.eval_prompts)]
    rules = RuleRewards(cfg.reward)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    trainers = len(devices.plan.devices_of("update", "actor"))
    checkpoints = RunCheckpoints(cfg, info, devices, trainers, frozen=cfg.frozen_model_paths)
    overlap = devices.plan.traits.overlaps_steps
    # the devices told of each step and asked for its utilisation: when the plan samples one step ahead, only the
    # trainers (a rollout device may still be sampling the batch started before, and would hold the call up)
    asked = devices.updaters if overlap else None
    rebalancer = (FlowRebalancer(cfg.placement.rebalance, len(devices.plan.slices[0]), collectives)
                  if devices.plan.traits.rebalances else None)

    def rebalance(batch: _Batch, rollout_s: float) -> dict[str, float]:
        """Re-choose the split from the rollout just done (every controller decides alike from the same all-reduced
        work), before the sync, which loads the engines of the next rollout's devices."""
        next_plan, placement = rebalancer.after_rollout(devices.chunk_work(batch.sampling), rollout_s, devices.plan)
        devices.apply_plan(next_plan)
        return placement

    saved = _resume(cfg, rank, world, devices, rebalancer) if cfg.run.resume else None
    order = saved.generator() if saved else torch.Generator().manual_seed(cfg.run.seed * 7919 + rank)
    per_controller = cfg.run.prompts_per_step // world
    history: list[float] = list(saved.rewards) if saved else []
    start = time.perf_counter()
    first = saved.step + 1 if saved else 1
    progress = TrainProgress(cfg.run.steps, cfg.run.progress, quiet=not main, description="flow-grpo")
    sink = open_loggers(cfg.run.loggers, out, config=None, first_step=first) if main else None
    try:
        if saved:
            before, after = saved.eval_before, saved.eval_after
        else:
            before = after = _evaluate(devices, rules, eval_rows, cfg, out / "grid_before.png" if main else None)
            if sink is not None:
                sink.write(0, {f"eval/{k}": v for k, v in before.items()})
        # the first of each kind of unhealthy update is warned of (controller 0; a resumed run's earlier steps count)
        earlier = read_metrics(out / "metrics.jsonl") if saved and main and (out / "metrics.jsonl").exists() else []
        health = (HealthWatch(cfg.run.health, before.get("accuracy"), history=[line for line in earlier if line["step"] > 0])
                  if main else None)
        step = first - 1
        progress.start()
        draw = _Draws(shard, per_controller, cfg, rank, order)
        ahead = (_Batch(saved.ahead.rows, None, saved.ahead.version, time.perf_counter(), saved.ahead)
                 if saved and saved.ahead else None)
        for step in range(first, cfg.run.steps + 1):
            devices.begin_step(step, asked)
            step_start = time.perf_counter()
            current, ahead = ahead or draw.start(devices, step), None
            if overlap and step < cfg.run.steps:  # one step off: the next batch samples on the old weights meanwhile
                ahead = draw.start(devices, step + 1)
            local, placement = _step(current, devices, rules, cfg, step, train_seed=cfg.run.seed * 100_003 + step,
                                     rebalance=rebalance if rebalancer is not None else None)
            local.update(devices.utilisation(time.perf_counter() - step_start, asked))  # busy / idle s, work, memory
            metrics = {**all_reduce_mean(local, collectives, sum_keys=SUMMED_FLOW_METRICS), **placement}
            history.append(metrics["reward/mean"])
            if step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                after = _evaluate(devices, rules, eval_rows, cfg, None)
                metrics.update({f"eval/{k}": v for k, v in after.items()})
            checkpoints.finish(then_saving=checkpoints.due(step))  # the previous save was written during this step
            if checkpoints.due(step):
                if ahead is not None:  # what the next step trains on goes into the checkpoint: sampled now
                    ahead.done = _finish(ahead, devices, rules)
                state = FlowControllerState(step, world, order.get_state().tolist(), history, before, after,
                                            devices.plan.rollout_devices, [load.as_dict() for load in
                                                                           (rebalancer.loads if rebalancer else [])],
                                            ahead.done if ahead is not None else None)
                metrics["time/checkpoint"] = checkpoints.save(step, state)
            if health is not None:
                for warning in health.warnings(health.check({"step": step, **metrics})):
                    print(warning, file=sys.stderr, flush=True)
            if sink is not None:
                sink.write(step, metrics)
            progress.update(step, metrics)
            reached = bool(cfg.run.stop_at_eval_reward) and "eval/reward" in metrics and after["reward"] >= cfg.run.stop_at_eval_reward
            if all_reduce_mean({"stop_max": float(reached)}, collectives)["stop_max"] > 0:
                break
        if ahead is not None and ahead.done is None:  # a batch sampled for a step that will not run
            devices.finish_sampling(ahead.sampling, lambda start, images: None)
        checkpoints.close()
        _evaluate(devices, rules, eval_rows, cfg, out / "grid_after.png" if main else None)
        if cfg.run.save_final and main:
            devices.save_policy(str(out / "final"))
    finally:
        progress.close()
        rules.close()
        if sink is not None:
            sink.close()
    window = first_last_window(len(history))
    return FlowRunSummary(steps=step, wall_seconds=time.perf_counter() - start,
                          first_rewards=sum(history[:window]) / window, last_rewards=sum(history[-window:]) / window,
                          eval_reward_before=before["reward"], eval_reward_after=after["reward"], output_dir=str(out))


def _resume(cfg: FlowGrpoJobConfig, rank: int, world: int, devices: FlowSlice,
            rebalancer: FlowRebalancer | None) -> FlowControllerState:
    """Take up the checkpoint at `run.resume`: the trainers' state (resharded to this job's trainers), the engines'
    weights from it, the rebalancer's history and split; returns this controller's saved state."""
    folder = Path(cfg.run.resume)
    state = FlowControllerState.read(folder / controller_file(rank))
    if state.controllers != world:
        raise CheckpointError(f"checkpoint '{folder}' was saved by {state.controllers} controllers and this job has "
                              f"{world}: a diffusion job resumes on as many controllers (runtime.controllers) as saved")
    devices.load_checkpoint(str(folder))
    devices.sync(state.step)
    if rebalancer is not None:
        rebalancer.loads = [RolloutLoad.from_dict(load) for load in state.loads]
        if state.rollout_devices != devices.plan.rollout_devices:
            devices.apply_plan(devices.plan.with_rollout_devices(state.rollout_devices))
    return state


@dataclass
class _Batch:
    """A step's images being sampled: the rows (each repeated n times), the sampling, the weights' version."""

    rows: list[dict]
    sampling: Sampling | None
    version: int
    started: float
    done: SampledBatch | None = None  # sampled and rewarded already (a batch a checkpoint kept)


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
          train_seed: int, rebalance: Callable[[_Batch, float], dict[str, float]] | None = None,
          ) -> tuple[dict[str, float], dict[str, float]]:
    """One step on this controller: finish the batch's sampling (started with its own seed), reward, re-choose the
    split (`rebalance`, under a rebalancing plan), train with `train_seed` (the same on every controller: the
    trained denoising steps must agree, since FSDP pairs the passes), sync. The step's own metrics, and the
    placement's (the same on every controller already)."""
    n = cfg.sampling.n
    prompts = [row["prompt"] for row in batch.rows]
    t0 = batch.started
    sampled = _finish(batch, devices, rules)
    t1 = time.perf_counter()
    placement = rebalance(batch, t1 - t0) if rebalance is not None else {}
    rewards, stats = _rewards(sampled, cfg.model_reward_weight)
    reward = torch.tensor(rewards, dtype=torch.float32)
    train_stats = devices.train_images(prompts, sampled.trajectory, image_advantages(cfg.algo.advantage, reward, n),
                                       seed=train_seed)
    t2 = time.perf_counter()
    devices.sync(step)
    t3 = time.perf_counter()
    grouped = reward.reshape(-1, n)
    return {"reward/mean": float(reward.mean()), "reward/std": float(reward.std(unbiased=False)),
            "reward/group_std": float(grouped.std(dim=1, unbiased=False).mean()), "reward/count": float(len(rewards)),
            **stats,
            **train_stats,
            "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/sync_s": t3 - t2,
            "throughput/images_per_s": len(prompts) / (t1 - t0),
            "rollout/staleness_max": float(step - 1 - batch.version)}, placement


def image_advantages(advantage: str, rewards: Tensor, n: int) -> Tensor:
    """``[B]`` advantages of a step's ``[B]`` rewards (groups of `n` contiguous images) by the shared registry's
    estimator `advantage` (`algo.advantage`); a token-level estimator sees each image as one token."""
    inputs = AdvantageInputs(rewards, n, mask=torch.ones(len(rewards), 1))
    return compute_advantages(AlgoConfig(advantage=advantage), inputs).reshape(len(rewards), -1)[:, 0]


def _evaluate(devices: FlowSlice, rules: RuleRewards, rows: list[dict], cfg: FlowGrpoJobConfig,
              grid: Path | None) -> dict[str, float]:
    """ODE samples of the held-out prompts (4 each, fixed seed): mean reward and accuracy; optionally a PNG grid.
    Every controller computes the same (identical weights and seed), so the stop decision agrees."""
    group_rows = [row for row in rows for _ in range(4)]
    scored = _Scored(rules, group_rows)
    trajectory, model_scores = devices.sample_and_score([row["prompt"] for row in group_rows], cfg.run.seed, scored,
                                                        deterministic=True)
    rewards, stats = _rewards(scored.sampled(devices.version, trajectory, model_scores), cfg.model_reward_weight)
    if grid is not None:
        write_grid(trajectory.images, grid, columns=4, labels=[row["prompt"] for row in group_rows])
    out = {"reward": sum(rewards) / len(rewards)}
    if "accuracy" in stats:
        out["accuracy"] = stats["accuracy"]
    return out

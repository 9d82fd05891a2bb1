"""The samples of a diffusion (Flow-GRPO) policy, as the shared step loop sees them (`SampleKind`).

A sample is one image with its denoising trajectory (`ImageSample`). A wave samples `sampling.n` images of each
prompt row through the language jobs' `SliceClient.rollout_and_score` (the rows split over the rollout devices, each
device's image engine streaming chunks of `sampling.batch_size` images, each chunk with a seed of its own), rewards
each chunk by the rules as it arrives and sends its images to the scoring model's devices (the image reward model or
a vision-language judge); the update takes advantages from the shared registry (`algo.advantage`, each image one
outcome) and sends each trainer an equal contiguous part of the trajectories (`SliceClient.start_train_rows`). Every `run.eval_every`
steps the held-out prompts are sampled with the ODE (4 images each, fixed seed): ``eval/reward`` and
``eval/accuracy``, with a PNG grid of them (``grid_before.png``, ``grid_after.png``); the run stops when
``eval/reward`` reaches `run.stop_at_eval_reward`. Prompts are the built-in shapes task's, each controller holding
rows rank, rank + K, ... in an epoch-shuffled order (`ShardedPromptSampler`). A checkpoint keeps an image's
trajectory as tensors beside the controller's JSON.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig, WaveSampler
from gcore_rl.algos.registry import AdvantageInputs, compute_advantages
from gcore_rl.controller.program import ControllerContext, GroupPayload, RewardTally, StepRollout, WaveRewards
from gcore_rl.controller.shard import ControllerShard
from gcore_rl.controller.slice import split_evenly
from gcore_rl.data.flow_images import to_arrays, write_grid
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.data.shape_task import shape_rows
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.forecast import ChunkForecaster, ImageWork
from gcore_rl.distributed import DistInfo
from gcore_rl.errors import DataError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.judge import combine_rewards
from gcore_rl.rollout.flow_sampler import (
    ImageRollout,
    ImageSample,
    ImageSamplingConfig,
    Trajectory,
    cat_trajectories,
    select_rows,
)
from gcore_rl.telemetry.metrics import PhaseTimer
from gcore_rl.training.flow_trainer import ImageRows

EVAL_IMAGES_PER_PROMPT = 4
TRAJECTORY_TENSORS = ("latents", "logprobs", "times", "images")


@dataclass
class FlowRunSummary:
    """What a finished diffusion run reports back to the CLI (``summary.json``)."""

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


def image_advantages(advantage: str, rewards: Tensor, n: int) -> Tensor:
    """``[B]`` advantages of a step's ``[B]`` rewards (groups of `n` contiguous images) by the shared registry's
    estimator `advantage` (`algo.advantage`); a token-level estimator sees each image as one token."""
    inputs = AdvantageInputs(rewards, n, mask=torch.ones(len(rewards), 1))
    return compute_advantages(AlgoConfig(advantage=advantage), inputs).reshape(len(rewards), -1)[:, 0]


@dataclass
class _Rewarded:
    samples: list[ImageSample]  # prompt-major
    rewards: list[float]  # one per image
    accuracy: list[float]


def _roll_out(rows: list[dict], images: ImageRollout, ctx: ControllerContext, seed: int, tally: RewardTally | None,
              timer: PhaseTimer | None) -> _Rewarded:
    """`images.sampling.n` images of each row on the slice's rollout devices (`SliceClient.rollout_and_score`), each
    chunk rewarded by the rules as it arrives and its images sent to the scoring model's devices; the scoring model's
    weighted verdicts added. Counted in `tally` when one is given."""
    rule: dict[tuple[int, int], float] = {}
    accuracy: list[float] = []

    def on_finished(chunk: list[ImageSample]) -> list[RewardInput]:
        arrays = to_arrays(torch.cat([s.trajectory.images for s in chunk]))
        inputs = [RewardInput(prompt=s.prompt, completion=image, row=rows[s.prompt_index])
                  for s, image in zip(chunk, arrays, strict=True)]
        with timer.phase("rollout/reward") if timer is not None else contextlib.nullcontext():
            scored = ctx.rewards(inputs)
        rule.update(((s.prompt_index, s.sample_index), r) for s, r in zip(chunk, scored.rewards, strict=True))
        accuracy.extend(scored.accuracy or [])
        if tally is not None:
            tally.count_rule(scored, pooled=ctx.rewards.cfg.workers > 0)
        # the scoring model sees the prompt and the image, not the row
        return [RewardInput(prompt=i.prompt, completion=i.completion, row={}) for i in inputs] if ctx.reward_model_weights else []

    result = ctx.workers.rollout_and_score([row["prompt"] for row in rows], images, seed, on_finished)
    verdicts = result.verdicts(ctx.reward_model_weights)
    components = {"rule": [rule[k] for k in result.keys()], **{kind: [v.reward for v in said] for kind, said in verdicts.items()}}
    rewards = combine_rewards(components, {"rule": 1.0, **ctx.reward_model_weights})
    for value, sample in zip(rewards, result.completions, strict=True):
        if not math.isfinite(value):
            raise DataError(f"the reward of an image for prompt {sample.prompt!r} is {value}; rewards must be finite")
    if tally is not None:
        tally.add(rewards, accuracy, verdicts)
    return _Rewarded(result.completions, rewards, accuracy)


class ImageSamples:
    """A diffusion policy's samples (see the module docstring)."""

    log_samples = False

    def load_shard(self, cfg: FlowGrpoJobConfig, ctx: ControllerContext, info: DistInfo) -> ControllerShard:
        """The shapes task's rows rank, rank + K, ... and the held-out rows (the task's first `data.eval_prompts`,
        the same on every controller)."""
        rows = shape_rows()
        row_ids = list(range(info.rank, len(rows), info.world_size))
        sampler = ShardedPromptSampler(len(row_ids), seed=cfg.run.seed, shard_index=info.rank)
        waves = WaveSampler(DynamicSamplingConfig(), cfg.run.prompts_per_step // info.world_size)
        return ControllerShard(rows=[rows[i] for i in row_ids], row_ids=row_ids,
                               eval_rows=[rows[i % len(rows)] for i in range(cfg.data.eval_prompts)],
                               length_stats={}, sampler=sampler, waves=waves)

    def wave(self, rows: list[dict], ctx: ControllerContext, sampling: ImageSamplingConfig, timer: PhaseTimer,
             tally: RewardTally, seed: int, trained: bool = True) -> WaveRewards:
        """`sampling.n` images of each row (prompt-major), rewarded; the wave's chunks are its counted work."""
        with timer.phase("rollout"):
            done = _roll_out(rows, ImageRollout(sampling), ctx, seed, tally, timer)
        devices = min(len(rows), len(ctx.workers.rollout))
        chunks = sum(-(-len(part) * sampling.n // sampling.batch_size) for _, part in split_evenly(rows, devices))
        return WaveRewards(completions=done.samples, rewards=done.rewards,
                           work=ImageWork(chunks, bool(ctx.reward_model_weights)))

    def start_update(self, rollout: StepRollout, ctx: ControllerContext, cfg: FlowGrpoJobConfig,
                     trainer_version: int) -> tuple[list, dict[str, float]]:
        """Advantages of the step's images, sent with their trajectories to the trainers in equal contiguous parts
        (`ImageRows`). Every controller trains with the same seed (`run.seed` and the step): the trained denoising
        steps must agree, since FSDP pairs the passes."""
        n = cfg.sampling.n
        samples = [s for group in rollout.groups.groups for s in group.payload.completions]
        rewards = torch.tensor([r for group in rollout.groups.groups for r in group.rewards], dtype=torch.float32)
        advantages = image_advantages(cfg.algo.advantage, rewards, n)
        trainers = len(ctx.workers.trainers)
        if len(samples) % trainers:
            raise ValueError(f"{len(samples)} trajectories cannot be split evenly over {trainers} trainer devices")
        size, seed = len(samples) // trainers, cfg.run.seed * 100_003 + trainer_version + 1
        parts = [samples[k * size:(k + 1) * size] for k in range(trainers)]
        pending = ctx.workers.start_train_rows([
            ImageRows([s.prompt for s in part], cat_trajectories([s.trajectory for s in part]),
                      advantages[k * size:(k + 1) * size], seed) for k, part in enumerate(parts)])
        staleness = [trainer_version - s.policy_version for s in samples]
        return pending, {"reward/group_std": float(rewards.reshape(-1, n).std(dim=1, unbiased=False).mean()),
                         "rollout/generated_images": float(len(samples)),
                         "rollout/staleness_max": float(max(staleness)),
                         "rollout/staleness_mean": sum(staleness) / len(staleness)}

    def evaluate(self, cfg: FlowGrpoJobConfig, shard: ControllerShard, ctx: ControllerContext, info: DistInfo,
                 moment: str) -> dict[str, float]:
        """ODE samples of the held-out prompts (4 each, fixed seed): ``eval/reward`` and ``eval/accuracy``; controller 0
        draws them as ``grid_<moment>.png``. Every controller computes the same (identical weights and seed)."""
        images = ImageRollout(replace(cfg.sampling, n=EVAL_IMAGES_PER_PROMPT), deterministic=True)
        done = _roll_out(shard.eval_rows, images, ctx, cfg.run.seed, tally=None, timer=None)
        if info.is_main:
            write_grid(torch.cat([s.trajectory.images for s in done.samples]),
                       Path(cfg.run.output_dir) / f"grid_{moment}.png", columns=EVAL_IMAGES_PER_PROMPT,
                       labels=[s.prompt for s in done.samples])
        out = {"eval/reward": sum(done.rewards) / len(done.rewards)}
        if done.accuracy:
            out["eval/accuracy"] = sum(done.accuracy) / len(done.accuracy)
        return out

    def stops(self, cfg: FlowGrpoJobConfig, metrics: dict[str, float]) -> bool:
        target = cfg.run.stop_at_eval_reward
        return bool(target) and "eval/reward" in metrics and metrics["eval/reward"] >= target

    def forecaster(self, cfg: FlowGrpoJobConfig, ctx: ControllerContext) -> ChunkForecaster:
        return ChunkForecaster(len(ctx.plan.slices[0]))

    def summary(self, cfg: FlowGrpoJobConfig, run: Any, wall_seconds: float) -> FlowRunSummary:
        window = first_last_window(len(run.rewards))
        return FlowRunSummary(steps=run.step, wall_seconds=wall_seconds,
                              first_rewards=sum(run.rewards[:window]) / window,
                              last_rewards=sum(run.rewards[-window:]) / window,
                              eval_reward_before=run.eval_before["eval/reward"],
                              eval_reward_after=run.eval_after.get("eval/reward", run.eval_before["eval/reward"]),
                              output_dir=str(Path(cfg.run.output_dir)))

    def frozen_models(self, cfg: FlowGrpoJobConfig) -> dict[str, str]:
        return cfg.frozen_model_paths

    def encode_payload(self, payload: GroupPayload, tensors: dict[str, Tensor]) -> dict[str, Any]:
        """The group's row and its images' prompts and versions; their trajectories go into `tensors`, one entry per
        field, under ``g<groups saved before>.<field>``."""
        key = f"g{len(tensors) // len(TRAJECTORY_TENSORS)}"
        whole = cat_trajectories([s.trajectory for s in payload.completions])
        tensors.update({f"{key}.{name}": getattr(whole, name) for name in TRAJECTORY_TENSORS})
        return {"row_id": payload.row_id, "tensors": key, "prompts": [s.prompt for s in payload.completions],
                "versions": [s.policy_version for s in payload.completions]}

    def decode_payload(self, entry: dict[str, Any], tensors: dict[str, Tensor], shard: ControllerShard,
                       ctx: ControllerContext) -> GroupPayload:
        whole = Trajectory(**{name: tensors[f"{entry['tensors']}.{name}"] for name in TRAJECTORY_TENSORS})
        samples = []
        for i, (prompt, version) in enumerate(zip(entry["prompts"], entry["versions"], strict=True)):
            trajectory = select_rows(whole, slice(i, i + 1))
            trajectory.version = int(version)
            samples.append(ImageSample(0, i, prompt, trajectory))
        return GroupPayload(row_id=int(entry["row_id"]), completions=samples)

"""The work the cost model prices: a job's data side (`Workload`: prompts, length distributions, dynamic
sampling, images, diffusion), one wave of generation in every slice (`Wave`) and one step's work (`StepWork`).
The simulator draws a run's steps from a `Workload` (`gcore_rl.sim.workload.WorkloadTrace`); dynamic placement's
forecast builds them from a run's counted work (`gcore_rl.costmodel.replay.step_work`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig
from gcore_rl.costmodel.agent import AgentSettings, WaveTurns
from gcore_rl.costmodel.diffusion import DiffusionSettings
from gcore_rl.costmodel.distributions import LengthDistribution
from gcore_rl.costmodel.vision import ImageSettings, TrainedImages, WaveImages
from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class ValidFractionSchedule:
    """Fraction of groups whose rewards differ (valid for GRPO), linear from `start` to `end` over the run."""

    start: float = field(default=1.0, metadata={"help": "Valid fraction at the first step, in (0, 1]."})
    end: float = field(default=1.0, metadata={"help": "Valid fraction at the last step, in (0, 1]; it falls as the policy saturates easy prompts."})

    def validate(self) -> None:
        for key in ("start", "end"):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {getattr(self, key)}")

    def at(self, step: int, steps: int) -> float:
        """Valid fraction at 0-based `step` of `steps`."""
        if steps <= 1:
            return self.start
        return self.start + (self.end - self.start) * step / (steps - 1)


@dataclass(frozen=True)
class Workload:
    """The data side of a simulated GRPO job (per step, over all controllers unless stated)."""

    kind: Literal["text", "diffusion"] = field(default="text", metadata={"help": "text: prompts and generated completions (token lengths below). diffusion: prompts and images of a text-to-image flow model, priced from the `diffusion` section (the token-length settings other than judge_output_tokens and judge_template_tokens are not used)."})
    diffusion: DiffusionSettings = field(default_factory=DiffusionSettings, metadata={"help": "The images of a diffusion workload: denoising and trained steps, resolution, guidance, the reward model's input (read when kind is diffusion)."})
    images: ImageSettings = field(default_factory=ImageSettings, metadata={"help": "Images in each prompt of a text workload (a vision-language policy): their count and size, the vision tower, the CPU cost of decoding and preprocessing them (per_prompt 0 = text only)."})
    agent: AgentSettings = field(default_factory=AgentSettings, metadata={"help": "Multi-turn trajectories of a text workload (an agent with tools or an environment): turns, their lengths, the answers inserted between them and how long each answer takes (turns 1 = single-turn)."})
    single_driver: bool = field(default=False, metadata={"help": "One driver process loads, decodes, preprocesses and ships every controller's rows (the data plane of all K slices, one after another, before any slice starts) instead of each controller its own shard: compare the two to see where one driver stops keeping up."})
    prompts_per_step: int = field(default=256, metadata={"help": "Prompts per step over all controllers (the dynamic-sampling target unless dynamic_sampling.target_groups is set)."})
    group_size: int = field(default=8, metadata={"help": "Completions per prompt (GRPO group, sampling.n)."})
    prompt_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(256.0, 0.4, 2048), metadata={"help": "Prompt lengths."})
    response_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(1024.0, 0.8, 8192), metadata={"help": "Response lengths; max is max_new_tokens."})
    response_growth: float = field(default=0.0, metadata={"help": "Drift of the response median per step (responses get longer as RL training goes on)."})
    refill_response_scale: float = field(default=1.0, metadata={"help": "Factor on the response median of dynamic sampling's refill waves (the second wave of a step on): refills drawn from a pool whose prompts get longer (> 1) or shorter (< 1) answers than the first wave's. 1 = every wave from the same distribution (text workloads)."})
    heavy_shard_scale: float = field(default=1.0, metadata={"help": "Factor on the response median of controller 0's prompts only: one controller's shard persistently heavier than the others' (another task, harder prompts). 1 = every shard from the same distribution (text workloads)."})
    growth: Literal["geometric", "linear"] = field(default="geometric", metadata={"help": "geometric: median x (1+g)^step; linear: median x (1 + g*step)."})
    judge_template_tokens: int = field(default=256, metadata={"help": "Tokens the judge template adds to prompt + response."})
    judge_output_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(256.0, 0.5, 1024), metadata={"help": "Lengths of the judge's verdicts (reasoning + score)."})
    valid_fraction: ValidFractionSchedule = field(default_factory=ValidFractionSchedule, metadata={"help": "Share of groups with differing rewards, over the run."})
    valid_draw: Literal["expected", "binomial"] = field(default="expected", metadata={"help": "Valid groups of a wave: round(prompts x valid fraction) (expected; the same for any number of controllers), or a binomial draw (noisier for small per-controller targets)."})
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig, metadata={"help": "Dynamic sampling (same keys as the trainer's dynamic_sampling section)."})
    payload_bytes_per_prompt: float = field(default=0.0, metadata={"help": "Bytes that travel with each prompt row through its controller (images, video)."})
    judge_reads_payload: bool = field(default=True, metadata={"help": "The judge gets each completion's payload too (multimodal judge): completions x payload bytes more per wave."})
    train_reads_payload: bool = field(default=True, metadata={"help": "The trainer gets each trained sample's payload (multimodal policy)."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes of training over the step's samples."})
    mini_batches: int = field(default=1, metadata={"help": "Optimiser steps per pass (train.mini_batches)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "The trainer recomputes activations in the backward pass (8 N FLOPs per trained token instead of 6 N)."})
    micro_batch_size: int = field(default=8, metadata={"help": "Rows per forward/backward pass on one trainer device (train.micro_batch_size); counts the per-micro-batch overheads."})
    sequence_parallel: int = field(default=1, metadata={"help": "Trainer devices that share every row (train.sequence_parallel, DeepSpeed-Ulysses): each computes 1/N of a row's tokens and exchanges attention's heads by all-to-all; the rows split over devices / N data-parallel groups."})

    def validate(self) -> None:
        for key in ("prompts_per_step", "ppo_epochs", "mini_batches", "micro_batch_size", "sequence_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ConfigError("group_size", f"GRPO needs at least 2 completions per prompt, got {self.group_size}")
        for key in ("refill_response_scale", "heavy_shard_scale"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if self.response_growth <= -1:
            raise ConfigError("response_growth", f"must be > -1, got {self.response_growth}")
        for key in ("judge_template_tokens", "payload_bytes_per_prompt"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.kind == "diffusion" and self.images.enabled:
            raise ConfigError("images.per_prompt", "images ride in the prompts of a text workload; a diffusion "
                              "workload's prompts are text (set per_prompt: 0)")
        if self.kind == "diffusion" and self.agent.enabled:
            raise ConfigError("agent.turns", "multi-turn trajectories are a text workload's; a diffusion workload "
                              "makes one image per sample (set turns: 1)")

    def response_scale(self, step: int) -> float:
        """Factor on the response median at 0-based `step`."""
        if self.growth == "linear":
            return max(0.0, 1.0 + self.response_growth * step)
        return (1.0 + self.response_growth) ** step

    def target_groups(self, controllers: int) -> int:
        """Groups each controller trains on per step."""
        return self.dynamic_sampling.resolve_target(self.prompts_per_step // controllers)


@dataclass(frozen=True)
class Wave:
    """One wave of generation in every slice: arrays over [slice, prompt(, sample)], in tokens."""

    prompts: int
    prompt_tokens: np.ndarray  # [K, P]
    response_tokens: np.ndarray  # [K, P, G]
    judge_output_tokens: np.ndarray  # [K, P, G]
    images: WaveImages | None = None  # the prompts' images (their tokens are in prompt_tokens); None = text only
    turns: WaveTurns | None = None  # multi-turn trajectories (response_tokens = their turns and answers); None = one turn
    # generation results by engine layout and costs: strategies with the same layout share them
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def samples(self) -> int:
        """Completions per slice."""
        return int(self.response_tokens.shape[1] * self.response_tokens.shape[2])

    def take(self, slices: np.ndarray) -> Wave:
        """The wave of the slices `slices` only."""
        return Wave(prompts=self.prompts, prompt_tokens=self.prompt_tokens[slices],
                    response_tokens=self.response_tokens[slices], judge_output_tokens=self.judge_output_tokens[slices],
                    images=None if self.images is None else self.images.take(slices),
                    turns=None if self.turns is None else self.turns.take(slices))

    def take_prompts(self, prompts: np.ndarray) -> Wave:
        """A wave of the prompts `prompts` of every slice (in that order; repeats allowed)."""
        return Wave(prompts=len(prompts), prompt_tokens=self.prompt_tokens[:, prompts],
                    response_tokens=self.response_tokens[:, prompts],
                    judge_output_tokens=self.judge_output_tokens[:, prompts],
                    images=None if self.images is None else self.images.take_prompts(prompts),
                    turns=None if self.turns is None else self.turns.take_prompts(prompts))


@dataclass(frozen=True)
class StepWork:
    """The work of one step: its waves and the rows trained on (per slice)."""

    step: int
    valid_fraction: float
    waves: tuple[Wave, ...]
    trained_groups: int
    valid_groups: int
    trained_lengths: np.ndarray  # [K, trained_groups * G] prompt + response tokens of each trained row, group-major
    trained_images: TrainedImages | None = None  # the trained rows' images; None = text only
    stale_dropped: int = 0  # buffered surplus groups too old to train (their prompts are in this step's first wave)
    # the split of the trained rows over the trainer ranks, by rank count: strategies with as many trainers share it
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def trained_tokens(self) -> np.ndarray:
        """[K] prompt + response tokens of the trained rows of each slice."""
        return self.trained_lengths.sum(axis=1).astype(np.float64)

    @property
    def generated_tokens(self) -> np.ndarray:
        """[K] response tokens generated by each slice over all waves."""
        return sum(w.response_tokens.sum(axis=(1, 2)) for w in self.waves)

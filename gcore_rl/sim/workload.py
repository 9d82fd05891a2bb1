"""What a simulated GRPO job has to do each step: prompts, lengths, waves, payload.

A `Workload` describes the job's data side; `build_step` turns it into the concrete work of one
step (`StepWork`): for every wave of dynamic sampling, the prompt, response and judge-verdict
lengths of every sample of every controller's slice, drawn with `numpy.random.default_rng` from a
seed and the step index, so every strategy simulated from the same scenario sees the same work
(common random numbers: differences between strategies come from placement alone).

`Workload.kind` picks what a sample is: a text completion (`text`, the default) or an image of a
text-to-image flow model (`diffusion`, priced by `gcore_rl.sim.diffusion`). A diffusion wave holds
the same arrays: every prompt has `diffusion.text_tokens` tokens and every sample
`diffusion.image_tokens` (all images cost the same; response lengths and their growth do not
apply), and the judge's verdict lengths are drawn as for text.

Wave sizes come from the project's own dynamic-sampling state machine
(`gcore_rl.algos.dynamic_sampling.WaveSampler`, which sizes each wave with `wave_size`): the simulator
feeds it synthetic groups, valid with the probability the workload's schedule gives for the step.
One sampler stands for every controller: the number of valid groups of a wave is drawn once and
applied to every slice, so all slices run the same waves; their lengths differ.

Surplus valid groups buffered for a later step obey the trainer's age rule (`SurplusRule`): on-policy
strategies keep them for up to `dynamic_sampling.max_surplus_age` updates; strategies that roll out
ahead (disaggregated, streaming) hold them to the staleness bound, and since their generation already
lags the trainer by the bound, a surplus group is always too old one step later: it is dropped and its
prompt joins the next step's first wave, as in the trainer (`WaveSampler.begin_step`).

A text workload's prompts may carry images (`workload.images`, priced by `gcore_rl.sim.vision`): each
wave then also draws every prompt's images (`Wave.images`) from a generator of its own
(`default_rng([seed, step, 1])`), so the text lengths are the same draws with or without images,
and the image tokens are added to the prompt tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig, Group, WaveSampler
from gcore_rl.errors import ConfigError
from gcore_rl.sim.diffusion import DiffusionSettings
from gcore_rl.sim.vision import ImageSettings, TrainedImages, WaveImages, draw_images

_VALID = (1.0, 0.0)
_INVALID = (0.0, 0.0)


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: log-normal with the given median and log-space sigma, rounded, clipped to [min, max]."""

    median: float = field(default=512.0, metadata={"help": "Median length in tokens (before clipping)."})
    sigma: float = field(default=0.5, metadata={"help": "Standard deviation of log(length); 0 gives a fixed length. ~1 gives a long tail."})
    max: int = field(default=4096, metadata={"help": "Largest length (max_new_tokens for responses); longer draws are cut here."})
    min: int = field(default=1, metadata={"help": "Smallest length."})

    def validate(self) -> None:
        if not self.median > 0:
            raise ConfigError("median", f"must be > 0, got {self.median}")
        if self.sigma < 0:
            raise ConfigError("sigma", f"must be >= 0, got {self.sigma}")
        if self.min < 1 or self.max < self.min:
            raise ConfigError("max", f"need 1 <= min <= max, got min={self.min}, max={self.max}")

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...], scale: float | np.ndarray = 1.0) -> np.ndarray:
        """Integer lengths of the given shape; `scale` (a number, or an array that broadcasts to `shape`)
        multiplies the median (drift over training, a heavier shard)."""
        raw = self.median * scale * np.exp(self.sigma * rng.standard_normal(shape))
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)


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

    def response_scale(self, step: int) -> float:
        """Factor on the response median at 0-based `step`."""
        if self.growth == "linear":
            return max(0.0, 1.0 + self.response_growth * step)
        return (1.0 + self.response_growth) ** step

    def target_groups(self, controllers: int) -> int:
        """Groups each controller trains on per step."""
        return self.dynamic_sampling.resolve_target(self.prompts_per_step // controllers)


@dataclass(frozen=True)
class SurplusRule:
    """How old a buffered surplus group may be when trained (the trainer's `surplus_age_bound`).

    `lag`: updates the weights that generate a step's samples lag the trainer that trains them (0 on-policy,
    the staleness bound for strategies that roll out ahead); `max_age`: the most updates a trained group may
    lag (None: no bound).
    """

    lag: int = 0
    max_age: float | None = None

    @classmethod
    def on_policy(cls, workload: Workload) -> SurplusRule:
        """Colocate, partial, dynamic, interleave: generation on the newest weights; surplus up to
        `dynamic_sampling.max_surplus_age` updates old."""
        return cls(lag=0, max_age=workload.dynamic_sampling.max_surplus_age)

    @classmethod
    def ahead(cls, max_staleness: float) -> SurplusRule:
        """Generation `max_staleness` updates ahead (rounded up to whole updates), every sample held to it."""
        return cls(lag=math.ceil(max_staleness), max_age=max_staleness)


@dataclass(frozen=True)
class Wave:
    """One wave of generation in every slice: arrays over [slice, prompt(, sample)], in tokens."""

    prompts: int
    prompt_tokens: np.ndarray  # [K, P]
    response_tokens: np.ndarray  # [K, P, G]
    judge_output_tokens: np.ndarray  # [K, P, G]
    images: WaveImages | None = None  # the prompts' images (their tokens are in prompt_tokens); None = text only
    # generation results by engine layout and costs: strategies with the same layout share them
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def samples(self) -> int:
        """Completions per slice."""
        return int(self.response_tokens.shape[1] * self.response_tokens.shape[2])


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


class WorkloadTrace:
    """Deterministic step-by-step work of a workload over `controllers` slices.

    `step(t)` must be called in order t = 0, 1, ... (the dynamic-sampling state carries over);
    `steps()` yields them all.
    """

    def __init__(self, workload: Workload, controllers: int, steps: int, seed: int = 0,
                 surplus: SurplusRule | None = None):
        if workload.prompts_per_step % controllers:
            raise ConfigError("workload.prompts_per_step", f"{workload.prompts_per_step} prompts cannot be split "
                              f"evenly over {controllers} controllers")
        self.workload = workload
        self.controllers = controllers
        self.total_steps = steps
        self.seed = seed
        self.target = workload.target_groups(controllers)
        self.surplus = SurplusRule.on_policy(workload) if surplus is None else surplus
        self._sampler = WaveSampler(workload.dynamic_sampling, self.target, max_age=self.surplus.max_age)
        self._next = 0

    def steps(self):
        for t in range(self.total_steps):
            yield self.step(t)

    def step(self, t: int) -> StepWork:
        if t != self._next:
            raise RuntimeError(f"WorkloadTrace.step({t}) out of order; expected step {self._next}")
        self._next += 1
        w = self.workload
        rng = np.random.default_rng([self.seed, t])
        image_rng = np.random.default_rng([self.seed, t, 1])  # its own stream: the text draws do not move
        valid_fraction = w.valid_fraction.at(t, self.total_steps)
        scale = w.response_scale(t)
        waves: list[Wave] = []
        self._sampler.begin_step(trained_version=t)  # update t + 1 trains this step, on weights of version t
        version = t - self.surplus.lag
        while (n := self._sampler.next_wave_size()) > 0:
            waves.append(self._wave(rng, image_rng, n, scale * (w.refill_response_scale if waves else 1.0)))
            n_valid = self._valid_count(rng, n, valid_fraction)
            groups = [Group(i, _VALID if i < n_valid else _INVALID, version=version) for i in range(n)]
            self._sampler.add_wave(groups)
        batch = self._sampler.finish_step()
        trained = len(batch.groups)
        return StepWork(step=t, valid_fraction=valid_fraction, waves=tuple(waves), trained_groups=trained,
                        stale_dropped=batch.stale_dropped,
                        valid_groups=batch.num_valid, trained_lengths=_trained_lengths(waves, trained),
                        trained_images=_trained_images(waves, trained))

    def _wave(self, rng: np.random.Generator, image_rng: np.random.Generator, prompts: int, scale: float) -> Wave:
        """One wave of `prompts` prompts per slice, its lengths drawn from `rng` and its images from `image_rng`."""
        w, K, G = self.workload, self.controllers, self.workload.group_size
        if w.kind == "diffusion":
            d = w.diffusion
            return Wave(prompts=prompts, prompt_tokens=np.full((K, prompts), d.text_tokens, dtype=np.int64),
                        response_tokens=np.full((K, prompts, G), d.image_tokens, dtype=np.int64),
                        judge_output_tokens=w.judge_output_tokens.sample(rng, (K, prompts, G)))
        wave = Wave(prompts=prompts, prompt_tokens=w.prompt_tokens.sample(rng, (K, prompts)),
                    response_tokens=w.response_tokens.sample(rng, (K, prompts, G), self._shard_scale(scale)),
                    judge_output_tokens=w.judge_output_tokens.sample(rng, (K, prompts, G)))
        if not w.images.enabled:
            return wave
        images = draw_images(image_rng, w.images, (K, prompts))
        return dataclasses.replace(wave, prompt_tokens=wave.prompt_tokens + images.tokens, images=images)

    def _shard_scale(self, scale: float) -> np.ndarray:
        """[K, 1, 1] the response-median factor of each controller's shard (controller 0's x `heavy_shard_scale`)."""
        out = np.full((self.controllers, 1, 1), scale)
        out[0] *= self.workload.heavy_shard_scale
        return out

    def _valid_count(self, rng: np.random.Generator, prompts: int, valid_fraction: float) -> int:
        """Valid groups among `prompts` new ones (all of them without dynamic sampling)."""
        if not self.workload.dynamic_sampling.enabled:
            return prompts
        if self.workload.valid_draw == "binomial":
            return int(rng.binomial(prompts, valid_fraction))
        return int(round(prompts * valid_fraction))


def _trained_lengths(waves: list[Wave], groups: int) -> np.ndarray:
    """[K, groups * G] tokens (prompt + response) of each row of the first `groups` groups generated in the
    step (`_first_groups`), a group's G rows side by side."""
    rows = _first_groups([w.prompt_tokens[:, :, None] + w.response_tokens for w in waves], groups, total=False)
    return rows.reshape(rows.shape[0], -1)


def _trained_images(waves: list[Wave], groups: int) -> TrainedImages | None:
    """The images of the first `groups` groups (`_first_groups`): their patches (each group's once) and the
    vision-tower FLOPs of every row (each row of a group runs its prompt's images through the tower)."""
    if waves[0].images is None:
        return None
    group_size = waves[0].response_tokens.shape[2]
    return TrainedImages(patches=_first_groups([w.images.patches for w in waves], groups),
                         flops=_first_groups([w.images.flops * group_size for w in waves], groups))


def _first_groups(per_wave: list[np.ndarray], groups: int, total: bool = True) -> np.ndarray:
    """[K] sum of a per-group quantity ([K, prompts, ...] per wave) over the first `groups` groups generated
    in the step, cycled if the step made fewer; with `total` false, those groups' values ([K, groups, ...]).

    Buffered groups from earlier steps and padding groups have the same length distribution, so
    the step's own groups stand in for them.
    """
    per_group = np.concatenate(per_wave, axis=1)  # [K, groups generated, ...]
    generated = per_group.shape[1]
    reps = math.ceil(groups / generated)
    first = np.tile(per_group, (1, reps) + (1,) * (per_group.ndim - 2))[:, :groups]
    return first.sum(axis=1).astype(np.float64) if total else first

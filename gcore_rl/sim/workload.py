"""What a simulated GRPO job has to do each step: prompts, lengths, waves, payload.

A `Workload` (gcore_rl/costmodel/work.py) describes the job's data side; `WorkloadTrace` turns it into the concrete work of one
step (`StepWork`): for every wave of dynamic sampling, the prompt, response and judge-verdict
lengths of every sample of every controller's slice, drawn with `numpy.random.default_rng` from a
seed and the step index, so every strategy simulated from the same scenario sees the same work
(common random numbers: differences between strategies come from placement alone).

`Workload.kind` picks what a sample is: a text completion (`text`, the default) or an image of a
text-to-image flow model (`diffusion`, priced by `gcore_rl.costmodel.diffusion`). A diffusion wave holds
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

A text workload's prompts may carry images (`workload.images`, priced by `gcore_rl.costmodel.vision`): each
wave then also draws every prompt's images (`Wave.images`) from a generator of its own
(`default_rng([seed, step, 1])`), so the text lengths are the same draws with or without images,
and the image tokens are added to the prompt tokens.

A multi-turn workload (`workload.agent`, priced by `gcore_rl.costmodel.agent`) draws every trajectory's turns,
answers and answer latencies (`Wave.turns`) from a third generator (`default_rng([seed, step, 2])`); a
trajectory's response length is then its turns' and answers' tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gcore_rl.algos.dynamic_sampling import Group, WaveSampler
from gcore_rl.costmodel.agent import draw_turns
from gcore_rl.costmodel.vision import TrainedImages, draw_images
from gcore_rl.costmodel.work import LengthDistribution, StepWork, ValidFractionSchedule, Wave, Workload
from gcore_rl.errors import ConfigError

_VALID = (1.0, 0.0)
_INVALID = (0.0, 0.0)


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
        turn_rng = np.random.default_rng([self.seed, t, 2])  # the same for a multi-turn workload's turns
        valid_fraction = w.valid_fraction.at(t, self.total_steps)
        scale = w.response_scale(t)
        waves: list[Wave] = []
        self._sampler.begin_step(trained_version=t)  # update t + 1 trains this step, on weights of version t
        version = t - self.surplus.lag
        while (n := self._sampler.next_wave_size()) > 0:
            waves.append(self._wave((rng, image_rng, turn_rng), n, scale * (w.refill_response_scale if waves else 1.0)))
            n_valid = self._valid_count(rng, n, valid_fraction)
            groups = [Group(i, _VALID if i < n_valid else _INVALID, version=version) for i in range(n)]
            self._sampler.add_wave(groups)
        batch = self._sampler.finish_step()
        trained = len(batch.groups)
        return StepWork(step=t, valid_fraction=valid_fraction, waves=tuple(waves), trained_groups=trained,
                        stale_dropped=batch.stale_dropped,
                        valid_groups=batch.num_valid, trained_lengths=_trained_lengths(waves, trained),
                        trained_images=_trained_images(waves, trained))

    def _wave(self, rngs: tuple[np.random.Generator, ...], prompts: int, scale: float) -> Wave:
        """One wave of `prompts` prompts per slice: its lengths drawn from `rngs[0]`, its images from `rngs[1]` and
        its trajectories' turns from `rngs[2]`."""
        rng, image_rng, turn_rng = rngs
        w, K, G = self.workload, self.controllers, self.workload.group_size
        if w.kind == "diffusion":
            d = w.diffusion
            return Wave(prompts=prompts, prompt_tokens=np.full((K, prompts), d.text_tokens, dtype=np.int64),
                        response_tokens=np.full((K, prompts, G), d.image_tokens, dtype=np.int64),
                        judge_output_tokens=w.judge_output_tokens.sample(rng, (K, prompts, G)))
        wave = Wave(prompts=prompts, prompt_tokens=w.prompt_tokens.sample(rng, (K, prompts)),
                    response_tokens=w.response_tokens.sample(rng, (K, prompts, G), self._shard_scale(scale)),
                    judge_output_tokens=w.judge_output_tokens.sample(rng, (K, prompts, G)))
        if w.agent.enabled:
            turns = draw_turns(turn_rng, w.agent, (K, prompts, G), self._shard_scale(scale))
            wave = dataclasses.replace(wave, response_tokens=turns.total_tokens, turns=turns)
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


__all__ = ["LengthDistribution", "StepWork", "SurplusRule", "ValidFractionSchedule", "Wave", "Workload", "WorkloadTrace"]

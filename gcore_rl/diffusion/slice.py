"""A diffusion controller's view of its device slice: the language jobs' `SliceClient` (the weight sync, checkpoints,
the final model, step bookkeeping and utilisation, over the same `WorkerAPI`) with the rollout and the update of
images.

Prompts are cut into chunks of `sampling.batch_size` images, dealt round-robin to the slice's rollout devices
(`WorkerAPI.generate_stream` with an `ImageRollout`; chunk c sampled with seed ``seed·1009 + c``); when a chunk's
images are done its rule rewards are computed here (`on_images`) and, when the plan has reward-model devices, the
images go to one of them at once (round-robin), so under `partial` scoring overlaps the sampling of later chunks.
Trajectories never leave the controller and its slice. Rows are split over the slice's trainers in equal
contiguous parts (`ImageRows`); `sync` has every trainer gather the new weights (a collective of the trainer
group) into its own engine, and under a plan whose rollout devices hold no trainer (`disaggregated`) the slice's
publishing trainer streams them to those devices (`SliceClient.sync_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gcore_rl.controller.handles import END, WorkerHandle, next_item, results, wait_any
from gcore_rl.controller.slice import WEIGHT_BUCKET_BYTES, SliceClient, reduce_stats
from gcore_rl.controller.worker_api import WorkerAPI
from gcore_rl.diffusion.dynamic import ChunkWork
from gcore_rl.diffusion.images import to_arrays
from gcore_rl.diffusion.sampler import ImageRollout, ImageSamplingConfig, Trajectory
from gcore_rl.diffusion.trainer import ImageRows
from gcore_rl.placement.plan import Plan, WorkerSpec
from gcore_rl.records import RewardInput


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """One trajectory of the parts' images, in order (they share the time grid)."""
    return Trajectory(latents=torch.cat([p.latents for p in parts]), logprobs=torch.cat([p.logprobs for p in parts]),
                      times=parts[0].times, images=torch.cat([p.images for p in parts]))


def select_rows(trajectory: Trajectory, rows: slice) -> Trajectory:
    return Trajectory(latents=trajectory.latents[rows], logprobs=trajectory.logprobs[rows], times=trajectory.times,
                      images=trajectory.images[rows])


@dataclass
class Sampling:
    """A started sampling: each chunk's stream and its first prompt's index, and the prompts."""

    pending: dict
    prompts: list[str]


class FlowSlice(SliceClient):
    """The devices of one controller (`handles[i]` is the worker of `specs[i]`) under `plan`, sampling with `sampling`."""

    def __init__(self, handles: Sequence[WorkerHandle], specs: Sequence[WorkerSpec], plan: Plan,
                 sampling: ImageSamplingConfig, bucket_bytes: int = WEIGHT_BUCKET_BYTES):
        super().__init__(handles, specs, plan, bucket_bytes=bucket_bytes)
        self.sampling = sampling
        self.version = 0  # the update whose weights the slice's engines hold (or are loading)

    def start_sampling(self, prompts: list[str], seed: int, deterministic: bool = False) -> Sampling:
        """Deal `prompts` in chunks to the rollout devices and return at once (Ray: the devices work on while
        the controller does something else, e.g. trains the previous batch under `disaggregated`)."""
        request = ImageRollout(self.sampling, deterministic)
        chunk = self.sampling.batch_size
        pending = {}
        for c, start in enumerate(range(0, len(prompts), chunk)):
            device = self.rollout[c % len(self.rollout)]
            pending[device.stream(WorkerAPI.generate_stream, prompts[start:start + chunk], request, seed * 1009 + c)] = start
        return Sampling(pending, list(prompts))

    def finish_sampling(self, sampling: Sampling, on_images: Callable[[int, Tensor], None]) -> tuple[Trajectory, list[float] | None]:
        """Wait for a started sampling: the images (in prompt order) and, with reward-model devices, their scores.

        `on_images(start, images)` is called for each finished chunk (its first prompt's index and its
        images) as soon as it is there; with reward-model devices the chunk's images go to one of them
        at once (round-robin), so scoring overlaps the sampling of the chunks still running.
        """
        pending = dict(sampling.pending)
        parts: dict[int, Trajectory] = {}
        scoring: dict[int, object] = {}
        while pending:
            for stream in wait_any(list(pending)):
                chunk = next_item(stream)
                if chunk is END:
                    del pending[stream]
                    continue
                start, part = pending[stream], chunk[0]
                parts[start] = part
                on_images(start, part.images)
                if self.scorers:
                    scorer = self.scorers[len(scoring) % len(self.scorers)]
                    inputs = [RewardInput(prompt=prompt, completion=image, row={}) for prompt, image in
                              zip(sampling.prompts[start:start + len(part)], to_arrays(part.images), strict=True)]
                    scoring[start] = scorer.call(WorkerAPI.score_samples, inputs)
        ordered = sorted(parts)
        scores = None
        if self.scorers:  # one model scores a diffusion job's images: the verdicts of its kind
            scores = [verdict.reward for answer in results([scoring[s] for s in ordered])
                      for verdict in next(iter(answer.values()))]
        return cat_trajectories([parts[s] for s in ordered]), scores

    def chunk_work(self, sampling: Sampling) -> ChunkWork:
        """The counted work of a finished sampling of this step (under a rebalancing plan, whose devices began the
        step before it): its chunks and scoring calls, and the seconds the slice's devices spent on each side."""
        loads = results([h.call(WorkerAPI.device_load) for h in self.handles])
        chunks = len(sampling.pending)
        return ChunkWork(chunks=chunks, sample_s=sum(load.generate_s for load in loads),
                         score_calls=chunks if self.scorers else 0, score_s=sum(load.score_s for load in loads),
                         rollout_devices=len(self.rollout))

    def sample_and_score(self, prompts: list[str], seed: int, on_images: Callable[[int, Tensor], None],
                         deterministic: bool = False) -> tuple[Trajectory, list[float] | None]:
        """`start_sampling` and `finish_sampling` in one."""
        return self.finish_sampling(self.start_sampling(prompts, seed, deterministic), on_images)

    def train_images(self, prompts: list[str], trajectory: Trajectory, advantages: Tensor, seed: int) -> dict[str, float]:
        """Train on the step's rows, split evenly over the slice's trainers; the mean of their statistics (the
        largest of those whose key ends in ``max``)."""
        n = len(self.trainers)
        if len(prompts) % n:
            raise ValueError(f"{len(prompts)} trajectories cannot be split evenly over {n} trainer devices")
        size = len(prompts) // n
        calls = [h.call(WorkerAPI.train, ImageRows(prompts[k * size:(k + 1) * size],
                                                   select_rows(trajectory, slice(k * size, (k + 1) * size)),
                                                   advantages[k * size:(k + 1) * size], seed))
                 for k, h in enumerate(self.trainers)]
        return reduce_stats(results(calls))

    def sync(self, version: int) -> None:
        """New weights in every engine of the slice (`SliceClient.sync_weights`). Under Ray an engine still sampling
        a batch started before loads them when that batch is done (its calls run in order)."""
        self.version = version
        self.sync_weights(version)


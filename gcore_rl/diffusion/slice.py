"""A diffusion controller's view of its device slice: the language jobs' `SliceClient` (the weight sync, checkpoints,
the final model, step bookkeeping and utilisation, over the same `WorkerAPI`) with the rollout and the update of
images.

Prompts are cut into chunks of `sampling.batch_size` images, dealt round-robin to the slice's rollout devices
(`WorkerAPI.generate_stream` with an `ImageRollout`; chunk c sampled with seed ``seed·1009 + c``); when a chunk's
images are done its rule rewards are computed here (`on_images`) and, when the plan has reward-model devices, the
images go to one of them at once (round-robin), so under `partial` scoring overlaps the sampling of later chunks.
Trajectories never leave the controller and its slice. Rows are split over the slice's trainers in equal
contiguous parts (`ImageRows`). The weight sync is the language jobs' (`SliceClient.sync_weights`, `publish`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gcore_rl.controller.handles import END, WorkerHandle, next_item, results, wait_any
from gcore_rl.controller.slice import WEIGHT_BUCKET_BYTES, SliceClient
from gcore_rl.controller.worker_api import WorkerAPI
from gcore_rl.diffusion.images import to_arrays
from gcore_rl.diffusion.sampler import ImageRollout, ImageSamplingConfig, Trajectory
from gcore_rl.diffusion.trainer import ImageRows
from gcore_rl.placement.plan import Plan, WorkerSpec
from gcore_rl.records import RewardInput, Verdict


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """One trajectory of the parts' images, in order (they share the time grid; the oldest version is kept)."""
    return Trajectory(latents=torch.cat([p.latents for p in parts]), logprobs=torch.cat([p.logprobs for p in parts]),
                      times=parts[0].times, images=torch.cat([p.images for p in parts]),
                      version=min(p.version for p in parts))


def select_rows(trajectory: Trajectory, rows: slice) -> Trajectory:
    return Trajectory(latents=trajectory.latents[rows], logprobs=trajectory.logprobs[rows], times=trajectory.times,
                      images=trajectory.images[rows], version=trajectory.version)


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

    def start_sampling(self, prompts: list[str], seed: int, deterministic: bool = False) -> Sampling:
        """Deal `prompts` in chunks to the rollout devices and return at once (Ray: the devices work on while
        the controller does something else)."""
        request = ImageRollout(self.sampling, deterministic)
        chunk = self.sampling.batch_size
        pending = {}
        for c, start in enumerate(range(0, len(prompts), chunk)):
            device = self.rollout[c % len(self.rollout)]
            pending[device.stream(WorkerAPI.generate_stream, prompts[start:start + chunk], request, seed * 1009 + c)] = start
        return Sampling(pending, list(prompts))

    def finish_sampling(self, sampling: Sampling, on_images: Callable[[int, Tensor], None],
                        ) -> tuple[Trajectory, dict[str, list[Verdict]]]:
        """Wait for a started sampling: the images (in prompt order) and the verdicts of the reward devices'
        model on them, by kind ({} without reward-model devices).

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
        verdicts: dict[str, list[Verdict]] = {}
        for answer in results([scoring[s] for s in ordered]) if self.scorers else []:
            for kind, said in answer.items():
                verdicts.setdefault(kind, []).extend(said)
        return cat_trajectories([parts[s] for s in ordered]), verdicts

    def sample_and_score(self, prompts: list[str], seed: int, on_images: Callable[[int, Tensor], None],
                         deterministic: bool = False) -> tuple[Trajectory, dict[str, list[Verdict]]]:
        """`start_sampling` and `finish_sampling` in one."""
        return self.finish_sampling(self.start_sampling(prompts, seed, deterministic), on_images)

    def start_train_images(self, prompts: list[str], trajectory: Trajectory, advantages: Tensor, seed: int) -> list:
        """Send the step's rows, split evenly over the slice's trainers, to them; the pending results
        (`SliceClient.finish_train`: the mean of their statistics, the largest of those whose key ends in ``max``)."""
        n = len(self.trainers)
        if len(prompts) % n:
            raise ValueError(f"{len(prompts)} trajectories cannot be split evenly over {n} trainer devices")
        size = len(prompts) // n
        self.balance = {}
        calls = [h.call(WorkerAPI.train, ImageRows(prompts[k * size:(k + 1) * size],
                                                   select_rows(trajectory, slice(k * size, (k + 1) * size)),
                                                   advantages[k * size:(k + 1) * size], seed))
                 for k, h in enumerate(self.trainers)]
        return [calls, []]

"""A diffusion controller's view of its device slice: sample on the rollout devices, stream finished images to
the reward devices, train on the trainer devices, sync weights — whatever the placement plan says is where.

Prompts are cut into chunks of `sampling.batch_size` images, dealt round-robin to the slice's rollout
devices; when a chunk's images are done its rule rewards are computed here (`on_images`) and, when the
plan has reward-model devices, the images go to one of them at once (round-robin), so under `partial`
scoring overlaps the sampling of later chunks. Trajectories never leave the controller and its slice.
Rows are split over the slice's trainers in equal contiguous parts; `sync` has every trainer gather
the new weights (a collective of the trainer group), and under a plan whose rollout devices hold no
trainer (`disaggregated`) the slice's publishing trainer hands them to those devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gcore_rl.controller.handles import WorkerHandle, result, results, wait_any
from gcore_rl.diffusion.dynamic import ChunkWork
from gcore_rl.diffusion.sampler import Trajectory
from gcore_rl.diffusion.worker import FlowWorker
from gcore_rl.placement.plan import Plan, WorkerSpec


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """One trajectory of the parts' images, in order (they share the time grid)."""
    return Trajectory(latents=torch.cat([p.latents for p in parts]), logprobs=torch.cat([p.logprobs for p in parts]),
                      times=parts[0].times, images=torch.cat([p.images for p in parts]))


def select_rows(trajectory: Trajectory, rows: slice) -> Trajectory:
    return Trajectory(latents=trajectory.latents[rows], logprobs=trajectory.logprobs[rows], times=trajectory.times,
                      images=trajectory.images[rows])


@dataclass
class Sampling:
    """A started sampling: each chunk's pending result and its first prompt's index, the prompts, and (under a
    rebalancing plan) each device's count of recorded calls before it started (`chunk_work` reads those after)."""

    pending: dict
    prompts: list[str]
    marks: dict[int, object] = field(default_factory=dict)


class FlowSlice:
    """The devices of one controller (`handles[i]` is the worker of `specs[i]`) under `plan`."""

    def __init__(self, handles: Sequence[WorkerHandle], specs: Sequence[WorkerSpec], plan: Plan, chunk: int):
        self.handles = list(handles)
        self.specs = list(specs)
        self.plan = plan
        self.chunk = chunk
        self._trainers = [i for i, s in enumerate(specs) if s.trainer_rank is not None]
        self.apply_plan(plan)
        self.version = 0  # the update whose weights the slice's engines hold (or are loading)

    def apply_plan(self, plan: Plan) -> None:
        """Sample and score where `plan` says, from the next sampling on (a dynamic move: every device of a
        rebalancing slice hosts the engine and the reward model, and all of them train and hold the weights)."""
        self.plan = plan
        devices = [s.device for s in self.specs]
        self._rollout = [i for i, d in enumerate(devices) if d in plan.devices_of("rollout", "rollout")]
        self._scorers = [i for i, d in enumerate(devices) if d in plan.devices_of("rollout", "reward_model")]

    @property
    def scores_images(self) -> bool:
        """Whether the slice has an image reward model."""
        return bool(self._scorers)

    def start_sampling(self, prompts: list[str], seed: int, deterministic: bool = False) -> Sampling:
        """Deal `prompts` in chunks to the rollout devices and return at once (Ray: the devices work on while
        the controller does something else, e.g. trains the previous batch under `disaggregated`).
        Chunk c is sampled with seed ``seed·1009 + c``."""
        marks = ({i: handle.call(FlowWorker.calls_made) for i, handle in enumerate(self.handles)}
                 if self.plan.traits.rebalances else {})
        pending = {}
        for c, start in enumerate(range(0, len(prompts), self.chunk)):
            worker = self.handles[self._rollout[c % len(self._rollout)]]
            pending[worker.call(FlowWorker.sample, prompts[start:start + self.chunk], seed * 1009 + c, deterministic)] = start
        return Sampling(pending, list(prompts), marks)

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
            for item in wait_any(list(pending)):
                start = pending.pop(item)
                part = result(item)
                parts[start] = part
                on_images(start, part.images)
                if self._scorers:
                    scorer = self.handles[self._scorers[len(scoring) % len(self._scorers)]]
                    scoring[start] = scorer.call(FlowWorker.score, part.images,
                                                 sampling.prompts[start:start + len(part.images)])
        ordered = sorted(parts)
        scores = None
        if self._scorers:
            scores = [s for start, values in zip(ordered, results([scoring[s] for s in ordered]), strict=True) for s in values]
        return cat_trajectories([parts[s] for s in ordered]), scores

    def chunk_work(self, sampling: Sampling) -> ChunkWork:
        """The counted work of a finished sampling (a rebalancing plan's, whose `marks` were taken): its chunks
        and the seconds of every `sample` and `score` call the slice's devices made for it."""
        since = {i: result(mark) for i, mark in sampling.marks.items()}
        calls = results([self.handles[i].call(FlowWorker.timeline, count) for i, count in since.items()])
        seconds: dict[str, list[float]] = {"sample": [], "score": []}
        for events in calls:
            for what, start, end in events:
                seconds[what].append(end - start)
        return ChunkWork(chunks=len(sampling.pending), sample_s=seconds["sample"], score_s=seconds["score"],
                         rollout_devices=len(self._rollout))

    def sample_and_score(self, prompts: list[str], seed: int, on_images: Callable[[int, Tensor], None],
                         deterministic: bool = False) -> tuple[Trajectory, list[float] | None]:
        """`start_sampling` and `finish_sampling` in one."""
        return self.finish_sampling(self.start_sampling(prompts, seed, deterministic), on_images)

    def train(self, prompts: list[str], trajectory: Trajectory, advantages: Tensor, seed: int) -> dict[str, float]:
        """Train on the step's rows, split evenly over the slice's trainers; the mean of their statistics (the
        largest of those whose key ends in ``max``)."""
        n = len(self._trainers)
        if len(prompts) % n:
            raise ValueError(f"{len(prompts)} trajectories cannot be split evenly over {n} trainer devices")
        size = len(prompts) // n
        calls = [self.handles[i].call(FlowWorker.train, prompts[k * size:(k + 1) * size],
                                      select_rows(trajectory, slice(k * size, (k + 1) * size)),
                                      advantages[k * size:(k + 1) * size], seed)
                 for k, i in enumerate(self._trainers)]
        stats = results(calls)
        return {key: max(s[key] for s in stats) if key.endswith("max") else sum(s[key] for s in stats) / n
                for key in stats[0]}

    def sync(self, version: int) -> None:
        """New weights into every engine of the slice (see the module docstring). Under Ray an engine still
        sampling a batch started before loads them when that batch is done (its calls run in order)."""
        self.version = version
        results([self.handles[i].call(FlowWorker.sync, version) for i in self._trainers])
        if not self.plan.traits.publishes_weights:
            return
        publisher = next(i for i in self._trainers if self.specs[i].publishes_weights)
        weights = result(self.handles[publisher].call(FlowWorker.publish))
        results([self.handles[i].call(FlowWorker.load_weights, weights, version)
                 for i in self._rollout if self.specs[i].trainer_rank is None])

    def save_checkpoint(self, directory: str) -> None:
        """Have the slice's trainers stage their state and start writing it into `directory`."""
        results([self.handles[i].call(FlowWorker.save_checkpoint, directory) for i in self._trainers])

    def finish_checkpoint(self) -> float:
        """Wait for the trainers' checkpoint writes; the longest wait in seconds."""
        return max(results([self.handles[i].call(FlowWorker.finish_checkpoint) for i in self._trainers]), default=0.0)

    def load_checkpoint(self, directory: str) -> None:
        """Restore the slice's trainers from the checkpoint folder `directory` (a collective over all trainers)."""
        results([self.handles[i].call(FlowWorker.load_checkpoint, directory) for i in self._trainers])

    def save_policy(self, path: str) -> None:
        """Write the policy from the slice's first rollout device (whose engine holds the synced weights)."""
        result(self.handles[self._rollout[0]].call(FlowWorker.save_policy, path))

    def timelines(self) -> dict[int, list[tuple[str, float, float]]]:
        """Each device's recorded `sample` and `score` calls, by device."""
        return {spec.device: timeline for spec, timeline in
                zip(self.specs, results([h.call(FlowWorker.timeline) for h in self.handles]), strict=True)}

    def close(self) -> None:
        results([handle.call(FlowWorker.close) for handle in self.handles])

"""What a controller may ask of a device worker: the typed boundary between the two.

`WorkerAPI` is a Protocol with the worker methods a controller calls and the records that travel
each way (`records.py`, `DeviceLoad`). `runtime/device_worker.py:DeviceWorker` implements it (a test
holds the signatures together); a controller calls it through a `WorkerHandle`
(`handle.call(WorkerAPI.train, batch)`), the same way whether the worker is an object in its own
process or a Ray actor, so a misspelt method or a wrong argument list fails at the call site.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from gcore_rl.placement.rebalance import DeviceLoad
from gcore_rl.records import Completion, EngineRounds, ModelScores, RewardInput, RolloutWork, TokenBatch
from gcore_rl.rollout.sampling import SamplingConfig


class WorkerAPI(Protocol):
    """The device worker's methods, as its controller sees them (see `DeviceWorker` for what each does)."""

    def generate_stream(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                        seed: int) -> Iterator[list[Completion]]:
        """Completions of `prompt_ids` (indices relative to it) in chunks, as they finish, made by the job's
        rollout function beside the device's engine (each may carry a loss mask)."""
        ...

    def score_samples(self, samples: list[RewardInput]) -> ModelScores:
        """The reward models' scores of `samples`, in input order."""
        ...

    def reference_logprobs(self, completions: list[Completion]) -> list[list[float]]:
        """The frozen reference's log-probs of each completion's tokens, in input order (`interleave`)."""
        ...

    def train(self, batch: TokenBatch) -> dict[str, float]:
        """Prepare and train on this worker's rows of the step; the update's statistics."""
        ...

    def critic_step(self, batch: TokenBatch) -> Iterator[torch.Tensor | dict[str, float]]:
        """A critic device's rows: their values `[B, T]` first, then the critic update's statistics."""
        ...

    def sync_weights(self, version: int, load: bool = True) -> None:
        """Take part in gathering the weights of update `version`; load them into this device's engine when `load`."""
        ...

    def publish_weights(self, bucket_bytes: int, version: int = 0, load: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The new weights in buckets (the slice's publishing trainer; the others yield nothing); with `load`
        the trainer's own engine takes them too, as update `version`."""
        ...

    def load_weights(self, weights: dict[str, torch.Tensor], version: int, final: bool = True) -> int:
        """Load a published bucket of update `version` into this device's engine; `final` ends the update."""
        ...

    def begin_step(self, step: int) -> None:
        """Start the step's bookkeeping (timeline, work counters)."""
        ...

    def device_load(self) -> DeviceLoad:
        """How long each side of the rollout phase has kept this device busy so far in the step."""
        ...

    def rollout_work(self) -> RolloutWork:
        """What the rollout phase has done on this device so far in the step, counted (tokens, samples)."""
        ...

    def engine_rounds(self) -> dict[str, EngineRounds]:
        """Each generation engine's decode rounds and work so far in the step, by role, with its busy seconds."""
        ...

    def utilisation(self, step_seconds: float) -> dict[str, float]:
        """The step's busy / swap / idle seconds, work counters and memory, as metrics."""
        ...

    def save_checkpoint(self, directory: str) -> None:
        """Start writing this trainer's state into the checkpoint folder (returns once it is staged)."""
        ...

    def finish_checkpoint(self) -> float:
        """Wait until the checkpoint write in flight is complete; the seconds waited."""
        ...

    def load_checkpoint(self, directory: str) -> None:
        """Restore this trainer's state from a checkpoint folder (a collective over all trainers)."""
        ...

    def save_policy(self, path: str) -> None:
        """Write the current policy as a Hugging Face model folder."""
        ...

    def close(self) -> None:
        """Close the timeline and leave the trainer group."""
        ...

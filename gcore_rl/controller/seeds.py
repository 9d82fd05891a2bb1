"""Every random seed of a controller's step, derived in one place from `run.seed`.

A rerun with the same config draws the same prompts and samples the same completions: the
step's base seed depends on the run seed, the step and the controller (so controllers sample
differently), each wave of dynamic sampling and each rollout device of a wave get their own seed
derived from it, and greedy evaluation is seeded by the run seed alone. The global generators
(python, numpy, torch) of every process are reseeded at the start of each step from (run seed,
step, process) (`seed_global_rngs`), so nothing random carries over from one step to the next: a
run resumed from a checkpoint draws what the uninterrupted run drew, on any number of processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepSeeds:
    """The seeds of one controller's step (`step_seeds`)."""

    rollout: int
    """Base of the step's sampling seeds."""

    def wave(self, index: int) -> int:
        """Sampling seed of the step's wave `index` (dynamic sampling draws waves until the step is full)."""
        return self.rollout * 31 + index


def step_seeds(run_seed: int, step: int, controller: int) -> StepSeeds:
    """The seeds of `step` on `controller`."""
    return StepSeeds(rollout=run_seed * 100_003 + step * 97 + controller)


def evaluation_seed(run_seed: int) -> int:
    """Seed of greedy held-out evaluation: the same at every step, so evaluations compare like with like."""
    return run_seed


def device_seed(call_seed: int, device_index: int) -> int:
    """Sampling seed of the `device_index`-th rollout device's share of one generate call."""
    return call_seed + 7919 * device_index


def seed_global_rngs(run_seed: int, step: int, process: int) -> None:
    """Reseed python's, numpy's and torch's global generators for `step` in the `process`-th
    controller or device worker (distinct from every sampling seed above)."""
    seed = (run_seed * 1_000_003 + step * 8191 + process * 131 + 17) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

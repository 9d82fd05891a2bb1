"""Dynamic placement of a diffusion job: the forecast of its rollout phase at every split of a slice, for the
shared rebalancing (`controller/rebalancing.py`'s `rebalance_split`, `placement.strategy: dynamic`).

A diffusion rollout is made of equal work units: a step's P·n images are cut into C chunks of
`sampling.batch_size`, shared out over the R rollout devices, and each finished chunk is scored by the next free
of the D − R reward devices (`SliceClient.rollout_and_score`). What a chunk costs to sample
(s) and to score (r) does not depend on how many devices there are (on devices of their own; logical
devices that share a CPU's cores slow each other, which the rebalancer's per-split correction absorbs), so the
step's counted work — C chunks (`ImageWork`), and the mean seconds of sampling a chunk and of scoring one, from
the busy seconds of the devices that ran them (`SliceClient.rollout_load`) — prices every other split
(`phase_seconds`): the forecast is work, not occupancy, and it does not move when devices move (issue 15's
point for the text judge, whose batches do change with its devices). `ChunkForecaster` is that forecast in the
form `rebalance_split` asks of a language job's `RolloutForecaster`; every controller then decides alike from
the all-reduced figures.

Every device of a dynamic slice hosts both the image engine and the reward model (loaded once; nothing
sleeps on a CPU), and every device trains, so a move only changes where the controller sends the next
step's chunks: its swap cost is zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gcore_rl.controller.forecast import FORECAST_PREFIX
from gcore_rl.placement.rebalance import RolloutLoad

__all__ = ["phase_seconds", "forecast", "ImageWork", "ChunkForecaster"]


def phase_seconds(chunks: int, rollout: int, scorers: int, sample_s: float, score_s: float) -> float:
    """The rollout phase of `chunks` equal chunks: dealt round-robin to `rollout` devices (chunk c is the
    (c // rollout + 1)-th on its device, done at that multiple of `sample_s`), each scored on the next of
    `scorers` reward devices in finishing order as soon as it is done, a device scoring one chunk at a time
    for `score_s` seconds. With no scorers the phase is the sampling alone."""
    if chunks <= 0:
        return 0.0
    done = [(c // rollout + 1) * sample_s for c in range(chunks)]  # already in finishing order
    if scorers <= 0:
        return done[-1]
    free = [0.0] * scorers
    for index, finished in enumerate(done):
        device = index % scorers
        free[device] = max(free[device], finished) + score_s
    return max(max(free), done[-1])


def forecast(chunks: int, slice_devices: int, sample_s: float, score_s: float) -> tuple[float, ...]:
    """`phase_seconds` at every split of a slice: entry r - 1 for r rollout devices, r = 1 .. D - 1."""
    return tuple(phase_seconds(chunks, r, slice_devices - r, sample_s, score_s) for r in range(1, slice_devices))


@dataclass(frozen=True)
class ImageWork:
    """One wave's counted rollout work: its chunks, and whether each was scored by a reward device."""

    chunks: int
    scored: bool


class ChunkForecaster:
    """The rollout phase of a step's chunks at every split of a slice of `slice_devices` (see the module
    docstring), as `rebalance_split` asks a forecaster for it."""

    fits_engines = False  # the image engine has no decode rounds to fit

    def __init__(self, slice_devices: int):
        self.slice_devices = slice_devices

    def forecast(self, waves: Sequence[ImageWork], load: RolloutLoad, rounds: object = None) -> dict[str, float]:
        """`forecast/<r>/max` for r = 1 .. D - 1 rollout devices (the slowest controller's, once reduced), from the
        waves' chunks and the mean seconds of sampling and scoring one in `load`, this step's measured load."""
        chunks = sum(work.chunks for work in waves)
        scored = sum(work.chunks for work in waves if work.scored)
        sample_s = load.generate_busy_s / chunks if chunks else 0.0
        score_s = load.score_busy_s / scored if scored else 0.0
        return {f"{FORECAST_PREFIX}{r}/max": seconds
                for r, seconds in enumerate(forecast(chunks, self.slice_devices, sample_s, score_s), 1)}

    def vector(self, reduced: dict[str, float]) -> tuple[float, ...]:
        """`RolloutLoad.forecast` from the reduced `forecast/<r>/max` entries."""
        return tuple(reduced[f"{FORECAST_PREFIX}{r}/max"] for r in range(1, self.slice_devices))

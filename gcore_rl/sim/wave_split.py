"""Re-splitting a slice between the waves of a step: dynamic placement's finer move (simulator).

Between steps dynamic placement picks the split from the step's counted work. Inside a step,
dynamic sampling runs several waves; a refill wave of another kind (prompts drawn from a pool
whose answers are longer, a judge that reasons longer on them) may want another split. At each
wave boundary the controller knows the wave it just finished, counted in tokens, and the size of
the next wave (the sampler sizes a refill from the step's deficit before it starts). The guess
for the next wave is the finished wave's lengths, repeated to the next wave's size (`like`); it
is replayed through the simulator's phase model at the splits within one move, and a move is
taken only if the replayed saving on that one wave exceeds the move's price (`choose`): the
moved devices' engines change role, which the step waits for
(`gcore_rl.sim.strategies.wave_move_seconds`). The horizon is the next wave alone; the step's
own rebalancer sets the split again for the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gcore_rl.sim.workload import Wave


def like(wave: Wave, prompts: int) -> Wave:
    """A wave of `prompts` prompts per slice whose lengths are `wave`'s: prompt i takes the lengths
    (prompt tokens, its G responses, their verdicts) of `wave`'s prompt i mod P."""
    return wave.take_prompts(np.arange(prompts) % wave.prompts)


def heaviest_slices(wave: Wave, count: int) -> np.ndarray:
    """The `count` slices (sorted) with the most tokens to generate and judge in `wave`: those the step waits for."""
    work = wave.response_tokens.sum(axis=(1, 2)) + wave.judge_output_tokens.sum(axis=(1, 2))
    return np.sort(np.argsort(work, kind="stable")[-count:])


@dataclass(frozen=True)
class WaveSplit:
    """One wave-boundary decision: the next wave's split, its replayed seconds and the move's price."""

    split: int
    current: int
    current_s: float  # the next wave replayed at the current split
    best_s: float  # ... at the fastest split within one move
    move_s: float  # what the move costs the step (0 when the split stays)

    @property
    def moved(self) -> bool:
        return self.split != self.current


def choose(times: Mapping[int, float], current: int, move_s: float) -> WaveSplit:
    """The split for the next wave: the fastest of `times` (replayed seconds per split, `current`
    among them) if it saves more than `move_s`, else `current` (a tie keeps `current`)."""
    best = min(times, key=lambda r: (times[r], r != current))
    if times[current] - times[best] > move_s:
        return WaveSplit(split=best, current=current, current_s=times[current], best_s=times[best], move_s=move_s)
    return WaveSplit(split=current, current=current, current_s=times[current], best_s=times[best], move_s=0.0)

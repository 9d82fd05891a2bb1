"""Dynamic placement: choose the next rollout-phase split of a slice from measured load (pure).

Under `strategy: dynamic` each slice of D devices is split, in the rollout phase, into R devices
that generate with the policy and D − R devices that run the reward models (the generative judge
and/or the scalar reward model), as under `partial`. After every step each controller measures
how many device-seconds its slice spent generating and scoring, the controllers average these
figures with one all-reduce, and every controller calls `rebalance` on the same numbers, so all
of them choose the same next split without a central process (G-Core, arXiv 2507.22789, §
dynamic placement; the runtime and the simulator in `gcore_rl.sim` both call this function).

Cost model. Generation and scoring run at the same time (completions stream to the judge as they
finish), so with R rollout devices the rollout phase lasts about

    T(R) = max(g + G / R, s + S / (D − R))

where G and S are the measured device-seconds of generation and of scoring per step that divide
over devices, and g and s the seconds each device spends whatever its share (a decode step costs
nearly the same for a small batch as for a large one, so the longest response's decode steps do
not shrink by adding devices; see `RolloutLoad`). A move is worth making only when the time it saves per
step, paid back over `amortize_steps` steps, exceeds the cost of swapping the moved devices'
engines (`swap_s`, seconds one device needs to hand over; the moved devices swap in parallel),
and when the saving is at least `min_gain` of the current phase time (hysteresis, so noise in the
measurements does not make the split thrash). Moves are whole multiples of `unit` devices (the
engines' tensor-parallel size), at most `max_units` of them per decision, and neither side drops
below the devices its model needs.

Measurement beats the model. The loads also carry the measured rollout-phase time and the split
it was measured under. A split measured (over the last `memory` steps) faster than the current
one by more than `revert_margin` is returned to at once, and a split the model proposes but that
was measured no faster than the current one is not tried again: the cost model only has to point
in the right direction, and a move it got wrong costs one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class RolloutLoad:
    """Measured rollout-phase work of one slice in one step (all-reduced over the controllers).

    Work that spreads over devices and work that does not are kept apart: a decode step costs
    about the same whether it carries 4 sequences or 40 (the weights are read once either way),
    so the decode steps of the longest response cost every rollout device the same time however
    few prompts it holds; likewise one batch of verdicts on a reward device.

    Attributes:
        generate_s: device-seconds of generation that divide over the rollout devices.
        score_s: device-seconds of scoring (judge + scalar RM) that divide over the reward devices.
        swap_s: seconds one device spent releasing / loading engines in the step (sleep + wake).
        generate_fixed_s: seconds a rollout device spends whatever its share (the longest
            response's decode steps at the per-step fixed cost).
        score_fixed_s: seconds a reward device spends on one batch whatever its size.
        phase_s: the measured wall time of the step's rollout phase (0: not measured).
        waves: generation waves in that phase (dynamic sampling); measured phases are compared per wave.
        rollout_devices: the split it was measured under (0: not recorded).
    """

    generate_s: float
    score_s: float
    swap_s: float = 0.0
    generate_fixed_s: float = 0.0
    score_fixed_s: float = 0.0

    phase_s: float = 0.0
    rollout_devices: int = 0
    waves: float = 1.0

    @classmethod
    def from_devices(cls, generate_busy: Sequence[float], generate_fixed: Sequence[float],
                     score_busy: Sequence[float], score_fixed: Sequence[float], swap_s: float = 0.0,
                     phase_s: float = 0.0, waves: float = 1.0) -> RolloutLoad:
        """The load of one step from each rollout device's and each reward device's busy and fixed seconds.

        Divisible work is what each device did beyond its own fixed part; the fixed part of the
        side is its slowest device's (only one device holds the longest response).
        """
        return cls(generate_s=sum(max(b - f, 0.0) for b, f in zip(generate_busy, generate_fixed, strict=True)),
                   score_s=sum(max(b - f, 0.0) for b, f in zip(score_busy, score_fixed, strict=True)),
                   swap_s=swap_s, generate_fixed_s=max(generate_fixed, default=0.0),
                   score_fixed_s=max(score_fixed, default=0.0), phase_s=phase_s,
                   rollout_devices=len(generate_busy), waves=waves)


@dataclass
class RebalanceConfig:
    """How `strategy: dynamic` resizes the split between policy rollout and the reward models."""

    window: int = field(default=2, metadata={"help": "Steps of measured load averaged for each decision (the last ones)."})
    memory: int = field(default=8, metadata={"help": "Steps over which measured rollout-phase times are remembered per split: a split measured slower than the current one is not tried again, and one measured faster is returned to."})
    revert_margin: float = field(default=0.01, metadata={"help": "Go back to a split measured faster than the current one by more than this fraction (measurement beats the model)."})
    min_gain: float = field(default=0.05, metadata={"help": "Hysteresis: move only when the predicted rollout phase shortens by at least this fraction."})
    amortize_steps: float = field(default=2.0, metadata={"help": "Steps over which a move's swap cost must be paid back by its saving per step."})
    unit: int = field(default=1, metadata={"help": "Devices moved at a time: the engines' tensor-parallel size."})
    max_units: int = field(default=2, metadata={"help": "Most units moved in one decision (small moves let the measured phase correct the model)."})

    def validate(self) -> None:
        for key in ("window", "memory"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.max_units < 1:
            raise ConfigError("max_units", f"must be at least 1, got {self.max_units}")
        if not 0 <= self.revert_margin < 1:
            raise ConfigError("revert_margin", f"must be in [0, 1), got {self.revert_margin}")
        if not 0 <= self.min_gain < 1:
            raise ConfigError("min_gain", f"must be in [0, 1), got {self.min_gain}")
        if self.amortize_steps <= 0:
            raise ConfigError("amortize_steps", f"must be > 0, got {self.amortize_steps}")
        if self.unit < 1:
            raise ConfigError("unit", f"must be at least 1, got {self.unit}")


@dataclass(frozen=True)
class Decision:
    """The split chosen for the next step and why.

    `predicted_s` is the rollout phase time the cost model predicts at the chosen split,
    `current_s` the prediction at the current one (same model, so the two compare fairly).
    """

    rollout_devices: int
    current_s: float
    predicted_s: float
    moved: int
    reason: str


def predict_rollout_seconds(load: RolloutLoad, rollout_devices: int, reward_devices: int) -> float:
    """T(R) = max(g + G / R, s + S / (D − R)): the rollout phase when generation and scoring overlap
    (g, s: the fixed seconds per device; G, S: the divisible device-seconds)."""
    generate = load.generate_fixed_s + load.generate_s / rollout_devices if load.generate_s > 0 else load.generate_fixed_s
    score = load.score_fixed_s + load.score_s / reward_devices if load.score_s > 0 else load.score_fixed_s
    return max(generate, score)


def mean_load(history: Sequence[RolloutLoad], window: int) -> RolloutLoad:
    """The average of the last `window` loads (`rollout_devices`: the latest)."""
    recent = list(history)[-window:]
    n = len(recent)
    averaged = {f.name: sum(getattr(x, f.name) for x in recent) / n for f in fields(RolloutLoad) if f.name != "rollout_devices"}
    return RolloutLoad(**averaged, rollout_devices=recent[-1].rollout_devices)


def measured_phase_by_split(history: Sequence[RolloutLoad], memory: int) -> dict[int, float]:
    """Mean measured rollout-phase seconds per wave of each split over the last `memory` steps
    (splits with a measurement; a step that needed more dynamic-sampling waves is not slower per wave)."""
    times: dict[int, list[float]] = {}
    for load in list(history)[-memory:]:
        if load.phase_s > 0 and load.rollout_devices > 0:
            times.setdefault(load.rollout_devices, []).append(load.phase_s / max(load.waves, 1.0))
    return {split: sum(t) / len(t) for split, t in times.items()}


def feasible_splits(rollout_devices: int, slice_devices: int, unit: int, min_rollout: int = 1,
                    min_reward: int = 1) -> list[int]:
    """Rollout-device counts reachable from `rollout_devices` in whole units that fit both sides."""
    lowest = rollout_devices - unit * ((rollout_devices - min_rollout) // unit)
    return [r for r in range(lowest, slice_devices - min_reward + 1, unit) if r >= min_rollout]


def rebalance(history: Sequence[RolloutLoad], rollout_devices: int, slice_devices: int, cfg: RebalanceConfig,
              min_rollout: int = 1, min_reward: int = 1) -> Decision:
    """The next split of a slice of `slice_devices` devices that has `rollout_devices` rollout devices now.

    `history` holds one `RolloutLoad` per past step (oldest first); an empty history keeps the
    split. `min_rollout` / `min_reward` are the devices the policy engine and the reward models
    need to fit (`placement.min_devices`). Returns the same split unless a move pays (see the
    module docstring).
    """
    reward_devices = slice_devices - rollout_devices
    if not history:
        return Decision(rollout_devices, 0.0, 0.0, 0, "no measurements yet")
    load = mean_load(history, cfg.window)
    current = predict_rollout_seconds(load, rollout_devices, reward_devices)
    candidates = [r for r in feasible_splits(rollout_devices, slice_devices, cfg.unit, min_rollout, min_reward)
                  if abs(r - rollout_devices) <= cfg.max_units * cfg.unit]
    if not candidates:
        return Decision(rollout_devices, current, current, 0, "no feasible split")
    measured = measured_phase_by_split(history, cfg.memory)
    here = measured.get(rollout_devices)
    if here is not None:  # measurement beats the model: return to a split that ran faster
        faster = [r for r in candidates if r in measured and measured[r] < here * (1 - cfg.revert_margin)]
        if faster:
            back = min(faster, key=lambda r: measured[r])
            return Decision(back, here, measured[back], back - rollout_devices,
                            f"{rollout_devices}->{back} rollout devices: measured {here:.3g}s here, {measured[back]:.3g}s there")
    # best predicted time; ties go to the smallest move
    best = min(candidates, key=lambda r: (predict_rollout_seconds(load, r, slice_devices - r), abs(r - rollout_devices)))
    predicted = predict_rollout_seconds(load, best, slice_devices - best)
    gain = current - predicted
    if best == rollout_devices or gain <= 0:
        return Decision(rollout_devices, current, current, 0, "already the best split")
    if gain < cfg.min_gain * current:
        return Decision(rollout_devices, current, current, 0,
                        f"gain {gain:.3g}s below the hysteresis of {cfg.min_gain:.0%} of {current:.3g}s")
    if gain * cfg.amortize_steps <= load.swap_s:
        return Decision(rollout_devices, current, current, 0,
                        f"gain {gain:.3g}s x {cfg.amortize_steps:g} steps does not pay the swap of {load.swap_s:.3g}s")
    if here is not None and best in measured and measured[best] >= here * (1 - cfg.revert_margin):
        return Decision(rollout_devices, current, current, 0,
                        f"{best} rollout devices predicted faster but measured {measured[best]:.3g}s vs {here:.3g}s here")
    return Decision(best, current, predicted, best - rollout_devices,
                    f"{rollout_devices}->{best} rollout devices: {current:.3g}s -> {predicted:.3g}s predicted")

"""Dynamic placement: choose the next rollout-phase split of a slice from measured load (pure).

Under `strategy: dynamic` each slice of D devices is split, in the rollout phase, into R devices
that generate with the policy and D − R devices that run the reward models (the generative judge
and/or the scalar reward model), as under `partial`. After every step each controller measures
how many device-seconds its slice spent generating and scoring, the controllers average these
figures with one all-reduce, and every controller calls `rebalance` on the same numbers, so all
of them choose the same next split without a central process (G-Core, arXiv 2507.22789, §
dynamic placement; the runtime and the simulator in `gcore_rl.sim` both call this function).

Two models predict a split's rollout phase from the work of a measured step; the decision rule
below is the same for both.

- Replayed work (`RolloutLoad.forecast`): the step's counted work (every prompt's and completion's
  length, every verdict's) is run again through the simulator's phase model at every split, so
  the prediction does not move when devices move: the same completions cost the same whoever
  judges them, and a streaming judge's small batches (busy time that is occupancy, not work) are
  priced as batches. The simulator's `dynamic` uses it (`gcore_rl.sim.strategies.Dynamic`).
  The trainer's controllers replay their own counted work the same way under
  `placement.forecast.model=replay` (`gcore_rl.controller.forecast`).
- Counted busy time (`placement.forecast.model=counters`, the runtime's default). Generation and scoring run at the same time
  (completions stream to the judge as they finish), so with R rollout devices the phase lasts about

      T(R) = max(g + G / R, s + S / (D − R))

  where G and S are the measured device-seconds of generation and of scoring per step that divide
  over devices, and g and s the seconds each device spends whatever its share (a decode step costs
  nearly the same for a small batch as for a large one, so the longest response's decode steps do
  not shrink by adding devices; see `RolloutLoad`). Its weakness: a streaming judge's busy time
  grows with the devices it is given, so S moves with the split (docs/simulator-findings.md, (d)).

The decision. The target is the split with the best (corrected) prediction over every feasible
split. A move is worth making only when the time it saves per step, paid back over
`amortize_steps` steps, exceeds the cost of swapping the moved devices' engines (`swap_s`,
seconds one device needs to hand over; the moved devices swap in parallel), and when the saving
is at least `min_gain` of the current phase time (hysteresis, so noise in the measurements does
not make the split thrash). The split moves toward the target by at most `max_units` units, to the
best split within that reach, so that the next measurement can correct the model; only when no
split within reach clears the hysteresis (a dip behind a plateau) does it go the whole way. Moves
are whole multiples of `unit` devices (the engines' tensor-parallel size), and neither side drops
below the devices its model needs.

Measurement corrects the model. The loads also carry the measured rollout-phase time and the
split it was measured under. For every split measured in the last `memory` steps, the ratio of
the measured phase to the phase the model predicts from that same step's load is kept; a
candidate split's prediction is multiplied by its own mean ratio, or by the current split's when
it was never measured. Since each ratio compares a step with its own load, longer responses or an
extra dynamic-sampling wave later in training do not make an old split look faster or slower. A
move the model got wrong shows up as a larger ratio at the new split after one step: a remembered
split whose corrected time beats the current one by more than `revert_margin` is returned to, and
no split at or beyond a remembered split that ran no faster than the current one is proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml

from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class DeviceLoad:
    """How long one device has been busy in the step so far, by side of the rollout phase (a device
    worker's answer to its controller; `RolloutLoad.from_device_loads` adds up a slice's).

    Attributes:
        generate_s: seconds the policy engine generated; `generate_fixed_s` of them no smaller share
            of the prompts would have saved (the longest response's decode steps at their fixed cost).
        score_s: seconds the reward models (judge, scalar RM) scored; `score_fixed_s` of them one
            batch's fixed cost (the judge's largest call).
        swap_s: seconds spent sleeping and waking engines (handing the device from role to role).
    """

    generate_s: float = 0.0
    generate_fixed_s: float = 0.0
    score_s: float = 0.0
    score_fixed_s: float = 0.0
    swap_s: float = 0.0


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
        swap_s: seconds a device needs to hand its role over (the largest sleep + wake time of a
            device of the slice in the step): what a move must pay back.
        generate_fixed_s: seconds a rollout device spends whatever its share (the longest
            response's decode steps at the per-step fixed cost).
        score_fixed_s: seconds a reward device spends on one batch whatever its size.
        generate_busy_s / score_busy_s: busy device-seconds of each side, summed over its devices (the
            replay forecast's calibration compares them with the replayed busy time at the same split).
        phase_s: the measured wall time of the step's rollout phase (0: not measured).
        rollout_devices: the split it was measured under (0: not recorded).
        forecast: optional, the rollout phase this step's work would have taken at each split
            (entry r - 1 for r rollout devices, r = 1 .. D - 1; `inf` where a split does not fit or was
            not replayed),
            from a model that replays the step's counted work (the simulator's own phase model);
            empty: predicted from the fields above (`predict_rollout_seconds`).
    """

    generate_s: float
    score_s: float
    swap_s: float = 0.0
    generate_fixed_s: float = 0.0
    score_fixed_s: float = 0.0
    generate_busy_s: float = 0.0
    score_busy_s: float = 0.0

    phase_s: float = 0.0
    rollout_devices: int = 0
    forecast: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready fields (`forecast` as a list), as a checkpoint stores them; `from_dict` reads them back."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "forecast": list(self.forecast)}

    @classmethod
    def from_dict(cls, fields_: dict) -> RolloutLoad:
        return cls(**{**fields_, "forecast": tuple(fields_.get("forecast", ()))})

    def predict(self, rollout_devices: int, slice_devices: int) -> float:
        """The rollout phase this step's work would have taken with `rollout_devices` of the slice's
        `slice_devices` devices generating: the step's `forecast` where a model that replays the step's
        work gave one, otherwise the counted-work model `predict_rollout_seconds`."""
        if self.forecast:
            return self.forecast[rollout_devices - 1]
        return predict_rollout_seconds(self, rollout_devices, slice_devices - rollout_devices)

    @classmethod
    def from_devices(cls, generate_busy: Sequence[float], generate_fixed: Sequence[float],
                     score_busy: Sequence[float], score_fixed: Sequence[float], swap_s: float = 0.0,
                     phase_s: float = 0.0) -> RolloutLoad:
        """The load of one step from each rollout device's and each reward device's busy and fixed seconds.

        Divisible work is what each device did beyond its own fixed part; the fixed part of the
        side is its slowest device's (only one device holds the longest response).
        """
        return cls(generate_s=sum(max(b - f, 0.0) for b, f in zip(generate_busy, generate_fixed, strict=True)),
                   score_s=sum(max(b - f, 0.0) for b, f in zip(score_busy, score_fixed, strict=True)),
                   swap_s=swap_s, generate_fixed_s=max(generate_fixed, default=0.0),
                   score_fixed_s=max(score_fixed, default=0.0), generate_busy_s=float(sum(generate_busy)),
                   score_busy_s=float(sum(score_busy)), phase_s=phase_s,
                   rollout_devices=len(generate_busy))

    @classmethod
    def from_device_loads(cls, rollout: Sequence[DeviceLoad], scorers: Sequence[DeviceLoad], swap_s: float = 0.0,
                          phase_s: float = 0.0) -> RolloutLoad:
        """The slice's load from its rollout devices' and reward devices' `DeviceLoad` (`from_devices`)."""
        return cls.from_devices(generate_busy=[d.generate_s for d in rollout], generate_fixed=[d.generate_fixed_s for d in rollout],
                                score_busy=[d.score_s for d in scorers], score_fixed=[d.score_fixed_s for d in scorers],
                                swap_s=swap_s, phase_s=phase_s)


@dataclass
class RebalanceConfig:
    """How `strategy: dynamic` resizes the split between policy rollout and the reward models."""

    window: int = field(default=2, metadata={"help": "Steps of measured load averaged for each decision (the last ones)."})
    memory: int = field(default=8, metadata={"help": "Steps over which each split's measured / predicted rollout-phase ratio is remembered and corrects the model's prediction for that split."})
    revert_margin: float = field(default=0.02, metadata={"help": "Return to a split measured (corrected to the current load) faster than the current one by more than this fraction."})
    min_gain: float = field(default=0.05, metadata={"help": "Hysteresis: move only when the predicted rollout phase shortens by at least this fraction."})
    amortize_steps: float = field(default=2.0, metadata={"help": "Steps over which a move's swap cost must be paid back by its saving per step."})
    unit: int = field(default=1, metadata={"help": "Devices moved at a time: the engines' tensor-parallel size."})
    max_units: int = field(default=2, metadata={"help": "Most units moved in one decision (small moves let the measured phase correct the model)."})

    def validate(self) -> None:
        for key in ("window", "memory"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not 0 <= self.revert_margin < 1:
            raise ConfigError("revert_margin", f"must be in [0, 1), got {self.revert_margin}")
        if self.max_units < 1:
            raise ConfigError("max_units", f"must be at least 1, got {self.max_units}")
        if not 0 <= self.min_gain < 1:
            raise ConfigError("min_gain", f"must be in [0, 1), got {self.min_gain}")
        if self.amortize_steps <= 0:
            raise ConfigError("amortize_steps", f"must be > 0, got {self.amortize_steps}")
        if self.unit < 1:
            raise ConfigError("unit", f"must be at least 1, got {self.unit}")


@dataclass
class ForecastConfig:
    """How a run's controllers predict the rollout phase at other splits (`strategy: dynamic`)."""

    model: Literal["replay", "counters"] = field(default="counters", metadata={"help": "counters: T(R) = max(g + G/R, s + S/(D-R)) from busy time (docs/simulator-findings.md (d)); replay: each step's counted work (prompt, completion and verdict tokens) replayed through the simulator's phase model at every split (gcore_rl.costmodel.replay), as the simulator's dynamic does; needs cost constants that fit the machine (placement.forecast.costs)."})
    hardware: str | None = field(default=None, metadata={"help": "replay: the simulator's hardware preset for one device (cpu, A100, H100, H200, H20; null = cpu on CPU devices, H100 on CUDA)."})
    costs: str | None = field(default=None, metadata={"help": "replay: a YAML file with a `costs:` section of fitted cost constants (`gcore-rl simulate --calibrate RUN --constants-out FILE`); null = the simulator's defaults, with the engine wake taken from the step's measured handover. The per-split measured/predicted ratio corrects what the constants get wrong."})
    calibrate_window: int = field(default=0, metadata={"help": "replay: when > 0, each step fits a time scale per model (policy, judge) that makes the replayed busy time of each side at the step's split equal the measured one, and the forecast uses the median of the last this many steps' scales; 0 = the cost constants as they are. It scales each engine's speed; the split of its time into fixed per-step and per-token cost stays the constants'."})
    engine_window: int = field(default=0, metadata={"help": "replay: when > 0, each model's engine costs are measured in the run instead of taken from the hardware formulas: a least-squares line (fixed seconds per decode step + seconds per sequence in the batch) through the decode rounds its engines ran in the last this many steps, prefill from what their busy time leaves (gcore_rl.costmodel.replay.fit_engine); 0 = the formulas and placement.forecast.costs."})

    def validate(self) -> None:
        if isinstance(self.engine_window, bool) or not isinstance(self.engine_window, int) or self.engine_window < 0:
            raise ConfigError("engine_window", f"must be a non-negative integer (steps), got {self.engine_window!r}")
        if self.engine_window > 0 and self.model != "replay":
            raise ConfigError("engine_window", f"fits the engine costs the replay forecast prices with, and "
                              f"placement.forecast.model is '{self.model}'; set model=replay, or leave engine_window at 0")
        if isinstance(self.calibrate_window, bool) or not isinstance(self.calibrate_window, int) or self.calibrate_window < 0:
            raise ConfigError("calibrate_window", f"must be a non-negative integer (steps), got {self.calibrate_window!r}")
        if self.model == "replay" and self.costs is not None:
            costs_section(self.costs)


def costs_section(path: str) -> dict:
    """The `costs:` mapping of the YAML file `path` (what `placement.forecast.costs` names);
    `ConfigError("costs", ...)` naming the file when it cannot be read or has none."""
    try:
        section = (yaml.safe_load(Path(path).read_text()) or {}).get("costs")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as err:
        raise ConfigError("costs", f"cannot read {path} as a YAML file with a `costs:` section "
                          f"({type(err).__name__}: {err})") from None
    if not isinstance(section, dict):
        raise ConfigError("costs", f"{path} has no `costs:` section; write one with "
                          "`gcore-rl simulate --calibrate RUN_DIR --constants-out FILE`")
    return section


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
    """The average of the last `window` loads (`rollout_devices`: the latest's; `forecast`: averaged
    split by split when every one of them has one of the same length, else empty; a split some
    step did not replay stays `inf`, so splits are compared only on the same steps' work)."""
    recent = list(history)[-window:]
    n = len(recent)
    averaged = {f.name: sum(getattr(x, f.name) for x in recent) / n for f in fields(RolloutLoad)
                if f.name not in ("rollout_devices", "forecast")}
    lengths = {len(x.forecast) for x in recent}
    forecast = tuple(sum(values) / n for values in zip(*(x.forecast for x in recent), strict=True)) \
        if len(lengths) == 1 and 0 not in lengths else ()
    return RolloutLoad(**averaged, rollout_devices=recent[-1].rollout_devices, forecast=forecast)


def model_error_by_split(history: Sequence[RolloutLoad], slice_devices: int, memory: int) -> dict[int, float]:
    """Mean of measured / predicted rollout phase per split over the last `memory` steps, each step's
    prediction made from its own load at the split it ran under (steps without a measurement skipped)."""
    ratios: dict[int, list[float]] = {}
    for load in list(history)[-memory:]:
        split = load.rollout_devices
        if load.phase_s > 0 and 0 < split < slice_devices:
            predicted = load.predict(split, slice_devices)
            if predicted > 0:
                ratios.setdefault(split, []).append(load.phase_s / predicted)
    return {split: sum(r) / len(r) for split, r in ratios.items()}


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
    if not history:
        return Decision(rollout_devices, 0.0, 0.0, 0, "no measurements yet")
    load = mean_load(history, cfg.window)
    feasible = feasible_splits(rollout_devices, slice_devices, cfg.unit, min_rollout, min_reward)
    reach = cfg.max_units * cfg.unit
    near = [r for r in feasible if abs(r - rollout_devices) <= reach]
    if not near or feasible == [rollout_devices]:
        here = load.predict(rollout_devices, slice_devices)
        return Decision(rollout_devices, here, here, 0, "no feasible split")
    errors = model_error_by_split(history, slice_devices, cfg.memory)
    default = errors.get(rollout_devices, 1.0)

    def corrected(r: int) -> float:
        return load.predict(r, slice_devices) * errors.get(r, default)

    current = corrected(rollout_devices)
    # measurement first: return to a nearby split that ran faster, once both are corrected to today's load
    faster = [r for r in near if r in errors and corrected(r) < current * (1 - cfg.revert_margin)]
    if faster:
        back = min(faster, key=corrected)
        return Decision(back, current, corrected(back), back - rollout_devices,
                        f"{rollout_devices}->{back} rollout devices: measured faster ({corrected(back):.3g}s vs {current:.3g}s)")

    def explored_worse(r: int) -> bool:  # a measured split on the way to r (or r itself) ran no faster than here
        low, high = sorted((rollout_devices, r))
        return any(low <= s <= high and s != rollout_devices and corrected(s) >= current for s in errors)

    open_splits = [r for r in feasible if r == rollout_devices or not explored_worse(r)]
    # the target: the best corrected prediction over every open split; ties go to the smallest move
    target = min(open_splits, key=lambda r: (corrected(r), abs(r - rollout_devices)))
    gain = current - corrected(target)
    if target == rollout_devices or gain <= 0:
        return Decision(rollout_devices, current, current, 0, "already the best split")
    if gain < cfg.min_gain * current:
        return Decision(rollout_devices, current, current, 0,
                        f"gain {gain:.3g}s below the hysteresis of {cfg.min_gain:.0%} of {current:.3g}s")
    if gain * cfg.amortize_steps <= load.swap_s:
        return Decision(rollout_devices, current, current, 0,
                        f"gain {gain:.3g}s x {cfg.amortize_steps:g} steps does not pay the swap of {load.swap_s:.3g}s")
    # toward the target by at most max_units (so the next measurement can correct the model), unless no
    # split within reach on the way clears the hysteresis: then the whole way (a dip behind a plateau)
    on_way = [r for r in open_splits if r in near and r != rollout_devices
              and min(rollout_devices, target) <= r <= max(rollout_devices, target)]
    step = min(on_way, key=corrected) if on_way else target
    best = step if current - corrected(step) >= cfg.min_gain * current else target
    predicted = corrected(best)
    note = " (measured there before)" if best in errors else ""
    aim = f", toward {target}" if best != target else ""
    return Decision(best, current, predicted, best - rollout_devices,
                    f"{rollout_devices}->{best} rollout devices{aim}: {current:.3g}s -> {predicted:.3g}s predicted{note}")

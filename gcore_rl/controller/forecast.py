"""Dynamic placement's forecast in a run: the controller's counted work replayed at every split.

After a rollout phase each controller holds what its slice did, counted in tokens (`WaveWork` per
wave: prompts, completions, verdicts and judge prompts; `StepRollout.work`). `RolloutForecaster`
replays that work through the cost model's phase model (`gcore_rl.costmodel.replay`) on a one-slice job
built once per run from the policy's and the judge's `config.json`, a hardware preset and the
cost constants (`placement.forecast`), and returns the rollout phase at every split. The
controllers reduce the forecasts by maximum (the step waits for the slowest slice), so all of
them feed `rebalance` the same numbers; the measured / predicted ratio per split (in `rebalance`)
corrects what the constants get wrong about this machine.

The constants of a hardware preset rarely fit the machine a run is on, and what matters for the
split is how fast the policy's engines are *relative to* the judge's. So every step, before the
replay, the forecaster fits one time scale per model (`fit_time_scales`): the factor on that model's
engine costs that makes the replayed busy time of its side, at the split the step ran, equal the
busy time the devices measured. Unlike busy time itself, the factors do not move with the split
(they compare the same work at the same split), so they carry over to the splits not yet tried.
The forecast uses the median of the last `placement.forecast.calibrate_window` steps' factors.

A scale sets an engine's speed but not how its time divides between the fixed cost of a decode step
and the cost per sequence in the batch, and that division decides what another device saves. With
`placement.forecast.engine_window` > 0 the forecaster first measures it: every engine reports its
decode rounds (batch size and seconds) and its work (`EngineRounds`, summed over the slice), and each
model's costs become the least-squares line through the rounds of the last that many steps
(`fit_engine`), which replaces the hardware formulas in the replay (`ModelSpec.engine`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from gcore_rl.config import JobConfig
from gcore_rl.configlib import from_dict
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import hardware_preset
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.models import model_spec_from_folder
from gcore_rl.costmodel.replay import (
    feasible,
    fit_engine,
    fit_time_scales,
    fitted_job,
    judge_template_tokens,
    replay_rollout,
    scaled_job,
    slice_job,
    step_work,
)
from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import RolloutLoad, costs_section
from gcore_rl.records import EngineRounds, WaveWork

FORECAST_PREFIX = "forecast/"
ENGINE_FIT_TERMS = ("step_s", "token_s", "prefill_token_s")
"""The `EngineFit` terms a forecast reports per model (`forecast/<model>_<term>`)."""


class RolloutForecaster:
    """Predicts this controller's rollout phase at each split of its slice from the step's counted work."""

    def __init__(self, job: Job, group_size: int, measured_wake: bool = False, calibrate_window: int = 0,
                 engine_window: int = 0):
        self.job = job
        self.group_size = group_size
        self.measured_wake = measured_wake  # engine_wake_s from the step's measured handover (no calibrated costs)
        self.scales: deque[tuple[float, float]] = deque(maxlen=max(calibrate_window, 1))
        self.calibrate = calibrate_window > 0
        self.rounds: deque[dict[str, EngineRounds]] = deque(maxlen=max(engine_window, 1))
        self.fits_engines = engine_window > 0

    @classmethod
    def from_config(cls, cfg: JobConfig, slice_devices: int) -> RolloutForecaster | None:
        """The run's forecaster, or None under `placement.forecast.model=counters`.

        The reward side is the judge when there is one, else the scalar reward model (judged with
        one-token verdicts); the policy and reward engines use one device each, as the trainer's do.
        """
        fc = cfg.placement.forecast
        if fc.model != "replay":
            return None
        policy = model_spec_from_folder(cfg.model.path, "model.path")
        reward_path, key = ((cfg.judge.model_path, "judge.model_path") if cfg.judge.enabled
                            else (cfg.reward_model.model_path, "reward_model.model_path"))
        scorer = model_spec_from_folder(str(reward_path), key)
        device_type = str(cfg.runtime.device).split(":")[0]
        try:
            hardware = hardware_preset(fc.hardware or ("cpu" if device_type == "cpu" else "H100"))
        except ConfigError as err:
            raise ConfigError("placement.forecast.hardware", err.message) from None
        job = slice_job(policy, scorer, hardware, load_costs(fc.costs), slice_devices, group_size=cfg.sampling.n,
                        judge_template_tokens=0, max_num_seqs=cfg.engine.max_num_seqs, rebalance=cfg.placement.rebalance)
        return cls(job, cfg.sampling.n, measured_wake=fc.costs is None, calibrate_window=fc.calibrate_window,
                   engine_window=fc.engine_window)

    def forecast(self, waves: Sequence[WaveWork], load: RolloutLoad | None = None,
                 rounds: dict[str, EngineRounds] | None = None) -> dict[str, float]:
        """`forecast/<r>/max`: the rollout phase of `waves` with r rollout devices, for every feasible r
        (the `max` suffix makes `all_reduce_mean` take the slowest controller's), and the time scales
        it used, `forecast/policy_time_scale` and `forecast/judge_time_scale`.

        `load` is this controller's measured load of the same step: its `swap_s` (the sleep + wake
        seconds of one device; half of it is the engine wake when the costs are not calibrated, the
        defaults' 5 s wake being a GPU serving engine's) and, for the fit, its split and each side's
        busy device-seconds (`generate_busy_s`, `score_busy_s`). `rounds` are the slice's engine rounds of the
        step by role (`SliceClient.engine_rounds`), which the engine fit needs; with it the output also has
        each fitted cost (`forecast/<model>_step_s`, `_token_s`, `_prefill_token_s`)."""
        if not waves:
            return {}
        job = replace(self.job, workload=replace(self.job.workload, judge_template_tokens=judge_template_tokens(waves)))
        fitted: dict[str, float] = {}
        if self.fits_engines and rounds is not None:
            self.rounds.append(rounds)
            job, fitted = self._fit_engines(job)
        if self.measured_wake and load is not None:
            job = replace(job, costs=replace(job.costs, engine_wake_s=load.swap_s / 2))
        work = step_work(waves, self.group_size)
        if self.calibrate and load is not None and 1 <= load.rollout_devices < job.slice_devices:
            self.scales.append(fit_time_scales(job, work, load.rollout_devices, load.generate_busy_s, load.score_busy_s))
        policy_scale, judge_scale = self.time_scales()
        times = replay_rollout(scaled_job(job, policy_scale, judge_scale), work, feasible(job))
        return {**{f"{FORECAST_PREFIX}{r}/max": seconds for r, seconds in times.items()},
                f"{FORECAST_PREFIX}policy_time_scale": policy_scale, f"{FORECAST_PREFIX}judge_time_scale": judge_scale,
                **fitted}

    def _fit_engines(self, job: Job) -> tuple[Job, dict[str, float]]:
        """`job` with the engine costs fitted to the window's rounds (`fit_engine`), and those costs as metrics."""
        fits = {}
        for model, role in (("policy", "rollout"), ("judge", "judge")):
            window = [step[role] for step in self.rounds if role in step]
            fits[model] = fit_engine(sum(window[1:], window[0])) if window else None
        # the same keys on every controller (their metrics are all-reduced): NaN where a model has no fit yet
        metrics = {f"{FORECAST_PREFIX}{model}_{name}": getattr(fit, name) if fit is not None else math.nan
                   for model, fit in fits.items() for name in ENGINE_FIT_TERMS}
        return fitted_job(job, fits["policy"], fits["judge"]), metrics

    def time_scales(self) -> tuple[float, float]:
        """(policy, judge): the median of the recent steps' fitted scales (1, 1 before the first fit)."""
        if not self.scales:
            return 1.0, 1.0
        return statistics.median(s for s, _ in self.scales), statistics.median(s for _, s in self.scales)

    def vector(self, reduced: dict[str, float]) -> tuple[float, ...]:
        """`RolloutLoad.forecast` from the reduced `forecast/<r>/max` entries (`inf` for splits not replayed)."""
        D = self.job.slice_devices
        return tuple(reduced.get(f"{FORECAST_PREFIX}{r}/max", float("inf")) for r in range(1, D))


def load_costs(path: str | None) -> CostConstants:
    """The cost constants of `placement.forecast.costs` (the `costs:` section of a YAML file), or the defaults."""
    if path is None:
        return CostConstants()
    try:
        return from_dict(CostConstants, costs_section(path))
    except ConfigError as err:
        raise ConfigError(f"placement.forecast.costs.{err.key}" if err.key != "costs" else "placement.forecast.costs",
                          err.message) from None

"""The rollout phase of a slice split into R policy devices and D - R judge devices, priced by the cost model:
the `partial` strategy's rollout, which the simulator's `partial` and `dynamic` run and dynamic placement's
forecast replays at every split (`replay_rollout`, `gcore_rl.costmodel.replay`).

Completions stream to the judge engines as they finish; a wave ends when its last completion is judged. The
judge wakes at the step's first request (in parallel with generation) and is offloaded at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gcore_rl.costmodel import phases
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.phases import DeviceRange, Tally, stage
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.costmodel.work import StepWork, Wave


class StepTotals:
    """Work and device-seconds of one step, summed over waves (for the record and the rebalancer).

    Besides the busy device-seconds [K] it keeps what the trainer's device workers report as the
    fixed part of their busy time (`runtime.device_worker`): a policy engine's fixed seconds summed
    over the step's generate calls (waves), and a judge's largest fixed seconds of one batch.
    """

    def __init__(self, slices: int):
        self.generate = np.zeros(slices)
        self.judge = np.zeros(slices)
        self.judge_fixed = np.zeros(slices)  # [K] the largest single judge batch's fixed seconds
        self.phase = np.zeros(slices)  # [K] measured rollout phase seconds (set by the strategy)
        self.generate_fixed_engines: np.ndarray | None = None  # [K, engines] each policy engine's fixed seconds
        self.features: dict[str, float] = {}

    @property
    def generate_fixed(self) -> np.ndarray:
        """[K] fixed seconds of the slice's slowest policy engine (summed over the step's waves)."""
        if self.generate_fixed_engines is None:
            return np.zeros_like(self.generate)
        return self.generate_fixed_engines.max(axis=1)

    def add_generation(self, g: phases.Generation) -> None:
        self.generate += g.device_seconds
        if self.generate_fixed_engines is None:
            self.generate_fixed_engines = g.fixed_seconds.copy()
        elif self.generate_fixed_engines.shape == g.fixed_seconds.shape:  # the waves of a step share their engines
            self.generate_fixed_engines += g.fixed_seconds
        else:  # a re-split between waves: the slowest engine of each wave, added up
            self.generate_fixed_engines = (self.generate_fixed_engines.max(axis=1) + g.fixed_seconds.max(axis=1))[:, None]
        run = g.run
        self._add("generate/prefill_tokens", run.prefill_tokens.sum())
        self._add("generate/token_steps", run.token_steps.sum())
        self._add("generate/kv_token_steps", run.kv_token_steps.sum())
        self._add("generate/decode_steps", run.steps.sum())
        self._add("generate/decode_steps_max", run.steps.max())
        self._add("generate/compute_bound_steps", run.compute_bound_steps.sum())
        if run.idle_seconds is not None:  # multi-turn: engines waiting for their trajectories' answers
            self._add("generate/idle_seconds", run.idle_seconds.sum())

    def add_judging(self, j: phases.Judging) -> None:
        self.judge += j.device_seconds
        self.judge_fixed = np.maximum(self.judge_fixed, j.fixed_seconds)
        run = j.run
        self._add("judge/prefill_tokens", run.prefill_tokens.sum())
        self._add("judge/token_steps", run.token_steps.sum())
        self._add("judge/kv_token_steps", run.kv_token_steps.sum())
        self._add("judge/decode_steps", run.steps.sum())
        self._add("judge/batches", len(run.batch_engine))

    def _add(self, key: str, value) -> None:
        self.features[key] = self.features.get(key, 0.0) + float(value)


def at_each(t: np.ndarray, count: int) -> np.ndarray:
    """[K, count]: each slice's time repeated for `count` items."""
    return np.repeat(t[:, None], count, axis=1)


def generate_wave(job: Job, timeline: Timeline, step: int, wave: Wave, t: np.ndarray, where: DeviceRange,
                  tally: Tally, totals: StepTotals) -> tuple[phases.Generation, np.ndarray]:
    """Generate one wave on `where` from `t` [K], recording it; returns the generation and its end [K]."""
    g = phases.generate(job, timeline, step, wave, t, where)
    totals.add_generation(g)
    tally.add_slices("rollout/generate", g.end - t)
    return g, g.end


def wave_data(job: Job, timeline: Timeline, step: int, t: np.ndarray, wave: Wave, tally: Tally,
              where: DeviceRange | None = None) -> np.ndarray:
    """The controllers' data plane before a wave (prompts out, results back), from `t` [K]; its end [K]."""
    seconds = phases.wave_data_seconds(job, wave)
    tally.add_slices("rollout/data", seconds)
    return stage(job, timeline, step, t, seconds, "data", "rollout/data", where)


def partial_rollout(job: Job, work: StepWork, start: float, timeline: Timeline, R: int | Sequence[int],
                    judge_awake: bool = False) -> tuple[np.ndarray, Tally, StepTotals]:
    """`partial`'s rollout phase with R rollout devices per slice from `start`: its end [K], tally and totals.

    `R` may give one split per wave (a re-split between waves): a wave whose split differs from
    the previous wave's first pays `wave_move_seconds` (the moved devices' engines change role).
    The judge wakes at the first wave's start unless `judge_awake` (a refill wave replayed alone).
    """
    K = job.controllers
    tally, totals, t = Tally(K), StepTotals(K), np.full(K, start)
    splits = [R] * len(work.waves) if isinstance(R, int) else list(R)
    # a device that changed role between steps (dynamic) costs nothing extra: every step the policy
    # engines are refilled at the sync (only on the next split's rollout devices) and the judge wakes from host
    for i, (wave, r) in enumerate(zip(work.waves, splits, strict=True)):
        rollout = DeviceRange(0, r, job.policy_tp)
        judges = DeviceRange(r, job.slice_devices - r, job.judge_tp) if job.judge is not None else None
        t = wave_data(job, timeline, work.step, t, wave, tally)
        if i > 0 and r != splits[i - 1]:
            move = wave_move_seconds(job)
            t = stage(job, timeline, work.step, t, move, "swap", "swap/wave_move")
            tally.add_slices("swap", move)
        g = phases.generate(job, timeline, work.step, wave, t, rollout)
        totals.add_generation(g)
        if judges is None:
            tally.add_slices("rollout/generate", g.end - t)
            t = g.end
            continue
        ready = at_each(t, judges.engines)
        if i == 0 and not judge_awake:  # the judge wakes at the step's first request, while the policy generates
            ready = ready + phases.judge_wake_seconds(job)
            timeline.add("swap", "swap/judge_wake", work.step, judges.engine_devices(job),
                         t[:, None, None], ready[:, :, None])
        j = phases.judge(job, timeline, work.step, wave, g.finish, judges, ready, streaming=True)
        totals.add_judging(j)
        end = np.maximum(g.end, j.end)
        tally.add_slices("rollout/generate", g.end - t)
        tally.add_slices("rollout/judge", end - g.end)
        t = end
    if job.judge is not None:
        off = phases.judge_offload_seconds(job)
        last = splits[-1] if splits else 0
        t = stage(job, timeline, work.step, t, off, "swap", "swap/judge_offload",
                  DeviceRange(last, job.slice_devices - last, job.judge_tp))
        tally.add_slices("swap", off)
    return t, tally, totals


def feasible_splits(job: Job) -> list[int]:
    """Rollout-device counts of a slice that give whole policy engines and whole judge engines."""
    D = job.slice_devices
    return [r for r in range(1, D) if r % job.policy_tp == 0 and (D - r) % job.judge_tp == 0]


def wave_move_seconds(job: Job) -> float:
    """What a re-split between two waves of a step costs: a device turning from judge to policy loads
    the policy's weights from host and wakes its engine (it was not synced), one turning the other
    way wakes the judge; the moved devices do so in parallel, and the step waits for them."""
    return phases.policy_wake_seconds(job, from_host=True) + (phases.judge_wake_seconds(job) if job.judge else 0.0)


def replay_rollout(job: Job, work: StepWork, splits: Sequence[int], judge_awake: bool = False) -> dict[int, float]:
    """Seconds the rollout phase of `work` takes with r rollout devices per slice, for each r of
    `splits` (`partial`'s rollout, the slowest slice's, from a common start, on a scratch timeline):
    the model dynamic placement forecasts with (`gcore_rl.costmodel.replay`). `judge_awake`: the judge
    engines are up from the start (a refill wave inside a step)."""
    out = {}
    for r in splits:
        end, _, _ = partial_rollout(job, work, 0.0, Timeline(job.gpus), r, judge_awake)
        out[r] = float(end.max())
    return out

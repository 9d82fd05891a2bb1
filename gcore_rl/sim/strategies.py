"""The placement strategies, as step schedules over the phase building blocks.

Time-shared strategies (every device trains in the update phase; `TimeShared` subclasses):

- `colocate`: each slice generates on all its devices, swaps (policy engine offloaded, judge
  woken), judges every completion on all devices, and for a further wave swaps back; then the
  update phase on all devices.
- `partial`: a static split of each slice into R rollout and D - R judge devices. Completions
  stream to the judge engines as they finish; a wave ends when its last completion is judged.
  The judge wakes at the step's first request (in parallel with generation) and is offloaded
  before training.
- `dynamic`: `partial` whose split is chosen again after every step by the project's shared
  rebalancer (`gcore_rl.placement.rebalance.rebalance`) from the step's measured load: busy
  device-seconds split into fixed and divisible parts as the trainer's controllers measure them
  (`Dynamic.slice_load`). A device that changes role pays nothing extra, as in the runtime: the
  policy engines are refilled at every sync (only the next split's rollout devices are synced)
  and the judge wakes from host memory every step anyway.
- `interleave` (Ant Group's Interleaving, arXiv 2312.11819: models without dependencies on
  exclusive subsets of devices). Here: generation on all devices; then the judge scores the wave
  on one half of each slice while the reference model computes the wave's reference log-probs on
  the other half (neither depends on the other); the update phase (old log-probs, training) on
  all devices. The reference therefore runs on every generated completion, not only the trained
  ones. Without a reference or a judge there is nothing to interleave and it equals `colocate`.

`disaggregated` (pipelined, dedicated devices) is in `gcore_rl.sim.disaggregated`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from gcore_rl.costmodel import cost, phases, vision
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.phases import DeviceRange, Tally, stage
from gcore_rl.costmodel.rollout import (
    StepTotals,
    at_each,
    feasible_splits,
    generate_wave,
    partial_rollout,
    replay_rollout,
    wave_data,
    wave_move_seconds,
)
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.placement import rebalance as rebalancing
from gcore_rl.sim import wave_split
from gcore_rl.sim.results import StepRecord
from gcore_rl.sim.workload import StepWork, Wave


class TimeShared:
    """Shared step loop of the strategies whose update phase uses every device."""

    name = "time-shared"

    def __init__(self, job: Job):
        self.job = job
        self.whole = DeviceRange(0, job.slice_devices, job.policy_tp)

    def run(self, works: Sequence[StepWork], timeline: Timeline) -> list[StepRecord]:
        records, start = [], 0.0
        for work in works:
            records.append(self.step(work, start, timeline))
            start = records[-1].end
        return records

    def step(self, work: StepWork, start: float, timeline: Timeline) -> StepRecord:
        raise NotImplementedError

    def data(self, timeline: Timeline, step: int, t: np.ndarray, wave: Wave, tally: Tally,
             where: DeviceRange | None = None) -> np.ndarray:
        return wave_data(self.job, timeline, step, t, wave, tally, where)

    def finish(self, work: StepWork, start: float, rollout_end: np.ndarray, tally: Tally, totals: StepTotals,
               timeline: Timeline, policy_devices: DeviceRange, reference_done: bool = False,
               rollout_devices: int | None = None, decision: str | None = None,
               wave_splits: tuple[int, ...] = ()) -> StepRecord:
        """Barrier at the slowest slice, then the update phase; returns the step's record."""
        critical = int(np.argmax(rollout_end))
        end = phases.update_time_shared(self.job, timeline, work.step, work, float(rollout_end.max()), tally,
                                        policy_devices, reference_done)
        return make_record(self.job, work, self.job.slice_devices, start, end, tally.phases(critical), totals,
                           float(rollout_end.max()) - start, rollout_devices, decision, wave_splits)


def make_record(job: Job, work: StepWork, trainers: int, start: float, end: float, phase_seconds: dict[str, float],
                totals: StepTotals, rollout_seconds: float, rollout_devices: int | None = None,
                decision: str | None = None, wave_splits: tuple[int, ...] = ()) -> StepRecord:
    """The step's record; `trainers` is the trainer ranks per slice its update was split over."""
    w = job.workload
    features = dict(totals.features)
    features["train/tokens_max_slice"] = float(work.trained_tokens.max())
    if w.kind == "text":  # the runtime splits a text policy's rows by cost (a diffusion step's rows all cost the same)
        # over the data-parallel groups, as the runtime splits and reports it (`update_seconds` prices the same)
        features.update(phases.trainer_split(job, work, trainers // w.sequence_parallel).features())
    features["data/bytes_per_controller"] = float(np.max(sum(phases.wave_payload_bytes(job, wave) for wave in work.waves)
                                                         + phases.update_payload_bytes(job, work)))
    if work.waves[0].images is not None:
        features.update(image_features(job, work))
    if w.dynamic_sampling.enabled:
        features["sampling/stale_dropped"] = float(work.stale_dropped)
    return StepRecord(step=work.step, start=start, end=end, phases=phase_seconds, waves=len(work.waves),
                      valid_fraction=work.valid_fraction,
                      trained_samples=work.trained_groups * w.group_size * job.controllers,
                      generated_tokens=int(work.generated_tokens.sum()), trained_tokens=int(work.trained_tokens.sum()),
                      generate_device_seconds=float(totals.generate.mean()),
                      judge_device_seconds=float(totals.judge.mean()),
                      generate_fixed_seconds=float(totals.generate_fixed.mean()),
                      judge_fixed_seconds=float(totals.judge_fixed.mean()), rollout_seconds=rollout_seconds,
                      rollout_devices=rollout_devices,
                      decision=decision, features=features, wave_splits=wave_splits)


def image_features(job: Job, work: StepWork) -> dict[str, float]:
    """The step's images, per controller (the busiest): images, megapixels decoded, CPU seconds of decoding
    and preprocessing (before dividing over workers), vision-tower FLOPs of the rollout prefill."""
    images = [wave.images for wave in work.waves if wave.images is not None]
    count = sum(i.count.sum(axis=1) for i in images)
    megapixels = sum(i.megapixels.sum(axis=1) for i in images)
    cpu = vision.cpu_seconds(count, megapixels, job.workload.images)
    return {"images/count": float(np.max(count)), "images/megapixels": float(np.max(megapixels)),
            "images/cpu_seconds": float(np.max(cpu)),
            "images/prefill_vision_flops": float(np.max(sum(i.flops.sum(axis=1) for i in images)))}


class Colocate(TimeShared):
    name = "colocate"

    def step(self, work: StepWork, start: float, timeline: Timeline) -> StepRecord:
        job, K = self.job, self.job.controllers
        tally, totals, t = Tally(K), StepTotals(K), np.full(K, start)
        judges = DeviceRange(0, job.slice_devices, job.judge_tp)
        for i, wave in enumerate(work.waves):
            t = self.data(timeline, work.step, t, wave, tally)
            if i > 0 and job.judge is not None:  # back from the judge to the policy for another wave
                back = phases.judge_offload_seconds(job) + phases.policy_wake_seconds(job, from_host=True)
                t = stage(job, timeline, work.step, t, back, "swap", "swap/judge_to_policy")
                tally.add_slices("swap", back)
            g, t = generate_wave(job, timeline, work.step, wave, t, self.whole, tally, totals)
            if job.judge is None:
                continue
            over = phases.policy_offload_seconds(job) + phases.judge_wake_seconds(job)
            t = stage(job, timeline, work.step, t, over, "swap", "swap/policy_to_judge")
            tally.add_slices("swap", over)
            j = phases.judge(job, timeline, work.step, wave, at_each(t, wave.samples), judges, at_each(t, judges.engines),
                             streaming=False)
            totals.add_judging(j)
            tally.add_slices("rollout/judge", j.end - t)
            t = j.end
        if job.judge is not None:
            off = phases.judge_offload_seconds(job)
            t = stage(job, timeline, work.step, t, off, "swap", "swap/judge_offload")
            tally.add_slices("swap", off)
        return self.finish(work, start, t, tally, totals, timeline, self.whole)


class Partial(TimeShared):
    """Static split: `rollout_devices` policy devices and the rest judge devices per slice."""

    name = "partial"

    def __init__(self, job: Job):
        super().__init__(job)
        self.rollout_devices = job.rollout_devices if job.judge is not None else job.slice_devices

    def step(self, work: StepWork, start: float, timeline: Timeline) -> StepRecord:
        job, R = self.job, self.rollout_devices
        moves: dict[str, float] = {}
        splits = self.wave_splits(work, moves)
        t, tally, totals = self.rollout(work, start, timeline, splits)
        totals.phase = t - start  # [K] the rollout phase as each controller times it
        totals.features.update(moves)
        one_split = isinstance(splits, int) or len(set(splits)) == 1
        decision = self.decide(totals, work, one_split)  # dynamic may change the split for the next step
        synced = DeviceRange(0, self.rollout_devices, job.policy_tp)  # as the runtime, only the next rollout devices load
        return self.finish(work, start, t, tally, totals, timeline, synced, rollout_devices=R, decision=decision,
                           wave_splits=tuple(splits) if not isinstance(splits, int) else ())

    def wave_splits(self, work: StepWork, features: dict[str, float]) -> int | list[int]:
        """The split of the step's waves: one for all (`partial`); `dynamic` may re-split between waves
        (and adds what its moves cost to `features`)."""
        return self.rollout_devices

    def rollout(self, work: StepWork, start: float, timeline: Timeline, R: int | Sequence[int],
                judge_awake: bool = False) -> tuple[np.ndarray, Tally, StepTotals]:
        """The step's rollout phase with R rollout devices per slice (`partial_rollout`)."""
        return partial_rollout(self.job, work, start, timeline, R, judge_awake)

    def decide(self, totals: StepTotals, work: StepWork, one_split: bool = True) -> str | None:
        """The split for the next step (`dynamic`); `one_split`: every wave of this step ran at the same split."""
        return None


GRID = 16  # dynamic's replay: splits tried beyond one move's reach
REPLAY_SLICES = 4  # dynamic's replay: the slowest slices of the step that are replayed
RESCAN = 4  # dynamic's replay: decisions between two replays of the whole range


class Dynamic(Partial):
    """`partial` whose split follows the shared rebalancer after every step."""

    name = "dynamic"

    def __init__(self, job: Job):
        super().__init__(job)
        self.history: list[rebalancing.RolloutLoad] = []
        self.aim: list[int] = []  # splits within 5 % of the last forecast's best (replayed again next step)

    def wave_splits(self, work: StepWork, features: dict[str, float]) -> int | list[int]:
        """Under `placement.wave_resplit`, one split per wave: the step's split for its first wave, then
        at each boundary `wave_split.choose` on the finished wave's counted work replayed at the
        next wave's size (only what a controller knows there: the wave it finished and the size the
        sampler gives the next). `features` gets the moves, their price and the replayed gain."""
        job = self.job
        if not job.wave_resplit or job.judge is None:
            return self.rollout_devices
        fits = feasible_splits(job)
        splits, moves, price, gain = [self.rollout_devices], 0, 0.0, 0.0
        for done, upcoming in zip(work.waves, work.waves[1:], strict=False):
            guess = dataclasses.replace(work, waves=(wave_split.like(done, upcoming.prompts),))
            heavy = wave_split.heaviest_slices(done, min(REPLAY_SLICES, job.controllers))
            near = [r for r in fits if abs(r - splits[-1]) <= self.reach]
            times = replay_rollout(*slices_of(job, guess, heavy), near, judge_awake=True)
            choice = wave_split.choose(times, splits[-1], wave_move_seconds(job))
            splits.append(choice.split)
            if choice.moved:
                moves, price, gain = moves + 1, price + choice.move_s, gain + choice.current_s - choice.best_s
        features.update({"placement/wave_moves": moves, "placement/wave_move_s": price, "placement/wave_gain_s": gain})
        return splits

    @property
    def reach(self) -> int:
        """Most rollout devices one decision moves (the rebalancer's max_units x unit)."""
        return self.job.rebalance.max_units * self.job.rebalance.unit

    def decide(self, totals: StepTotals, work: StepWork, one_split: bool = True) -> str | None:
        job = self.job
        if job.judge is None:
            return None
        load = self.measured_load(totals)
        if job.rebalance_model == "replay":
            load = dataclasses.replace(load, phase_s=float(totals.phase.max()), forecast=self.forecast(work, totals))
        if not one_split:  # the waves ran at several splits: the measured phase is no split's (no model correction)
            load = dataclasses.replace(load, phase_s=0.0)
        self.history.append(load)
        decision = rebalancing.rebalance(self.history, self.rollout_devices, job.slice_devices, job.rebalance,
                                         min_rollout=job.policy_tp, min_reward=job.judge_tp)
        self.rollout_devices = decision.rollout_devices
        return decision.reason

    def forecast(self, work: StepWork, totals: StepTotals) -> tuple[float, ...]:
        """The rollout phase this step's work would have taken at each split r = 1 .. D - 1: the step
        replayed through the simulator's own phase model on a scratch timeline, for the splits
        within one move, those that came within 5 % of the best in the last forecast, and, every
        `RESCAN` decisions, up to `GRID` others spread over the range (`inf` for the rest).

        Only the `REPLAY_SLICES` slices whose rollout phase was longest this step are replayed (the
        same work keeps the same slices slowest at any split; the step waits for the slowest), and
        the forecast is the slowest of them. The trainer's controllers replay
        their own counted work the same way under `placement.forecast.model=replay` (`controller.forecast`)."""
        job, D = self.job, self.job.slice_devices
        fits = feasible_splits(job)
        # every split within one move, and at most GRID others spread over the range (a slice of
        # hundreds of devices would otherwise replay hundreds of splits per step)
        chosen = {r for r in fits if abs(r - self.rollout_devices) <= self.reach} | set(self.aim)
        if len(self.history) % RESCAN == 0:  # the whole range every RESCAN decisions (from the first)
            chosen |= set(fits[:: max(1, -(-len(fits) // GRID))]) | {fits[0], fits[-1]}
        slowest = np.sort(np.argsort(totals.phase)[-REPLAY_SLICES:])
        times = replay_rollout(*slices_of(job, work, slowest), sorted(chosen))
        out = [times.get(r, math.inf) for r in range(1, D)]
        best = min(out)
        self.aim = [r for r in chosen if out[r - 1] <= best * 1.05]  # near-best splits stay in view
        return tuple(out)

    def measured_load(self, totals: StepTotals) -> rebalancing.RolloutLoad:
        """The step's load as the trainer's controllers measure it: one `slice_load` per slice,
        all-reduced (each field averaged over the slices), as `controller.loop.rebalance_split` does."""
        per_slice = [self.slice_load(totals, k) for k in range(self.job.controllers)]
        return rebalancing.mean_load(per_slice, len(per_slice))

    def slice_load(self, totals: StepTotals, k: int) -> rebalancing.RolloutLoad:
        """Slice k's load as its controller measures it (`controller.slice.SliceClient.rollout_load`).

        The busy device-seconds are split as `RolloutLoad.from_devices` does for the runtime,
        given the fixed part of each device's time, estimated as the trainer's engines do
        (`EngineStats.fixed_seconds`: decode steps x the per-step cost at a batch of one), from the
        simulator's own decode model (`phases.fixed_step_seconds`: the weights read, one sequence's
        KV cache, the step overhead). Generation: G = busy device-seconds − every device's own
        fixed part, g = the slowest engine's fixed part. Judge: each device's fixed part is taken
        as the slice's largest single batch (the simulator keeps no per-engine maximum).

        Units: the rebalancer counts devices, R of them generating and D - R judging, and
        predicts g + G / R with G in device-seconds. An engine spans tp devices; its busy time
        counts tp times in G (`Generation.device_seconds`), and each of its tp devices is busy for
        the engine's whole fixed time, so an engine's fixed seconds are each of its devices' fixed
        part (not divided by tp: the per-step cost already reads only each device's 1/tp of the
        weights) and count tp times when taken out of G.
        """
        job, R = self.job, self.rollout_devices
        swap = phases.judge_wake_seconds(job) + phases.judge_offload_seconds(job)
        engines = totals.generate_fixed_engines
        fixed_device_seconds = float(engines[k].sum()) * job.policy_tp if engines is not None else 0.0
        judge_fixed = float(totals.judge_fixed[k])
        return rebalancing.RolloutLoad(
            generate_s=max(float(totals.generate[k]) - fixed_device_seconds, 0.0),
            score_s=max(float(totals.judge[k]) - (job.slice_devices - R) * judge_fixed, 0.0),
            swap_s=swap, generate_fixed_s=float(totals.generate_fixed[k]), score_fixed_s=judge_fixed,
            phase_s=float(totals.phase[k]), rollout_devices=R)


def slices_of(job: Job, work: StepWork, slices: Sequence[int]) -> tuple[Job, StepWork]:
    """The job and the step's work of only the slices `slices` (each keeps its D devices), to replay them alone."""
    index = np.asarray(slices)
    sub_work = dataclasses.replace(work, waves=tuple(w.take(index) for w in work.waves))
    return dataclasses.replace(job, controllers=len(index), gpus=len(index) * job.slice_devices), sub_work


class Interleave(TimeShared):
    """Judge on one half of each slice while the reference log-probs run on the other half."""

    name = "interleave"

    def __init__(self, job: Job):
        super().__init__(job)
        D = job.slice_devices
        self.active = job.judge is not None and job.reference and D >= job.judge_tp + 1
        half = max(job.judge_tp, (D // 2) // job.judge_tp * job.judge_tp)
        self.judges = DeviceRange(0, half, job.judge_tp)
        self.reference = DeviceRange(half, D - half)
        self.fallback = Colocate(job)

    def step(self, work: StepWork, start: float, timeline: Timeline) -> StepRecord:
        if not self.active:
            return self.fallback.step(work, start, timeline)
        job, K, hw = self.job, self.job.controllers, self.job.hardware
        tally, totals, t = Tally(K), StepTotals(K), np.full(K, start)
        ref_move = cost.offload_seconds(job.policy.weight_bytes / self.reference.count, hw)
        judge_off = phases.judge_offload_seconds(job)
        for i, wave in enumerate(work.waves):
            t = self.data(timeline, work.step, t, wave, tally)
            if i > 0:
                back = max(judge_off, ref_move) + phases.policy_wake_seconds(job, from_host=True)
                t = stage(job, timeline, work.step, t, back, "swap", "swap/back_to_policy")
                tally.add_slices("swap", back)
            g, t = generate_wave(job, timeline, work.step, wave, t, self.whole, tally, totals)
            over = phases.policy_offload_seconds(job) + max(phases.judge_wake_seconds(job), ref_move)
            t = stage(job, timeline, work.step, t, over, "swap", "swap/policy_to_judge_and_reference")
            tally.add_slices("swap", over)
            j = phases.judge(job, timeline, work.step, wave, at_each(t, wave.samples), self.judges,
                             at_each(t, self.judges.engines), streaming=False)
            totals.add_judging(j)
            ref = phases.reference_seconds(job, wave, self.reference.count)
            ref_end = stage(job, timeline, work.step, t, ref, "reference", "rollout/reference", self.reference)
            end = np.maximum(j.end, ref_end)
            tally.add_slices("rollout/judge", j.end - t)
            tally.add_slices("rollout/reference", end - j.end)  # the part not hidden behind the judge
            t = end
        off = max(judge_off, ref_move)
        t = stage(job, timeline, work.step, t, off, "swap", "swap/judge_and_reference_offload")
        tally.add_slices("swap", off)
        return self.finish(work, start, t, tally, totals, timeline, self.whole, reference_done=True)

"""`disaggregated`: dedicated training and generation devices, pipelined with staleness 1.

Each slice keeps `train_devices` trainer devices and D - train_devices generation devices, the
latter split into rollout and judge devices (`generation_rollout_devices`; with no device left for
the judge, rollout and judge take turns on the generation devices, swapping every wave). Nothing
is offloaded: every role stays resident.

The loop follows the trainer's pipelined controller loop: step t's rows go to the trainers, the
controller immediately runs the rollout phase of step t+1 with the weights of step t-1, then
waits for training and syncs the new weights (gathered over the trainers and published to the
engines over NVLink or the network). Step 1 rolls out alone; in steady state a step lasts
max(update, next rollout) + sync. A step's record holds its own rollout phases (run during the
previous step) and its update phases, so the phases sum to more than its duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gcore_rl.costmodel import cost, phases
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.phases import DeviceRange, Tally, stage
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.sim.results import StepRecord
from gcore_rl.sim.strategies import StepTotals, make_record
from gcore_rl.sim.workload import StepWork


@dataclass
class _Rollout:
    start: np.ndarray  # [K]
    end: np.ndarray  # [K]
    tally: Tally
    totals: StepTotals


class Disaggregated:
    name = "disaggregated"

    def __init__(self, job: Job):
        self.job = job
        D, trainers, gen = job.slice_devices, job.train_devices, job.generation_rollout_devices
        self.trainers = DeviceRange(0, trainers)
        self.generation = DeviceRange(trainers, D - trainers)
        self.rollout = DeviceRange(trainers, gen, job.policy_tp)
        judge_devices = D - trainers - gen
        self.turns = job.judge is not None and judge_devices == 0  # rollout and judge share the generation devices
        if self.turns:
            self.judges = DeviceRange(trainers, gen, job.judge_tp)
        elif job.judge is not None:
            self.judges = DeviceRange(trainers + gen, judge_devices, job.judge_tp)
        else:
            self.judges = None

    def run(self, works: Sequence[StepWork], timeline: Timeline) -> list[StepRecord]:
        job = self.job
        rollouts = [self.rollout_phase(works[0], np.zeros(job.controllers), timeline)]
        records: list[StepRecord] = []
        previous_end = 0.0
        for t, work in enumerate(works):
            train_start = max(float(rollouts[t].end.max()), previous_end)
            if t + 1 < len(works):  # the next rollout starts as soon as this step's rows are sent
                next_start = rollouts[t].end if t == 0 else np.full(job.controllers, previous_end)
                rollouts.append(self.rollout_phase(works[t + 1], next_start, timeline))
            update_end = self.update(work, train_start, rollouts[t].tally, timeline)
            sync_start = max(update_end, float(rollouts[t + 1].end.max())) if t + 1 < len(works) else update_end
            sync = cost.weight_sync_seconds(job.policy, job.hardware, job.costs, job.gpus)
            end = float(stage(job, timeline, work.step, sync_start, sync, "sync", "update/sync")[0])
            tally = rollouts[t].tally
            tally.add("update/sync", sync)
            critical = int(np.argmax(rollouts[t].end))
            rollout_seconds = float((rollouts[t].end - rollouts[t].start).max())
            records.append(make_record(job, work, self.trainers.count, previous_end, end, tally.phases(critical),
                                       rollouts[t].totals, rollout_seconds, rollout_devices=self.rollout.count))
            previous_end = end
        return records

    def update(self, work: StepWork, start: float, tally: Tally, timeline: Timeline) -> float:
        """Prepare + train on the trainer devices of every slice (FSDP over all of them)."""
        job = self.job
        data = phases.update_data_seconds(job, work)
        t = stage(job, timeline, work.step, start, data, "data", "update/data", self.trainers)
        prepare, train = phases.update_seconds(job, work, self.trainers.count, 1 + job.reference)
        t = stage(job, timeline, work.step, t, prepare, "actor", "update/prepare", self.trainers)
        t = stage(job, timeline, work.step, t, train, "actor", "update/train", self.trainers)
        tally.add("update/data", data)
        tally.add("update/prepare", prepare)
        tally.add("update/train", train)
        return float(t[0])

    def rollout_phase(self, work: StepWork, start: np.ndarray, timeline: Timeline) -> _Rollout:
        """All waves of one step on the generation devices, from `start` [K]."""
        job, K = self.job, self.job.controllers
        tally, totals, t = Tally(K), StepTotals(K), np.asarray(start, np.float64).copy()
        for wave in work.waves:
            seconds = phases.wave_data_seconds(job, wave)
            t = stage(job, timeline, work.step, t, seconds, "data", "rollout/data", self.generation)
            tally.add_slices("rollout/data", seconds)
            g = phases.generate(job, timeline, work.step, wave, t, self.rollout)
            totals.add_generation(g)
            if self.judges is None:
                tally.add_slices("rollout/generate", g.end - t)
                t = g.end
            elif self.turns:
                t = self._judge_in_turn(work, wave, t, g, tally, totals, timeline)
            else:
                ready = np.repeat(t[:, None], self.judges.engines, axis=1)
                j = phases.judge(job, timeline, work.step, wave, g.finish, self.judges, ready, streaming=True)
                totals.add_judging(j)
                end = np.maximum(g.end, j.end)
                tally.add_slices("rollout/generate", g.end - t)
                tally.add_slices("rollout/judge", end - g.end)
                t = end
        return _Rollout(start=np.asarray(start, np.float64), end=t, tally=tally, totals=totals)

    def _judge_in_turn(self, work, wave, t, g, tally, totals, timeline) -> np.ndarray:
        """One generation device set: swap to the judge, judge everything, swap back to the policy."""
        job = self.job
        tally.add_slices("rollout/generate", g.end - t)
        over = phases.policy_offload_seconds(job) + phases.judge_wake_seconds(job)
        t = stage(job, timeline, work.step, g.end, over, "swap", "swap/policy_to_judge", self.generation)
        ready = np.repeat(t[:, None], self.judges.engines, axis=1)
        arrival = np.repeat(t[:, None], wave.samples, axis=1)
        j = phases.judge(job, timeline, work.step, wave, arrival, self.judges, ready, streaming=False)
        totals.add_judging(j)
        tally.add_slices("rollout/judge", j.end - t)
        back = phases.judge_offload_seconds(job) + phases.policy_wake_seconds(job, from_host=True)
        end = stage(job, timeline, work.step, j.end, back, "swap", "swap/judge_to_policy", self.generation)
        tally.add_slices("swap", over + back)
        return end

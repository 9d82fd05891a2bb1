"""`streaming`: dedicated rollout and training devices, generation never waiting for a step to end.

The asynchronous schedules of AReaL, StreamRL and verl's fully-async trainer, at the level of
detail the rest of the simulator has. Each slice keeps `train_devices` trainer devices; the others
hold policy engines (no judge: rule rewards). The samples of all steps form one queue per slice,
step after step; an engine with a free slot takes the next sample (continuous batching across
step boundaries, so the long tail of one step overlaps the bulk of the next), subject to

- **bounded staleness** k (`placement.max_staleness`): a sample of step s (0-based; trained by
  update s + 1, when the trainer holds weights version s) starts only on weights of version
  s - k or newer, so it is at most k versions old when trained. k may be fractional, as verl's
  `staleness_threshold`: on weights of version v the engines may start the samples of steps up
  to v + k, i.e. at most (1 + k) steps' samples ahead of the trainer (k = 0.5: the rest of the
  step being trained and half of the next);
- **weight syncs**: when an update ends, its weights reach the engines. Without partial rollout
  the engines stop taking samples and finish the ones they hold first (the tail is paid at every
  sync); with `placement.partial_rollout` they interrupt at once and, after the sync, resume every
  interrupted sequence on the new weights, re-prefilling the tokens it holds.

The trainer takes samples in the order they finish, as the streaming systems do: its u-th update
trains on the next step's worth of completed samples (whatever step they were drawn for, so a
long sample does not hold up the batch it was drawn in), and with `placement.train_chunks` = C
on each C-th of them as soon as that many have finished (verl's require_batches), syncing after
the last part. The gate bounds how far generation runs ahead; a sample that outlives several
syncs is trained later and so more stale (`stream/staleness_max` per step says how much; with
partial rollout a sample counts from the weights it started on). `placement.recompute_logprobs: false` drops the old-log-prob pass (the
engines' log-probs are used, as verl's fully-async trainer does).

An event loop over sample completions: between two events an engine's active count is constant,
so `cost.decode_segment_seconds` prices the stretch in closed form, as in `decode.py`. A new
sample's prompt is prefilled when it joins (a G-th of the prompt per sample: a group shares its
prompt's KV). A step's record holds the trainer's view: `rollout/generate` is the time the
trainer waited for samples (verl's `gen` in its fully-async tables), then prepare, train and sync.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gcore_rl.costmodel import cost, phases
from gcore_rl.costmodel.agent import WaveTurns
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.phases import DeviceRange
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.errors import ConfigError
from gcore_rl.sim.results import StepRecord
from gcore_rl.sim.strategies import StepTotals, make_record
from gcore_rl.sim.workload import StepWork


@dataclass
class _Sample:
    step: int
    slice: int
    context: int  # prompt tokens
    output: int  # response tokens to decode
    prefill: float  # prompt tokens this sample prefills (its share of the group's prompt)
    progress: float = 0.0  # step + (position in the step) / (samples of the step): its place in the stream
    version: int = -1  # weights version it started on (with partial rollout: the oldest of its tokens)
    later: list = field(default_factory=list)  # multi-turn: (answer seconds, answer tokens, next turn's tokens)


@dataclass
class _Engine:
    """One policy engine: its clock, the sequences it decodes and the decode-step count they share."""

    index: int
    slice: int
    devices: np.ndarray  # [tp] global device ids
    time: float = 0.0
    steps: int = 0  # decode steps done since the engine started
    kv: float = 0.0  # KV tokens held at `steps`
    active: list = field(default_factory=list)  # heap of (finish step, sample id)
    busy_since: float | None = None  # start of the current busy stretch (for the timeline)
    epoch: int = 0  # bumped when the engine's next event changes (stale heap entries are skipped)
    away: int = 0  # multi-turn samples of this engine waiting for an answer
    back: deque = field(default_factory=deque)  # answered samples waiting for a slot (they return to this engine)

    @property
    def holds(self) -> bool:
        """Whether the engine still has a sample to finish (decoding, waiting for an answer or for a slot)."""
        return bool(self.active) or self.away > 0 or bool(self.back)


class Streaming:
    name = "streaming"

    def __init__(self, job: Job):
        if job.judge is not None:
            raise ConfigError("strategies", "streaming models rule rewards only (no judge engines yet)")
        self.job = job
        D, T = job.slice_devices, job.train_devices
        self.trainers = DeviceRange(0, T)
        self.rollout = DeviceRange(T, D - T, job.policy_tp)

    def run(self, works: Sequence[StepWork], timeline: Timeline) -> list[StepRecord]:
        return _Run(self.job, self.trainers, self.rollout, works, timeline).records()


class _Run:
    """One simulation of the streaming schedule (the state of the event loop)."""

    def __init__(self, job: Job, trainers: DeviceRange, rollout: DeviceRange, works: Sequence[StepWork],
                 timeline: Timeline):
        self.job, self.works, self.timeline = job, works, timeline
        self.trainers = trainers
        self.k = job.max_staleness
        self.samples: list[_Sample] = []
        self.queues = [deque() for _ in range(job.controllers)]  # sample ids per slice, step-major
        self.bounds = [0]  # the trainer's u-th batch is the completions bounds[u] .. bounds[u + 1] - 1
        for work in works:
            self.bounds.append(self.bounds[-1] + self._enqueue(work))
        self.completed: list[tuple[float, int]] = []  # (time, sample id) in completion order
        self.staleness: list[np.ndarray] = []  # [update] versions each trained sample lags behind the trainer
        context = np.array([s.context + s.output for s in self.samples], dtype=np.float64)
        self.slots = cost.concurrent_sequences(job.policy, job.hardware, rollout.tp, job.memory_utilization,
                                               job.max_num_seqs, float(context.mean()) if len(context) else 1.0)
        devices = rollout.engine_devices(job)  # [K, E, tp]
        self.engines = [_Engine(k * rollout.engines + e, k, devices[k, e])
                        for k in range(job.controllers) for e in range(rollout.engines)]
        self.tp = rollout.tp
        self.version = 0
        self.blocked_until = 0.0  # engines take nothing before (a sync in progress)
        self.draining = False
        self.syncing = False  # an update or its sync is under way
        self.events: list = []  # (time, order, kind, payload)
        self.order = itertools.count()
        self.trainer_free = 0.0
        self.next_update = 0  # the step the trainer trains next
        self.update_times: list[dict[str, float]] = []

    # ------------------------------------------------------------------ the work

    def _enqueue(self, work: StepWork) -> int:
        """Queue every sample of every wave of `work` on its slice; returns their count."""
        G = self.job.workload.group_size
        first, count = len(self.samples), 0
        for wave in work.waves:
            K, P = wave.prompt_tokens.shape
            # a prompt's images pass the vision tower once, priced as the prompt tokens of as many FLOPs
            encode = np.zeros((K, P)) if wave.images is None else wave.images.flops / (2.0 * self.job.policy.params)
            for k in range(K):
                for p in range(P):
                    prompt = int(wave.prompt_tokens[k, p])
                    for g in range(G):
                        self.queues[k].append(len(self.samples))
                        sample = _Sample(work.step, k, prompt, int(wave.response_tokens[k, p, g]),
                                         (prompt + float(encode[k, p])) / G)
                        if wave.turns is not None:
                            sample.output, sample.later = _turns(wave.turns, k, p, g)
                        self.samples.append(sample)
                        count += 1
        per_slice = count / self.job.controllers
        for sid in range(first, len(self.samples)):  # its place among its slice's samples of the step
            sample = self.samples[sid]
            sample.progress = work.step + ((sid - first) % per_slice) / per_slice
        return count

    # ------------------------------------------------------------------ the loop

    def records(self) -> list[StepRecord]:
        for engine in self.engines:
            self._admit(engine, 0.0)
        while self.events:
            time, _, kind, payload = heapq.heappop(self.events)
            if kind == "engine":
                engine, epoch = payload
                if epoch == engine.epoch:
                    self._complete(engine, time)
            elif kind == "answer":
                self._answered(*payload, time)
            elif kind == "sync":
                self._sync(time)
        return self._records()

    def _push(self, time: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, payload))

    def _segment(self, engine: _Engine, steps: int) -> float:
        """Seconds for `engine` to decode `steps` more steps with its current sequences."""
        return cost.decode_stretch_seconds(steps, len(engine.active), engine.kv, self.job.policy, self.job.hardware,
                                           self.job.costs, self.tp)

    def _schedule(self, engine: _Engine) -> None:
        """Push the engine's next completion (or nothing when it holds no sequence)."""
        engine.epoch += 1
        if not engine.active:
            self._close_busy(engine)
            return
        if engine.busy_since is None:
            engine.busy_since = engine.time
        steps = engine.active[0][0] - engine.steps
        self._push(engine.time + self._segment(engine, steps), "engine", (engine, engine.epoch))

    def _close_busy(self, engine: _Engine) -> None:
        if engine.busy_since is not None and engine.time > engine.busy_since:
            self.timeline.add("rollout", "rollout/generate", self.next_update, engine.devices, engine.busy_since,
                              engine.time)
        engine.busy_since = None

    def _advance(self, engine: _Engine, time: float) -> None:
        """Bring the engine's decoding up to `time` (no completion in between)."""
        if engine.active and time > engine.time:
            horizon = engine.active[0][0] - engine.steps
            steps = self._steps_within(engine, horizon, time - engine.time)
            engine.kv += len(engine.active) * steps
            engine.steps += steps
        engine.time = max(engine.time, time)

    def _steps_within(self, engine: _Engine, horizon: int, seconds: float) -> int:
        """Most whole decode steps (< horizon) the engine finishes within `seconds`."""
        ends = np.arange(horizon)
        spent, _ = cost.decode_segment_seconds(np.zeros(horizon), ends, len(engine.active), engine.kv,
                                               self.job.policy, self.job.hardware, self.job.costs, self.tp)
        return int(np.searchsorted(spent, seconds, side="right")) - 1

    def _complete(self, engine: _Engine, time: float) -> None:
        """The engine's first sequence(s) finished at `time`."""
        engine.kv += len(engine.active) * (engine.active[0][0] - engine.steps)
        engine.steps = engine.active[0][0]
        engine.time = time
        while engine.active and engine.active[0][0] == engine.steps:
            _, sid = heapq.heappop(engine.active)
            sample = self.samples[sid]
            engine.kv -= sample.context + sample.output
            if sample.later:  # a turn ended: the sample leaves the batch until its answer arrives
                sample.context += sample.output
                engine.away += 1
                self._push(time + sample.later[0][0], "answer", (engine, sid))
            else:
                self._finished(sid, time)
        self._admit(engine, time, new=not self.draining)
        self._drained(time)

    def _answered(self, engine: _Engine, sid: int, time: float) -> None:
        """A multi-turn sample's answer arrived at `time`: it returns to its engine (which holds its prefix)."""
        engine.away -= 1
        engine.back.append(sid)
        if len(engine.active) < self.slots:  # else it joins when a slot frees
            self._advance(engine, time)  # (an engine past `time`, e.g. syncing, takes it at its own clock)
            self._admit(engine, time, new=not self.draining)

    def _drained(self, time: float) -> None:
        """Start the sync a drain waits for once no engine holds a sample."""
        if self.draining and not any(e.holds for e in self.engines):
            self._start_sync(max(time, self.update_end))

    def _admit(self, engine: _Engine, time: float, new: bool = True) -> None:
        """Fill the engine's free slots: answered samples first (their answers prefilled), then, with `new`, from
        its slice's queue as far as staleness allows."""
        queue = self.queues[engine.slice]
        engine.time = max(engine.time, time, self.blocked_until)
        prefill = 0.0
        while len(engine.active) < self.slots:
            if engine.back:
                sid = engine.back.popleft()
                sample = self.samples[sid]
                _, answer, sample.output = sample.later.pop(0)
                sample.context += answer
                prefill += answer
            elif new and queue:
                sample = self.samples[queue[0]]
                if sample.progress >= self.version + 1 + self.k:
                    break  # generated now, it would be more than k versions old when trained
                sid = queue.popleft()
                sample.version = self.version
                prefill += sample.prefill
            else:
                break
            engine.kv += sample.context
            heapq.heappush(engine.active, (engine.steps + max(1, sample.output), sid))
        if prefill:
            if engine.busy_since is None:
                engine.busy_since = engine.time
            engine.time += float(cost.prefill_seconds(prefill, self.job.policy, self.job.hardware, self.job.costs,
                                                      self.tp))
        self._schedule(engine)

    def _finished(self, sid: int, time: float) -> None:
        self.completed.append((time, sid))
        if len(self.completed) == self.bounds[min(self.next_update + 1, len(self.works))]:
            self._try_update()

    # ------------------------------------------------------------------ the trainer

    def _try_update(self) -> None:
        """Train on the next batch (the next samples to complete) once it is complete, each part as soon as it is."""
        s = self.next_update
        if s >= len(self.works) or len(self.completed) < self.bounds[s + 1] or self.syncing:
            return
        self.syncing = True
        job, work = self.job, self.works[s]
        passes = job.reference + job.recompute_logprobs
        prepare, train = phases.update_seconds(job, work, self.trainers.count, passes)
        batch = self.completed[self.bounds[s]:self.bounds[s + 1]]
        C = job.train_chunks
        ready = [batch[int(np.ceil(c * len(batch) / C)) - 1][0] for c in range(1, C + 1)]
        t, waited = self.trainer_free, 0.0
        for r in ready:  # each part: wait for its samples, then prepare + train a C-th of the batch
            waited += max(0.0, r - t)
            start = max(t, r)
            t = start + (prepare + train) / C
            self.timeline.add("actor", "update/train", s, self.trainers.devices(job), start, t)
        self.update_times.append({"start": self.trainer_free, "waited": waited, "prepare": prepare, "train": train,
                                  "update_end": t, "sync_end": None})
        self.update_end = t
        self.staleness.append(np.array([s - self.samples[sid].version for _, sid in batch], dtype=np.float64))
        self._push(t, "sync", None)

    def _sync(self, time: float) -> None:
        """The update ended at `time`: interrupt the engines (partial rollout) or let them drain first."""
        if self.job.partial_rollout:
            for engine in self.engines:
                self._advance(engine, time)
                self._close_busy(engine)
                engine.epoch += 1  # no completion until the sync is over
            self._start_sync(time)
            return
        self.draining = True
        self._drained(time)

    def _start_sync(self, time: float) -> None:
        job = self.job
        seconds = cost.weight_sync_seconds(job.policy, job.hardware, job.costs, job.gpus)
        end = time + seconds
        self.timeline.add("sync", "update/sync", self.next_update, self.trainers.devices(job), time, end)
        for engine in self.engines:
            self.timeline.add("sync", "update/sync", self.next_update, engine.devices, time, end)
        self.draining = False
        self.syncing = False
        self.version += 1
        self.blocked_until = end
        self.update_times[-1]["sync_start"] = time
        self.update_times[-1]["sync_end"] = end
        self.trainer_free = end
        self.next_update += 1
        for engine in self.engines:
            if engine.active:  # interrupted (partial rollout): re-prefill what each sequence holds
                engine.time = end + float(cost.prefill_seconds(engine.kv, job.policy, job.hardware, job.costs, self.tp))
                engine.busy_since = end
            self._admit(engine, end)
        self._try_update()

    # ------------------------------------------------------------------ records

    def _records(self) -> list[StepRecord]:
        job, records, previous = self.job, [], 0.0
        for s, work in enumerate(self.works):
            u = self.update_times[s]
            totals = StepTotals(job.controllers)
            staleness = self.staleness[s]
            totals.features.update({"stream/staleness_max": float(staleness.max()),
                                    "stream/staleness_mean": float(staleness.mean()),
                                    "stream/batch_samples": float(len(staleness))})
            phase_seconds = {"rollout/generate": u["waited"], "update/prepare": u["prepare"],
                             "update/train": u["train"],
                             "update/sync": u["sync_end"] - u["sync_start"]}
            if u["sync_start"] > u["update_end"]:  # the engines were still finishing their sequences
                phase_seconds["rollout/generate"] += u["sync_start"] - u["update_end"]
            records.append(make_record(job, work, self.trainers.count, previous, u["sync_end"], phase_seconds, totals,
                                       u["waited"], rollout_devices=self.job.slice_devices - self.trainers.count))
            previous = u["sync_end"]
        return records


def _turns(turns: WaveTurns, k: int, p: int, g: int) -> tuple[int, list[tuple[float, int, int]]]:
    """A multi-turn sample's first turn's tokens and, for each later turn, (its answer's seconds, the answer's
    tokens, the turn's tokens)."""
    count = int((turns.turn_tokens[k, p, g] > 0).sum())
    later = [(float(turns.tool_seconds[k, p, g, t - 1]), int(turns.observation_tokens[k, p, g, t - 1]),
              int(turns.turn_tokens[k, p, g, t])) for t in range(1, count)]
    return int(turns.turn_tokens[k, p, g, 0]), later

"""A controller's view of its device slice: who generates, who scores, who trains.

`SliceClient` hides where the slice's device workers run (in this process or as Ray actors, see
`handles.py`) and how the plan laid roles out on them:

- rollout: prompts are split over the slice's rollout devices; samples (a language policy's completions, a
  diffusion policy's images) come back as a stream as they finish, and with reward models (judge, scalar RM) each one is handed to a free
  reward device at once (`partial`, `disaggregated`) or after the wave (`colocate`, where the
  reward models need the same devices). Scoring requests are batched dynamically: whatever
  finished while every reward device was busy goes out together to the next free one.
- interleave: generation on every device; when the wave is complete, its completions go to the
  reward devices and, at the same time, to the reference devices for their reference log-probs.
- update: the step's rows are split over the slice's trainer workers with equal row counts and
  balanced token counts (`balance_rows`); each prepares and trains its rows (a diffusion job's rows come split
  already, `start_train_rows`). With the critic on
  devices of its own (`placement.critic_devices`) the rows are split over the critic devices too:
  they return the values first (`critic_step`'s first item), which go to the trainers with the rows
  for GAE, and go on to the critic's update while the trainers prepare and train.
- dynamic placement: every device of the slice hosts both the policy engine and the reward
  models; `apply_plan(plan)` takes a new plan version's split (who generates, who scores) from the
  next rollout on, `rollout_load` reports the device-seconds each side used (the rebalancer's input)
  and `rollout_work` the tokens behind them.
- sync: time-shared plans gather the new weights straight into each device's engine, tensor by
  tensor; `disaggregated` (and a slice whose critic devices also generate) has the slice's
  publishing trainer stream them in buckets of about
  `bucket_bytes` (`runtime.weight_bucket_mib`) through the object store, from where the rollout devices load each bucket
  (the controller only passes references, and holds at most two buckets in flight, so no full
  second copy of the model exists at any time).
- restart in place: a device that holds no trainer shard (a `disaggregated` rollout or reward
  device) and whose handle is `restartable` may die in the rollout phase without failing the step:
  the client revives it, gives its engine the weights last published to it, and sends it again
  the prompts of its broken stream (with the same seed; samples that had already arrived are not
  taken twice) or its unanswered scoring batch. To have those weights, the client then keeps the
  last sync's buckets alive: one CPU copy of the policy per slice in the object store. Any other
  lost worker (a trainer: its death breaks the trainer group's collectives) fails the step, for
  the job to be restarted from its checkpoint (runtime/healing.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gcore_rl.controller.handles import (
    END,
    WorkerHandle,
    WorkerLost,
    next_item,
    next_ref,
    result,
    results,
    wait_any,
)
from gcore_rl.controller.seeds import device_seed
from gcore_rl.controller.worker_api import WorkerAPI
from gcore_rl.data.balance import balance_rows, imbalance
from gcore_rl.placement.plan import Plan, WorkerSpec, reward_roles
from gcore_rl.placement.rebalance import RolloutLoad
from gcore_rl.records import (
    Completion,
    EngineRounds,
    ModelScores,
    RewardInput,
    RolloutWork,
    TokenBatch,
    Verdict,
)
from gcore_rl.rollout.sampling import SamplingConfig

WEIGHT_BUCKET_BYTES = 64 * 2**20
"""Size a published weight bucket reaches before it is sent, unless the client is given another."""

SampleKey = tuple[int, int]
"""(prompt index, sample index) of a completion within one generate call."""


@dataclass
class _StreamPart:
    """One rollout device's share of a generate call, and the samples of it that have arrived."""

    handle: WorkerHandle
    offset: int
    prompt_ids: list
    seed: int
    incarnation: int = 0
    seen: set[SampleKey] = field(default_factory=set)

    def take(self, chunk: list[Completion]) -> list[Completion]:
        """The completions of `chunk` not taken before, with prompt indices relative to the whole call."""
        fresh = []
        for c in chunk:
            c.prompt_index += self.offset
            if (c.prompt_index, c.sample_index) not in self.seen:
                self.seen.add((c.prompt_index, c.sample_index))
                fresh.append(c)
        return fresh


@dataclass
class _ScoreRequest:
    """A batch of samples sent to one reward device."""

    device: WorkerHandle
    keys: tuple[SampleKey, ...]
    inputs: tuple[RewardInput, ...]
    incarnation: int = 0

    def send(self):
        return self.device.call(WorkerAPI.score_samples, list(self.inputs))


@dataclass
class _ReferenceRequest:
    """A share of a wave's completions sent to one reference device (`interleave`)."""

    device: WorkerHandle
    completions: list[Completion]
    incarnation: int = 0

    def send(self):
        return self.device.call(WorkerAPI.reference_logprobs, self.completions)


@dataclass
class RolloutResult:
    """Completions of one generate call (prompt-major) and the reward models' verdicts on each, by kind."""

    completions: list[Completion]
    scores: dict[str, dict[SampleKey, Verdict]] = field(default_factory=dict)

    def add(self, keys: Sequence[SampleKey], scores: ModelScores) -> None:
        for kind, verdicts in scores.items():
            self.scores.setdefault(kind, {}).update(zip(keys, verdicts, strict=True))

    def keys(self) -> list[SampleKey]:
        """Each sample's key, in the completions' order."""
        return [(c.prompt_index, c.sample_index) for c in self.completions]

    def verdicts(self, kinds: Iterable[str]) -> dict[str, list[Verdict]]:
        """The verdicts of each of `kinds` on every sample, in the completions' order."""
        keys = self.keys()
        return {kind: [self.scores[kind][k] for k in keys] for kind in kinds}


def split_evenly(items: Sequence, parts: int) -> list[tuple[int, list]]:
    """(offset, chunk) pairs: `items` in `parts` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        out.append((start, list(items[start:end])))
        start = end
    return out


class SliceClient:
    """Calls the device workers of one controller's slice (see the module docstring)."""

    def __init__(self, handles: Sequence[WorkerHandle], specs: Sequence[WorkerSpec], job_plan: Plan,
                 on_restart: Callable[[int, int, str, float], None] | None = None,
                 row_cost: Callable[[float], float] | None = None, sequence_parallel: int = 1,
                 bucket_bytes: int = WEIGHT_BUCKET_BYTES):
        """`handles[i]` calls the worker of `specs[i]`; `job_plan` says who generates, scores and trains.
        `on_restart(device, step, cause, revive_s)` is told of each device restarted in place, with the seconds
        from its loss seen to its return. `row_cost(length)`
        weighs a row when the step's rows are split over the trainers (`SequenceCost` of the policy;
        default: its tokens). With `sequence_parallel` N > 1 the rows are split over groups of N
        consecutive trainers (`train.sequence_parallel`), and every trainer of a group gets its group's rows.
        `bucket_bytes`: the size of a published weight bucket."""
        self.row_cost = row_cost or float
        self.bucket_bytes = bucket_bytes
        self.sequence_parallel = sequence_parallel
        self.balance: dict[str, float] = {}  # the last split's imbalance metrics
        self.split: dict[str, list[int] | int] = {}  # the last split's inputs: each row's tokens, the trainer groups
        pairs = list(zip(handles, specs, strict=True))
        self.handles = [h for h, _ in pairs]
        self.devices = [s.device for _, s in pairs]
        self.trainers = [h for h, s in pairs if "actor" in s.roles]
        self.critics = [h for h, s in pairs if s.critic_rank is not None]  # the critic apart from the actor
        self.updaters = [h for h, s in pairs if s.group_rank is not None]  # the devices of the update phase
        self.generation = [h for h, s in pairs if s.group_rank is None]  # disaggregated: devices that train nothing
        self.publisher = next((h for h, s in pairs if s.publishes_weights), None)
        self.policy_handles = [h for h, s in pairs if "rollout" in s.roles]  # devices with a policy engine
        self.on_restart = on_restart
        self.step = 0
        self.published: list = []  # the last sync's buckets, kept only while a rollout device can be restarted
        self.published_version = 0
        self.apply_plan(job_plan)

    def apply_plan(self, job_plan: Plan) -> None:
        """Take the rollout-phase split of `job_plan` (a new version after a dynamic move): its rollout
        devices generate from the next rollout on, its reward devices score."""
        rollout = set(job_plan.devices_of("rollout", "rollout"))
        scoring = {d for role in reward_roles(job_plan.roles) for d in job_plan.devices_of("rollout", role)}
        reference = set(job_plan.devices_of("rollout", "reference"))
        self.plan = job_plan
        self.rollout = [h for h, d in zip(self.handles, self.devices, strict=True) if d in rollout]
        self.scorers = [h for h, d in zip(self.handles, self.devices, strict=True) if d in scoring]
        self.referencers = [h for h, d in zip(self.handles, self.devices, strict=True) if d in reference]
        if not self.rollout:
            raise ValueError(f"the plan gives devices {self.devices} no rollout device")

    # ---- rollout ------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingConfig, seed: int) -> list[Completion]:
        """All completions of `prompt_ids` (prompt-major), generated over the rollout devices."""
        return self.rollout_and_score(prompt_ids, sampling, seed, on_finished=lambda chunk: []).completions

    def rollout_and_score(self, prompt_ids: Sequence[list[int]], sampling: SamplingConfig, seed: int,
                          on_finished: Callable[[list[Completion]], list[RewardInput]],
                          reference: bool = False) -> RolloutResult:
        """Generate, and score every completion with the reward models as it finishes.

        `on_finished(chunk)` is called in this process for each chunk of finished completions
        (prompt indices relative to `prompt_ids`) and returns the reward-model inputs for them,
        one per completion, or [] to score nothing. Waits on generation and scoring at the same time.
        With `reference` and a plan that puts the reference in the rollout phase (`interleave`), the
        finished wave is also split over the reference devices, which fill each completion's
        `ref_logprobs` while the reward devices score.
        """
        streams: dict = {}
        parts = split_evenly(prompt_ids, len(self.rollout))
        for index, (handle, (offset, part)) in enumerate(zip(self.rollout, parts, strict=True)):
            if part:
                self._open_stream(streams, _StreamPart(handle, offset, part, device_seed(seed, index)), sampling)
        out = RolloutResult(completions=[])
        waiting: list[tuple[SampleKey, RewardInput]] = []
        idle = list(self.scorers)
        in_flight: dict = {}
        unreferenced = bool(reference and self.referencers)
        while streams or in_flight or waiting or unreferenced:
            if waiting and idle and (self.plan.traits.streams_to_scorers or not streams):
                for scorer, (_, batch) in zip(idle, split_evenly(waiting, len(idle)), strict=True):
                    if batch:
                        keys, inputs = zip(*batch, strict=True)
                        self._send(in_flight, _ScoreRequest(scorer, keys, inputs))
                idle = [j for j in idle if all(j is not r.device for r in in_flight.values())]
                waiting = []
            if unreferenced and not streams:  # the wave is complete: its reference log-probs, after the
                # scoring went out (usually the longer of the two), so both run at once
                for device, (_, share) in zip(self.referencers, split_evenly(out.completions, len(self.referencers)),
                                              strict=True):
                    if share:
                        self._send(in_flight, _ReferenceRequest(device, share))
                unreferenced = False
            for item in wait_any([*streams, *in_flight]):
                if item in streams:
                    part = streams.pop(item)
                    try:
                        chunk = next_item(item)
                    except WorkerLost as lost:
                        self._recover(part.handle, part.incarnation, lost)
                        self._open_stream(streams, part, sampling)  # the same prompts and seed, from the start
                        continue
                    if chunk is END:
                        continue
                    streams[item] = part
                    chunk = part.take(chunk)
                    out.completions.extend(chunk)
                    inputs = on_finished(chunk) if chunk else []
                    if inputs:
                        waiting.extend(zip([(c.prompt_index, c.sample_index) for c in chunk], inputs, strict=True))
                else:
                    request, answer = self._answer(in_flight, item)
                    if answer is None:  # its device was revived and has the request again
                        continue
                    if isinstance(request, _ReferenceRequest):
                        for completion, values in zip(request.completions, answer, strict=True):
                            completion.ref_logprobs = values
                    else:
                        out.add(request.keys, answer)
                        idle.append(request.device)
        out.completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
        return out

    def _open_stream(self, streams: dict, part: _StreamPart, sampling: SamplingConfig) -> None:
        part.incarnation = part.handle.incarnation
        streams[part.handle.stream(WorkerAPI.generate_stream, part.prompt_ids, sampling, part.seed)] = part

    def _send(self, in_flight: dict, request: _ScoreRequest | _ReferenceRequest) -> None:
        request.incarnation = request.device.incarnation
        in_flight[request.send()] = request

    def _answer(self, in_flight: dict, item) -> tuple[_ScoreRequest | _ReferenceRequest, object]:
        """The request behind the finished call `item` and its answer; the answer is None when the device was
        lost, revived and sent the same request again (it stays in flight)."""
        request = in_flight.pop(item)
        try:
            return request, result(item)
        except WorkerLost as lost:
            self._recover(request.device, request.incarnation, lost)
            self._send(in_flight, request)
            return request, None

    def _recover(self, handle: WorkerHandle, incarnation: int, lost: WorkerLost) -> None:
        """Bring back a rollout-phase device whose process died (see the module docstring), or raise
        `lost` when it holds a trainer shard or cannot be restarted. A device already revived since
        the broken call was made (`incarnation`) is not revived twice."""
        if not handle.restartable or any(handle is t for t in self.trainers):
            raise lost
        if handle.incarnation != incarnation:
            return
        lost_at = time.monotonic()
        handle.revive()  # a new process, set up as the first: initial weights, the step's seeds from begin_step
        result(handle.call(WorkerAPI.begin_step, self.step))
        if self.published and any(handle is p for p in self.policy_handles):
            for bucket in self.published:
                result(handle.call(WorkerAPI.load_weights, bucket, self.published_version, False))
            result(handle.call(WorkerAPI.load_weights, {}, self.published_version, True))
        if self.on_restart is not None:
            device = self.devices[next(i for i, h in enumerate(self.handles) if h is handle)]
            self.on_restart(device, self.step, str(lost), time.monotonic() - lost_at)

    # ---- update -------------------------------------------------------------------------

    def start_train(self, batch: TokenBatch) -> list:
        """Send each trainer worker its rows (equal counts, balanced cost); returns the pending results.
        Under sequence parallelism the split is over the groups of trainers, each trainer of a group
        getting the group's rows.

        `balance` then holds ``train/cost_imbalance`` (largest trainer's (group's) estimated cost over
        the mean) and ``train/token_imbalance`` (the same in tokens), and `split` what they were computed
        from (``tokens``: each row's, ``groups``: the parts), which the run records for `--calibrate`."""
        tokens = batch.attention_mask.sum(dim=-1).tolist()
        costs = [self.row_cost(length) for length in tokens]
        parts = balance_rows(costs, len(self.trainers) // self.sequence_parallel)
        self.balance = {"train/cost_imbalance": imbalance(costs, parts), "train/token_imbalance": imbalance(tokens, parts)}
        self.split = {"tokens": [int(t) for t in tokens], "groups": len(parts)}
        critics = self._critic_values(batch, costs) if self.critics else []
        return [self._train([batch.select(torch.tensor(rows)) for rows in parts]), critics]

    def start_train_rows(self, parts: Sequence) -> list:
        """Send trainer group g the rows `parts[g]` as they are (a `WorkerAPI.train` batch of the job's kind: a diffusion
        job's `ImageRows`); returns the pending results, as `start_train`."""
        self.balance, self.split = {}, {}
        return [self._train(parts), []]

    def _train(self, parts: Sequence) -> list:
        """Each trainer's `WorkerAPI.train` call on its group's part (every trainer of a sequence-parallel group gets it)."""
        return [h.call(WorkerAPI.train, parts[i // self.sequence_parallel]) for i, h in enumerate(self.trainers)]

    def _critic_values(self, batch: TokenBatch, costs: list[float]) -> list:
        """Start the critic devices' steps on their rows and fill `batch.old_values` (`[B, T]`) with the
        values they return first; the streams, whose next item is each device's update statistics."""
        parts = balance_rows(costs, len(self.critics))
        streams = [h.stream(WorkerAPI.critic_step, batch.select(torch.tensor(rows)))
                   for h, rows in zip(self.critics, parts, strict=True)]
        values = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for stream, rows in zip(streams, parts, strict=True):
            values[torch.tensor(rows)] = next_item(stream)
        batch.old_values = values
        return streams

    def finish_train(self, pending: list) -> dict[str, float]:
        """Wait for the trainer (and critic) workers; their statistics averaged (maxima for `*max` keys),
        with the split's `balance`."""
        trainers, critics = pending
        return {**reduce_stats(results(trainers)), **reduce_stats([next_item(s) for s in critics]), **self.balance}

    def sync_weights(self, version: int) -> None:
        """Bring the slice's engines to the weights of update `version` (see the module docstring)."""
        if self.publisher is None:  # only devices that generate next load the weights into their engine
            results([h.call(WorkerAPI.sync_weights, version, any(h is r for r in self.rollout)) for h in self.trainers])
            return
        # a trainer that generates loads its own engine as it gathers; the buckets go to the others
        streams = {h: h.bounded_stream(2, WorkerAPI.publish_weights, self.bucket_bytes, version,
                                       any(h is r for r in self.rollout)) for h in self.trainers}
        loading = self._without_trainers(self.rollout)
        in_flight: list = []  # loads of the previous bucket
        keep = any(h.restartable for h in loading)  # a revived rollout device takes the weights from these
        kept = []
        while (bucket := next_ref(streams[self.publisher])) is not END:
            loads = [h.call(WorkerAPI.load_weights, bucket, version, False) for h in loading]
            results(in_flight)  # keep at most two buckets alive
            in_flight = loads
            if keep:
                kept.append(bucket)
        results(in_flight + [h.call(WorkerAPI.load_weights, {}, version, True) for h in loading])
        self.published, self.published_version = kept, version
        self._drain_gather(streams)

    def publish(self, version: int) -> list:
        """Gather the weights of update `version` and leave them in the object store (a collective over
        the trainers): the buckets' references, which `load_published` loads into the rollout devices
        later (rollouts made ahead in a thread, `controller/producer.py`). Only for plans that publish."""
        if self.publisher is None:
            raise ValueError("only a plan whose trainers publish weights to separate rollout devices can publish")
        streams = {h: h.bounded_stream(2, WorkerAPI.publish_weights, self.bucket_bytes) for h in self.trainers}
        buckets = []
        while (bucket := next_ref(streams[self.publisher])) is not END:
            buckets.append(bucket)
        self._drain_gather(streams)
        return buckets

    def _without_trainers(self, handles: Sequence[WorkerHandle]) -> list[WorkerHandle]:
        """`handles` that hold no trainer: those a published bucket is sent to (a trainer's own engine loads
        as it gathers, `publish_weights(load=True)`)."""
        return [h for h in handles if not any(h is t for t in self.trainers)]

    def _drain_gather(self, streams: dict) -> None:
        """End the `publish_weights` streams of the trainers other than the publisher (they only took part in the gather)."""
        for handle, stream in streams.items():
            if handle is not self.publisher:
                while next_ref(stream) is not END:
                    pass

    def load_published(self, buckets: list, version: int) -> None:
        """Load the weights `publish` left in the object store into the slice's rollout devices; kept as
        the weights a revived rollout device is given (`published`)."""
        loading = self._without_trainers(self.rollout)
        results([h.call(WorkerAPI.load_weights, bucket, version, False) for bucket in buckets for h in loading])
        results([h.call(WorkerAPI.load_weights, {}, version, True) for h in loading])
        self.published, self.published_version = list(buckets), version

    # ---- bookkeeping --------------------------------------------------------------------

    def begin_step(self, step: int, handles: Sequence[WorkerHandle] | None = None) -> None:
        """Begin `step` on `handles` (default: every device of the slice). The rollout-phase step (which
        a revived device is told) follows the calls that include a rollout device."""
        handles = self.handles if handles is None else handles
        if any(h is r for h in handles for r in self.rollout):
            self.step = step
        results([h.call(WorkerAPI.begin_step, step) for h in handles])

    def rollout_load(self, phase_s: float = 0.0) -> RolloutLoad:
        """The slice's rollout-phase load so far in the step (`RolloutLoad.from_device_loads`): each
        rollout and reward device's `DeviceLoad`, and `phase_s`, the rollout phase's wall time as the
        controller measured it. A move's cost (`swap_s`) is the largest time a device of the slice
        spent sleeping and waking engines."""
        loads = dict(zip(map(id, self.handles), results([h.call(WorkerAPI.device_load) for h in self.handles]), strict=True))
        return RolloutLoad.from_device_loads([loads[id(h)] for h in self.rollout], [loads[id(h)] for h in self.scorers],
                                             swap_s=max(load.swap_s for load in loads.values()), phase_s=phase_s)

    def rollout_work(self) -> RolloutWork:
        """The work behind `rollout_load`, counted and summed over the slice's devices (`RolloutWork`)."""
        return RolloutWork.total(results([h.call(WorkerAPI.rollout_work) for h in self.handles]))

    def engine_rounds(self) -> dict[str, EngineRounds]:
        """Each role's engine rounds and work so far in the step, summed over the slice's devices (`EngineRounds`)."""
        total: dict[str, EngineRounds] = {}
        for per_device in results([h.call(WorkerAPI.engine_rounds) for h in self.handles]):
            for role, rounds in per_device.items():
                total[role] = total.get(role, EngineRounds()) + rounds
        return total

    def utilisation(self, step_seconds: float, handles: Sequence[WorkerHandle] | None = None) -> dict[str, float]:
        """Per-device busy / swap / idle seconds and memory, averaged over `handles` (default: the slice;
        maxima for `*max`)."""
        handles = self.handles if handles is None else handles
        return reduce_stats(results([h.call(WorkerAPI.utilisation, step_seconds) for h in handles]))

    # ---- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Have the slice's trainers (and critic devices) stage their state and start writing it into `directory`."""
        results([h.call(WorkerAPI.save_checkpoint, directory) for h in self.updaters])

    def finish_checkpoint(self) -> float:
        """Wait for the trainers' checkpoint writes; the longest wait in seconds."""
        return max(results([h.call(WorkerAPI.finish_checkpoint) for h in self.updaters]), default=0.0)

    def load_checkpoint(self, directory: str) -> None:
        """Restore the slice's trainers (and critic devices) from the checkpoint folder `directory` (a
        collective over all trainers, and over the critic group)."""
        results([h.call(WorkerAPI.load_checkpoint, directory) for h in self.updaters])

    def save_policy(self, path: str) -> None:
        result(self.rollout[0].call(WorkerAPI.save_policy, path))

    def close(self) -> None:
        results([h.call(WorkerAPI.close) for h in self.handles])


def reduce_stats(per_worker: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean over workers of each key (max for keys ending in `max`); a key missing on a worker is skipped there."""
    keys = dict.fromkeys(k for stats in per_worker for k in stats)
    out = {}
    for key in keys:
        values = [stats[key] for stats in per_worker if key in stats]
        out[key] = max(values) if key.endswith("max") else sum(values) / len(values)
    return out

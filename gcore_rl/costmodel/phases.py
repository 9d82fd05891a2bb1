"""Building blocks of a simulated step: one wave's generation, its judging, the update phase.

Every function here prices one phase for all K slices at once (arrays over slices [K]), records
what each device did on the `Timeline`, and returns absolute end times. The strategies
(`gcore_rl.sim.strategies`) only decide which devices do what, in which order.

Device numbering follows the trainer's plans: slice k owns devices k*D .. k*D + D - 1; within a
slice a role occupies a contiguous range of local devices, and engine e of a role with tensor
parallelism tp uses `tp` consecutive devices of that range.

A diffusion workload (`Workload.kind`) goes through the same functions: `generate` denoises
images in batches instead of decoding tokens, `judge` sends each image to the reward model, and
`update_seconds` / `reference_seconds` price DiT forwards (`gcore_rl.costmodel.diffusion`).

Prompts with images (`workload.images`) add the vision tower's forwards to the prefill, the
log-prob passes and training, and the decoding and preprocessing of the images to the data plane
(`gcore_rl.costmodel.vision`); their image tokens are already prompt tokens.

The update phase splits each slice's trained rows over its trainer ranks with the runtime's own
`balance_rows` and `SequenceCost` (`trainer_split`) and lasts as long as its slowest rank.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from gcore_rl.costmodel import agent, cost, diffusion, vision
from gcore_rl.costmodel.batching import BatchedRun, serve_in_batches
from gcore_rl.costmodel.decode import DecodeRun, run_engines, start_steps
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.costmodel.work import StepWork, Wave
from gcore_rl.data.balance import SequenceCost, balance_rows, imbalance
from gcore_rl.training.shapes import forward_micro_batches, update_shape


@dataclass(frozen=True)
class DeviceRange:
    """Local devices first .. first + count - 1 of every slice, used by engines of `tp` devices."""

    first: int
    count: int
    tp: int = 1

    @property
    def engines(self) -> int:
        return self.count // self.tp

    def devices(self, job: Job) -> np.ndarray:
        """[K, count] global device ids."""
        D = job.slice_devices
        return np.arange(job.controllers)[:, None] * D + self.first + np.arange(self.count)[None, :]

    def engine_devices(self, job: Job) -> np.ndarray:
        """[K, engines, tp] global device ids of each engine."""
        return self.devices(job).reshape(job.controllers, self.engines, self.tp)


class Tally:
    """Seconds per phase on each slice's critical path (rollout) and globally (update)."""

    def __init__(self, slices: int):
        self.per_slice: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(slices))
        self.shared: dict[str, float] = defaultdict(float)

    def add_slices(self, name: str, seconds) -> None:
        self.per_slice[name] = self.per_slice[name] + seconds

    def add(self, name: str, seconds: float) -> None:
        self.shared[name] += float(seconds)

    def phases(self, critical_slice: int) -> dict[str, float]:
        out = {name: float(values[critical_slice]) for name, values in self.per_slice.items()}
        for name, seconds in self.shared.items():
            out[name] = out.get(name, 0.0) + seconds
        return out


def stage(job: Job, timeline: Timeline, step: int, start, seconds, role: str, what: str,
          where: DeviceRange | None = None) -> np.ndarray:
    """Every device of `where` (default: the whole slice) does `role` for `seconds` from `start` [K]; returns the end [K]."""
    where = where or DeviceRange(0, job.slice_devices)
    start = np.broadcast_to(np.asarray(start, np.float64), (job.controllers,))
    end = start + np.broadcast_to(np.asarray(seconds, np.float64), (job.controllers,))
    timeline.add(role, what, step, where.devices(job), start[:, None], end[:, None])
    return end


# --------------------------------------------------------------------------- controller data plane


def wave_payload_bytes(job: Job, wave: Wave) -> np.ndarray:
    """[K] bytes each controller ships for a wave: prompts to the rollout engines, completions to a
    multimodal judge; under a diffusion workload also every decoded image to the reward model. A
    prompt's images travel as their pixel values (`images.bytes_per_patch` per patch), once to the
    engines and once to a multimodal judge: the completions of a prompt share one `ImageInputs`, and
    a message pickles a shared object once."""
    w = job.workload
    samples = wave.prompts * w.group_size if (job.judge is not None and w.judge_reads_payload) else 0
    payload = np.full(job.controllers, w.payload_bytes_per_prompt * (wave.prompts + samples))
    if w.kind == "diffusion" and job.judge is not None:
        payload += wave.prompts * w.group_size * w.diffusion.image_bytes
    if wave.images is not None:
        copies = 2 if samples else 1
        payload += copies * w.images.bytes_per_patch * wave.images.patches.sum(axis=1)
    return payload


def update_payload_bytes(job: Job, work: StepWork) -> np.ndarray:
    """[K] bytes each controller ships to its trainer workers: the payload of every trained sample, the pixel
    values of every trained group's images (once: the group's rows share them); under a diffusion
    workload also every trained image's latent trajectory."""
    w = job.workload
    payload = np.full(job.controllers, w.payload_bytes_per_prompt * work.trained_groups * w.group_size
                      if w.train_reads_payload else 0.0)
    if w.kind == "diffusion":
        payload += work.trained_groups * w.group_size * w.diffusion.trajectory_bytes
    if work.trained_images is not None and w.train_reads_payload:
        payload += w.images.bytes_per_patch * work.trained_images.patches
    return payload


def slice_data_seconds(job: Job, bytes_moved: np.ndarray, cpu_seconds: np.ndarray | float = 0.0) -> np.ndarray:
    """[K] seconds each slice waits for its data: its controller's `cpu_seconds` of image work over
    `images.cpu_workers` workers plus shipping `bytes_moved` (`cost.data_plane_seconds`). Under
    `workload.single_driver` one driver does every slice's share, one after another, so every slice
    waits for the sum."""
    w = job.workload
    seconds = cost.data_plane_seconds(bytes_moved, job.costs) + np.asarray(cpu_seconds, np.float64) / w.images.cpu_workers
    seconds = np.broadcast_to(seconds, (job.controllers,))
    return np.full(job.controllers, seconds.sum()) if w.single_driver else seconds


def wave_data_seconds(job: Job, wave: Wave) -> np.ndarray:
    """[K] the data plane of a wave: load, decode and preprocess the prompts' images, ship the payload."""
    cpu = 0.0 if wave.images is None else vision.cpu_seconds(wave.images.count, wave.images.megapixels,
                                                             job.workload.images).sum(axis=1)
    return slice_data_seconds(job, wave_payload_bytes(job, wave), cpu)


def update_data_seconds(job: Job, work: StepWork) -> float:
    """The data plane of the update (the trained rows to the trainers): the slowest slice's (FSDP waits for all)."""
    return float(slice_data_seconds(job, update_payload_bytes(job, work)).max())


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Generation:
    """One wave generated on every slice."""

    end: np.ndarray  # [K] absolute time the slice's last engine finished
    finish: np.ndarray  # [K, P*G] absolute finish time of each completion (prompt-major)
    device_seconds: np.ndarray  # [K] device-seconds spent generating
    run: DecodeRun
    fixed_seconds: np.ndarray  # [K, E] each engine's longest completion x `fixed_step_seconds` (seconds per device)


def _split_evenly(items: int, parts: int) -> np.ndarray:
    """Part index of each of `items` contiguous items cut into `parts` parts whose sizes differ by at most one."""
    sizes = np.full(parts, items // parts)
    sizes[: items % parts] += 1
    return np.repeat(np.arange(parts), sizes)


def generate(job: Job, timeline: Timeline, step: int, wave: Wave, start: np.ndarray, where: DeviceRange,
             delay: np.ndarray | None = None) -> Generation:
    """The wave's prompts, split evenly over the policy engines on `where`, generate from `start` [K].

    `delay` [K, engines] holds each engine until it is ready (e.g. a device that just changed role).
    """
    if job.workload.kind == "diffusion":
        return _generate_images(job, timeline, step, wave, start, where, delay)
    K, E, G = job.controllers, where.engines, job.workload.group_size
    P = wave.prompts
    local = _split_evenly(P, E)  # engine of each prompt
    prompt_engine = (np.arange(K)[:, None] * E + local[None, :])  # [K, P]
    seq_engine = np.repeat(prompt_engine, G, axis=1).ravel()
    context = np.repeat(wave.prompt_tokens, G, axis=1).ravel()
    output = wave.response_tokens.reshape(K, P * G).ravel()
    key = (job.policy, job.hardware, job.costs, job.max_num_seqs, job.memory_utilization, E, where.tp)
    run = wave.memo.get(key)
    if run is None:
        slots = cost.concurrent_sequences(job.policy, job.hardware, where.tp, job.memory_utilization,
                                          job.max_num_seqs, float(np.mean(context + output)))
        prefill = np.bincount(prompt_engine.ravel(), weights=wave.prompt_tokens.ravel(), minlength=K * E)
        if wave.turns is None:
            run = run_engines(seq_engine, context, output, K * E, prefill, job.policy, job.hardware, job.costs,
                              where.tp, slots)
        else:
            run = agent.run_agent_engines(seq_engine, context, wave.turns.rows(), K * E, prefill, job.policy,
                                          job.hardware, job.costs, where.tp, slots,
                                          job.workload.agent.synchronous_turns)
        if wave.images is not None:
            run = _with_vision_prefill(run, wave, prompt_engine, seq_engine, job, where.tp)
        wave.memo[key] = run
    delay = np.zeros((K, E)) if delay is None else np.asarray(delay, np.float64)
    engine_start = start[:, None] + delay  # [K, E]
    engine_end = engine_start + run.wall_seconds.reshape(K, E)
    devices = where.engine_devices(job)
    # busy from the start (an engine's waits for its trajectories' answers come out as idle time after it)
    timeline.add("rollout", "rollout/generate", step, devices, engine_start[:, :, None],
                 (engine_start + run.engine_seconds.reshape(K, E))[:, :, None])
    finish = run.finish_seconds.reshape(K, P * G) + np.repeat(engine_start, np.bincount(local, minlength=E) * G, axis=1)
    decoded = output if wave.turns is None else wave.turns.policy_tokens.ravel()
    longest = np.zeros(K * E)  # the longest completion of each engine: its steps are the part no split removes
    np.maximum.at(longest, seq_engine, np.maximum(np.asarray(decoded, dtype=np.float64), 1.0))
    return Generation(end=engine_end.max(axis=1), finish=finish,
                      device_seconds=run.engine_seconds.reshape(K, E).sum(axis=1) * where.tp, run=run,
                      fixed_seconds=(longest * fixed_step_seconds(job.policy, job, where.tp, run)).reshape(K, E))


def _with_vision_prefill(run: DecodeRun, wave: Wave, prompt_engine: np.ndarray, seq_engine: np.ndarray, job: Job,
                         tp: int) -> DecodeRun:
    """`run` with each engine's prefill lengthened by the vision tower's forward over its prompts' images
    (once per prompt: a group's samples share the encoding); every sequence finishes that much later."""
    assert wave.images is not None
    engines = len(run.prefill_seconds)
    flops = np.bincount(prompt_engine.ravel(), weights=wave.images.flops.ravel(), minlength=engines)
    encode = vision.encode_seconds(flops, job.hardware, job.costs, tp)
    return dataclasses.replace(run, prefill_seconds=run.prefill_seconds + encode,
                               finish_seconds=run.finish_seconds + encode[seq_engine])


def _generate_images(job: Job, timeline: Timeline, step: int, wave: Wave, start: np.ndarray, where: DeviceRange,
                     delay: np.ndarray | None) -> Generation:
    """`generate` for a diffusion workload: the wave's images (no prefill shared by a group) are cut into
    contiguous even parts, one per policy engine, and each engine denoises its part in batches
    (`diffusion.denoise_engines`); an image finishes with its batch. An engine's fixed part (what no
    split removes) is one image alone from noise to pixels."""
    K, E, S = job.controllers, where.engines, wave.samples
    settings = job.workload.diffusion
    local = _split_evenly(S, E)  # engine of each image
    key = ("diffusion", job.policy, job.hardware, job.costs, settings, E, where.tp)
    run = wave.memo.get(key)
    if run is None:
        engine = (np.arange(K)[:, None] * E + local[None, :]).ravel()
        run = diffusion.denoise_engines(engine, K * E, settings, job.policy, job.hardware, job.costs, where.tp)
        wave.memo[key] = run
    delay = np.zeros((K, E)) if delay is None else np.asarray(delay, np.float64)
    engine_start = start[:, None] + delay  # [K, E]
    engine_end = engine_start + run.engine_seconds.reshape(K, E)
    timeline.add("rollout", "rollout/generate", step, where.engine_devices(job), engine_start[:, :, None],
                 engine_end[:, :, None])
    finish = run.finish_seconds.reshape(K, S) + engine_start[:, local]
    one_image = float(diffusion.batch_seconds(1, settings, job.policy, job.hardware, job.costs, where.tp))
    fixed = np.where(np.bincount(local, minlength=E) > 0, one_image, 0.0)
    return Generation(end=engine_end.max(axis=1), finish=finish,
                      device_seconds=run.engine_seconds.reshape(K, E).sum(axis=1) * where.tp, run=run,
                      fixed_seconds=np.broadcast_to(fixed, (K, E)).copy())


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Judging:
    """One wave judged on every slice."""

    end: np.ndarray  # [K] absolute time the slice's last judge batch ended
    device_seconds: np.ndarray  # [K] device-seconds spent judging
    run: BatchedRun
    fixed_seconds: np.ndarray  # [K] the slice's largest single batch's decode steps x the per-step fixed cost


def judge(job: Job, timeline: Timeline, step: int, wave: Wave, arrival: np.ndarray, where: DeviceRange,
          ready: np.ndarray, streaming: bool) -> Judging:
    """Judge every completion of the wave on the judge engines of `where` (a multimodal judge reads the
    prompt's image tokens; its vision tower is not priced).

    `arrival` [K, P*G]: when each completion reaches the judge queue; `ready` [K, engines]: when
    each judge engine can start. Streaming: completions go to the engines in turn as they finish
    and each engine batches what has arrived whenever it is free. Otherwise the completions are cut
    into contiguous even parts, one per engine (they all arrived together).
    """
    assert job.judge is not None
    K, E, G, P = job.controllers, where.engines, job.workload.group_size, wave.prompts
    S = P * G
    if streaming:
        rank = np.argsort(np.argsort(arrival, axis=1, kind="stable"), axis=1)
        local = rank % E
    else:
        local = np.broadcast_to(_split_evenly(S, E), (K, S))
    engine = (np.arange(K)[:, None] * E + local).ravel()
    context, output = judge_requests(job, wave)
    slots = cost.concurrent_sequences(job.judge, job.hardware, where.tp, job.memory_utilization, job.max_num_seqs,
                                      float(np.mean(context + output)))
    run = serve_in_batches(arrival.ravel(), engine, context, output, K * E, np.asarray(ready, np.float64).ravel(),
                           job.judge, job.hardware, job.costs, where.tp, slots)
    devices = where.engine_devices(job).reshape(K * E, where.tp)
    timeline.add("judge", "rollout/judge", step, devices[run.batch_engine], run.batch_start[:, None],
                 run.batch_end[:, None])
    steps = batch_decode_steps(run, arrival.ravel(), engine, output, slots)
    batch_fixed = steps * fixed_step_seconds(job.judge, job, where.tp, run)[run.batch_engine]
    fixed = np.zeros(K)
    np.maximum.at(fixed, run.batch_engine // E, batch_fixed)
    return Judging(end=run.done_at.reshape(K, E).max(axis=1),
                   device_seconds=run.busy_seconds.reshape(K, E).sum(axis=1) * where.tp, run=run, fixed_seconds=fixed)


def judge_requests(job: Job, wave: Wave) -> tuple[np.ndarray, np.ndarray]:
    """[K*S] context tokens and [K*S] verdict tokens of each judge request of the wave (slice-major).

    Text: prompt + response + judge_template_tokens, and the drawn verdict. Diffusion: the image's
    `reward_image_tokens` + judge_template_tokens; a scorer's verdict is one token (one forward and
    a score, as a scalar reward model is priced), a generative judge's is drawn as for text.
    """
    w = job.workload
    K, G, S = job.controllers, w.group_size, wave.samples
    if w.kind == "diffusion":
        context = np.full(K * S, w.diffusion.reward_image_tokens + w.judge_template_tokens, dtype=np.int64)
        if w.diffusion.reward == "scorer":
            return context, np.ones(K * S, dtype=np.int64)
        return context, wave.judge_output_tokens.reshape(K * S)
    response = wave.response_tokens.reshape(K, S)
    prompt = wave.prompt_tokens
    if wave.images is not None and not w.judge_reads_payload:  # a text-only judge reads the prompt's text
        prompt = prompt - wave.images.tokens
    context = (np.repeat(prompt, G, axis=1) + response + w.judge_template_tokens).ravel()
    return context, wave.judge_output_tokens.reshape(K, S).ravel()


# --------------------------------------------------------------------------- fixed cost of decoding


def fixed_step_seconds(model: ModelSpec, job: Job, tp: int, run: DecodeRun | BatchedRun) -> np.ndarray:
    """[E] the part of each engine's decode step that a smaller batch would not save: one step at a batch
    of one (the weights read, one sequence's KV cache, `step_overhead_s`), with the KV of the engine's
    mean sequence (KV tokens read per sequence per step).

    The trainer's engines estimate the same from their measured rounds (`rollout.stats.fixed_step_seconds`:
    the intercept of step time against batch size); here the simulator's own decode model gives it.
    """
    kv_one = run.kv_token_steps / np.maximum(run.token_steps, 1.0)
    return cost.decode_step_seconds(1, kv_one, model, job.hardware, job.costs, tp)


def batch_decode_steps(run: BatchedRun, arrival: np.ndarray, engine: np.ndarray, output: np.ndarray,
                       slots: int) -> np.ndarray:
    """[B] decode steps of each batch `serve_in_batches` ran (its rows of `run`), from the same requests.

    An engine's batch takes every request routed to it that had arrived when the batch began and was
    not taken yet, so request i belongs to the first batch of its engine that began at or after its
    arrival (compared on the same keys `serve_in_batches` cuts on). The batch's steps are its last
    request's stop step under the same first-come, first-served schedule (`decode.start_steps`).
    """
    B = len(run.batch_engine)
    if B == 0:
        return np.zeros(0)
    arrival, engine = np.asarray(arrival, np.float64), np.asarray(engine, np.int64)
    order = np.lexsort((arrival, engine))  # the queue order of serve_in_batches
    arrival, engine = arrival[order], engine[order]
    output = np.maximum(np.asarray(output, np.int64)[order], 1)
    span = float(arrival.max()) + 1.0
    keys = engine * span + arrival
    batch_keys = run.batch_engine * span + np.minimum(run.batch_start, span - 0.5)
    by_key = np.argsort(batch_keys, kind="stable")
    member = by_key[np.searchsorted(batch_keys[by_key], keys, side="left")]  # batch of each request
    stop = start_steps(member, output, B, slots) + output
    steps = np.zeros(B)
    np.maximum.at(steps, member, stop)
    return steps


# --------------------------------------------------------------------------- update phase


def policy_wake_seconds(job: Job, from_host: bool) -> float:
    """A policy engine wakes: reloading its offloaded weights from host, or (at a sync) only re-initialising."""
    shard = job.policy.weight_bytes / job.policy_tp if from_host else 0.0
    return cost.wake_seconds(shard, job.hardware, job.costs)


def judge_wake_seconds(job: Job) -> float:
    assert job.judge is not None
    return cost.wake_seconds(job.judge.weight_bytes / job.judge_tp, job.hardware, job.costs)


def judge_offload_seconds(job: Job) -> float:
    assert job.judge is not None
    return cost.offload_seconds(job.judge.weight_bytes / job.judge_tp, job.hardware)


def policy_offload_seconds(job: Job) -> float:
    return cost.offload_seconds(job.policy.weight_bytes / job.policy_tp, job.hardware)


@dataclass(frozen=True)
class TrainerSplit:
    """A step's trained rows split over the `ranks` trainer ranks of every slice as the runtime splits
    them (`SliceClient.start_train`, per controller): `balance_rows` over each row's `SequenceCost`.

    A rank's part of the update is its part of its slice's estimated cost (attention makes a long row
    weigh more than its tokens). The update is priced at the slowest rank: its share of the cost,
    times its slice's tokens (`rank_tokens`), at the simulator's FLOPs per token; that is the slice's
    tokens / ranks when the split is even.
    """

    ranks: int
    cost_imbalance: np.ndarray  # [K] each slice's largest rank cost over the mean rank cost (1 = even)
    token_imbalance: np.ndarray  # [K] the same in tokens
    rank_tokens: np.ndarray  # [K] tokens priced for each slice's slowest rank: slice tokens / ranks x cost_imbalance

    @property
    def slowest_rank_tokens(self) -> float:
        """The tokens the update is priced at: the slowest rank of all slices (one FSDP group waits for it)."""
        return float(self.rank_tokens.max())

    @property
    def largest_rank_tokens(self) -> float:
        """The most real tokens any rank of any slice holds: slice tokens / ranks x token imbalance."""
        return float((self.rank_tokens / self.cost_imbalance * self.token_imbalance).max())

    def features(self) -> dict[str, float]:
        """The runtime's `metrics.jsonl` keys (a mean over controllers there, over slices here) and the priced tokens."""
        return {"train/cost_imbalance": float(self.cost_imbalance.mean()),
                "train/token_imbalance": float(self.token_imbalance.mean()),
                "train/tokens_slowest_rank": self.slowest_rank_tokens}


def trainer_split(job: Job, work: StepWork, ranks: int) -> TrainerSplit:
    """The split of `work`'s trained rows over `ranks` trainer ranks per slice (kept in `work.memo`)."""
    key = ("trainer_split", ranks, job.policy.sequence_cost)
    if key not in work.memo:
        work.memo[key] = split_rows(work.trained_lengths, ranks, job.policy.sequence_cost)
    return work.memo[key]


def split_rows(lengths: np.ndarray, ranks: int, row_cost: SequenceCost) -> TrainerSplit:
    """`TrainerSplit` of rows of `lengths` [K, rows] tokens over `ranks` ranks per slice. Rows that do not
    divide evenly (the runtime's `build_plan` refuses such a job) are padded with empty rows."""
    slices, rows = lengths.shape
    tokens = np.zeros((slices, -(-rows // ranks) * ranks))
    tokens[:, :rows] = lengths
    costs = row_cost(tokens)
    cost_imbalance, token_imbalance = np.ones(slices), np.ones(slices)
    for k in range(slices):
        slice_costs, slice_tokens = costs[k].tolist(), tokens[k].tolist()
        parts = balance_rows(slice_costs, ranks)
        cost_imbalance[k] = imbalance(slice_costs, parts)
        token_imbalance[k] = imbalance(slice_tokens, parts)
    return TrainerSplit(ranks, cost_imbalance, token_imbalance, tokens.sum(axis=1) / ranks * cost_imbalance)


def update_seconds(job: Job, work: StepWork, devices: int, passes: int) -> tuple[float, float]:
    """(prepare, train) seconds of the update over `devices` trainer devices per slice: `passes` log-prob
    passes and the training passes of the slowest rank (`trainer_split`), each with its micro-batch and
    optimiser-step overheads (`training.shapes`, the trainer's own batching).

    With `workload.sequence_parallel` = N > 1 the rows split over devices / N data-parallel groups;
    every device of a group runs every pass of its group's rows on 1/N of their tokens and pays the
    all-to-alls of `cost.ulysses_seconds`."""
    w, c, hw = job.workload, job.costs, job.hardware
    if w.kind == "diffusion":
        rows = -(-int(work.trained_groups * w.group_size) // devices)  # rows on one trainer device
        optimiser_steps, micro_batches = update_shape(rows, w.micro_batch_size, w.mini_batches, w.ppo_epochs)
        return _image_update_seconds(job, work, devices, passes, optimiser_steps, micro_batches, rows)
    sp = w.sequence_parallel
    groups = devices // sp
    rows = -(-int(work.trained_groups * w.group_size) // groups)  # rows of one data-parallel group
    optimiser_steps, micro_batches = update_shape(rows, w.micro_batch_size, w.mini_batches, w.ppo_epochs)
    split = trainer_split(job, work, groups)
    tokens = split.slowest_rank_tokens / sp  # one device's share of its group's rows, weighed by their cost
    exchanged = split.largest_rank_tokens  # the all-to-alls move real tokens
    prepare = passes * float(cost.logprob_seconds(tokens, job.policy, hw, c, devices=1,
                                                  micro_batches=forward_micro_batches(rows, w.micro_batch_size))
                             + cost.ulysses_seconds(exchanged, job.policy, hw, sp, passes=1))
    train = float(cost.train_seconds(tokens, job.policy, hw, c, devices=1, epochs=w.ppo_epochs,
                                     micro_batches=micro_batches, optimiser_steps=optimiser_steps,
                                     recompute=w.gradient_checkpointing)
                  + cost.ulysses_seconds(exchanged, job.policy, hw, sp,
                                         passes=w.ppo_epochs * (3 if w.gradient_checkpointing else 2)))
    if work.trained_images is not None:  # the vision tower over every trained row's images, on the busiest slice
        flops = float(work.trained_images.flops.max())
        prepare += passes * float(vision.logprob_seconds(flops, hw, c, devices))
        train += float(vision.train_seconds(flops, w.images, hw, c, devices, w.ppo_epochs, w.gradient_checkpointing))
    return prepare, train


def _image_update_seconds(job: Job, work: StepWork, devices: int, passes: int, optimiser_steps: int,
                          micro_batches: int, rows: int) -> tuple[float, float]:
    """`update_seconds` for a diffusion workload. `passes` counts the old-log-prob pass and the
    reference's as the strategies do for text; the old log-probs of a diffusion rollout come from the
    sampler (Flow-GRPO records each step's log-prob while sampling), so only the reference's
    forwards remain, one at each trained step. Every micro-batch runs once per trained step."""
    w, c, hw, d = job.workload, job.costs, job.hardware, job.workload.diffusion
    images = work.trained_groups * w.group_size
    reference_passes = max(passes - 1, 0)
    prepare = reference_passes * float(diffusion.reference_seconds(
        images, d, job.policy, hw, c, devices, micro_batches=forward_micro_batches(rows, w.micro_batch_size) * d.train_steps))
    train = float(diffusion.train_seconds(images, d, job.policy, hw, c, devices, w.ppo_epochs,
                                          micro_batches=micro_batches * d.train_steps, optimiser_steps=optimiser_steps,
                                          recompute=w.gradient_checkpointing))
    return prepare, train


def reference_seconds(job: Job, wave: Wave, devices: int) -> np.ndarray:
    """[K] the reference's forward pass over every sample of the wave on `devices` devices of each slice
    (interleave runs it beside the judge): log-probs of prompt + response tokens for text, a forward at
    every trained step of every image for diffusion."""
    if job.workload.kind == "diffusion":
        images = np.full(job.controllers, float(wave.samples))
        return diffusion.reference_seconds(images, job.workload.diffusion, job.policy, job.hardware, job.costs,
                                           devices)
    tokens = wave.prompt_tokens.sum(axis=1) * job.workload.group_size + wave.response_tokens.sum(axis=(1, 2))
    seconds = cost.logprob_seconds(tokens, job.policy, job.hardware, job.costs, devices)
    if wave.images is not None:
        flops = wave.images.flops.sum(axis=1) * job.workload.group_size
        seconds = seconds + vision.logprob_seconds(flops, job.hardware, job.costs, devices)
    return seconds


def update_time_shared(job: Job, timeline: Timeline, step: int, work: StepWork, start: float, tally: Tally,
                       policy_devices: DeviceRange, reference_done: bool = False) -> float:
    """Update phase on every device (colocate, partial, dynamic, interleave); returns its end.

    data -> trainer wake -> prepare (old + reference log-probs) -> train -> trainer offload ->
    sync (the policy engines on `policy_devices` wake, the gathered weights are copied in).
    """
    c, hw, D = job.costs, job.hardware, job.slice_devices
    trainers = job.gpus
    t = np.full(job.controllers, start)
    data = update_data_seconds(job, work)
    t = stage(job, timeline, step, t, data, "data", "update/data")
    tally.add("update/data", data)
    trainer_swap = cost.trainer_swap_seconds(job.policy, hw, c, trainers, job.reference) if job.offload_trainer else 0.0
    t = stage(job, timeline, step, t, trainer_swap, "swap", "swap/trainer_wake")
    passes = 1 + (job.reference and not reference_done)
    prepare, train = update_seconds(job, work, D, passes)
    t = stage(job, timeline, step, t, prepare, "actor", "update/prepare")
    t = stage(job, timeline, step, t, train, "actor", "update/train")
    t = stage(job, timeline, step, t, trainer_swap, "swap", "swap/trainer_offload")
    wake = policy_wake_seconds(job, from_host=False)
    stage(job, timeline, step, t, wake, "swap", "swap/wake", policy_devices)
    t = t + wake
    sync = cost.weight_sync_seconds(job.policy, hw, c, trainers)
    t = stage(job, timeline, step, t, sync, "sync", "update/sync")
    tally.add("update/prepare", prepare)
    tally.add("update/train", train)
    tally.add("swap", 2 * trainer_swap + wake)
    tally.add("update/sync", sync)
    return float(t[0])

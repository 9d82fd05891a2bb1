"""The step loop of one controller: draw prompts → roll out (scored as results stream) → prepare and
update → sync → record.

The same loop runs in every runtime; only the `ControllerContext` differs (an in-process device
worker, or handles to the Ray workers of the slice). The plan's traits choose the schedule: with
`rebalances` the controllers re-choose the rollout / reward split after each rollout phase
(`rebalance_split`); with `overlaps_steps` the rollouts of the next steps run while the trainers
update on step t, with bounded staleness k = `placement.max_staleness`:

    step t:  current = ahead.pop(0) or roll_out(t)         # made with the weights of an earlier step
             start_update(current)                          # the trainers work from here ...
             while len(ahead) < k:                          # ... while the controller rolls out
                 ahead.append(roll_out(next step))          #     up to step t+k, with the weights of t-1
             finish_train; sync_weights(t)

So every rollout uses the engines' weights when it starts, and the rollout of step s trained at step s
(trainer version s-1) was made during step s-k or later, with weights of version ≥ s-1-k: no
trained sample lags the trainer by more than k updates (`rollout/staleness_max` ≤ k; after the first
k steps it is exactly k). The schedule depends on step numbers only, never on timing, so a run is
reproducible and an exact resume keeps the queue (`RunProgress.ahead`). k = 1 is one-step-off.

With k = 1 the controller makes the next rollout itself, during the update it started. With k > 1
a `RolloutProducer` (controller/producer.py) makes the rollouts in a thread of the controller: rollout
s with exactly the weights of update max(0, s-1-k), which the main thread only publishes
(`SliceClient.publish`) and the producer loads into the rollout devices before the first rollout
that needs them. The trainers then start each update as soon as its rollout is queued, whatever the
producer is doing, and a slow rollout stalls them only once the queue has run dry: what k > 1 buys
when generation has a long tail (benchmarks/staleness.py). Evaluations and checkpoints wait until the
producer has made every rollout the published versions allow (`RolloutProducer.settle`), so the
queue, the data sampler and the engines' weights are those of the schedule, and a resume is exact.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gcore_rl.algos.dynamic_sampling import WaveSampler
from gcore_rl.checkpoint.layout import controller_file
from gcore_rl.config import JobConfig, prompt_room
from gcore_rl.configlib import to_dict
from gcore_rl.controller.checkpointing import (
    ControllerState,
    RunCheckpoints,
    decode_payload,
    decode_rollout,
    encode_payload,
    encode_rollout,
)
from gcore_rl.controller.forecast import RolloutForecaster
from gcore_rl.controller.producer import RolloutProducer
from gcore_rl.controller.program import (
    ControllerContext,
    GroupPayload,
    StepRollout,
    greedy_accuracy,
    rollout_phase,
    start_update,
)
from gcore_rl.controller.samples import SampleLog
from gcore_rl.controller.seeds import evaluation_seed, seed_global_rngs, step_seeds
from gcore_rl.controller.slice import reduce_stats
from gcore_rl.controller.step_metrics import StepMetrics, device_utilisation
from gcore_rl.data.lengths import load_fitted_shard
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.distributed import DistInfo, all_reduce_mean, barrier
from gcore_rl.errors import CheckpointError, ConfigError
from gcore_rl.placement.plan import REWARD_ROLES
from gcore_rl.placement.rebalance import Decision, RolloutLoad, rebalance
from gcore_rl.records import WaveWork
from gcore_rl.report.run_report import draw_run_report
from gcore_rl.rollout.functions import prompt_tools
from gcore_rl.telemetry.health import HealthWatch
from gcore_rl.telemetry.loggers import open_loggers
from gcore_rl.telemetry.metrics import PhaseTimer, read_metrics
from gcore_rl.telemetry.progress import TrainProgress
from gcore_rl.telemetry.timeline import CONTROLLER_ROLE_OF_PHASE, TimelineRecorder


@dataclass
class RunSummary:
    """What a finished run reports back to the CLI."""

    output_dir: str
    steps: int
    wall_seconds: float
    first_reward: float
    last_reward: float
    eval_accuracy_before: float | None
    eval_accuracy_after: float | None


def run_controller(cfg: JobConfig, info: DistInfo, ctx: ControllerContext) -> RunSummary:
    """Run every step of the job on this controller's shard; controller 0 writes the run directory.

    `info` places this controller among the K controllers (its `device` carries their collectives).
    With `run.resume` (a checkpoint folder the driver chose and checked) the run continues after the
    checkpoint's step exactly as it would have without the interruption.
    """
    shard = ControllerShard.load(cfg, ctx, info)
    progress_state = resume_run(cfg, info, ctx, shard, Path(cfg.run.resume)) if cfg.run.resume else None
    out = Path(cfg.run.output_dir)
    # after the resume: a checkpoint that fails to load leaves no records
    log = ControllerLog(out, info, cfg, first_step=progress_state.step + 1 if progress_state else 1)
    samples = SampleLog(out / "samples.jsonl", ctx.tokenizer, cfg.run.samples_per_step if info.is_main else 0)
    producer: RolloutProducer | None = None
    try:  # the loggers (an MLflow or W&B run), the samples and the timeline close on every way out
        timer = log.timer
        checkpoints = RunCheckpoints(cfg, info, ctx.workers, trainer_devices=len(ctx.plan.devices_of("update", "actor")))
        forecaster = RolloutForecaster.from_config(cfg, len(ctx.plan.slices[0])) if ctx.plan.traits.rebalances else None

        def roll_out(step: int) -> StepRollout:
            seeds = step_seeds(cfg.run.seed, step, info.rank)
            return rollout_phase(shard, shard.waves, ctx, cfg.sampling, timer, seeds, trained_version=step - 1)

        started = time.perf_counter()
        run = progress_state or RunProgress(acc_before=held_out_accuracy(cfg, shard, ctx, info))
        earlier = out / "metrics.jsonl"  # a resumed run's records, rewound to its checkpoint by the driver
        health = HealthWatch(cfg.run.health, run.acc_before,
                             history=read_metrics(earlier) if progress_state and info.is_main and earlier.exists() else ())
        producer = start_producer(cfg, info, ctx, shard, run, checkpoints, log) if produces_ahead(cfg, ctx) else None
        # with a producer the main thread calls only the trainers; the producer owns the rollout-phase devices
        own = ctx.workers.updaters if producer is not None else None
        with TrainProgress(cfg.run.steps, enabled=cfg.run.progress, quiet=not info.is_main) as progress:
            for step in range(run.step + 1, cfg.run.steps + 1):
                log.begin_step(step)
                seed_global_rngs(cfg.run.seed, step, info.rank)
                ctx.workers.begin_step(step, own)
                step_start = time.perf_counter()
                if producer is not None:
                    with timer.phase("rollout/queue"):  # the trainers wait for a rollout made ahead
                        current = producer.take(step)
                else:
                    current = run.ahead.pop(0) if run.ahead else roll_out(step)
                with timer.phase("rollout/wait"):  # controllers meet here; the time is what the fastest ones idle
                    barrier()
                placement = (rebalance_split(cfg, ctx, run.loads, info, timer, current.work, forecaster)
                             if ctx.plan.traits.rebalances else {})
                with timer.phase("update/train"):
                    pending, batch_stats = start_update(current, ctx, cfg.sampling, cfg.algo, trainer_version=step - 1)
                    if producer is not None:
                        placement["placement/rollouts_ahead"] = float(producer.ahead(step))
                    elif ctx.plan.traits.overlaps_steps:
                        # generate on the old weights while the trainers update (also past the last step when it
                        # saves: a run resumed with more steps continues as if it had never stopped)
                        saves = any(checkpoints.due(later) for later in range(step, cfg.run.steps + 1))
                        last = rollouts_ahead_until(step, cfg.placement.max_staleness, cfg.run.steps, saves)
                        for ahead_step in range(step + len(run.ahead) + 1, last + 1):
                            run.ahead.append(roll_out(ahead_step))
                        placement["placement/rollouts_ahead"] = float(len(run.ahead))
                    train_stats = ctx.workers.finish_train(pending)
                with timer.phase("update/sync"):
                    if producer is not None:
                        producer.publish(step, ctx.workers.publish(step))
                    else:
                        ctx.workers.sync_weights(step)
                with timer.phase("checkpoint/finish"):  # the previous step's save was written while this step ran
                    checkpoints.finish(then_saving=checkpoints.due(step))
                evaluates = (cfg.run.eval_every > 0 and step % cfg.run.eval_every == 0) or step == cfg.run.steps
                if producer is not None and (evaluates or checkpoints.due(step)):
                    with timer.phase("rollout/queue"):  # the rollout devices, idle, take this update's weights
                        producer.settle(step)
                step_seconds = time.perf_counter() - step_start
                slice_devices = ctx.workers.utilisation(step_seconds, own)
                if producer is not None:  # the rollout devices' figures came with the rollout, over its own time
                    slice_devices = producer_devices(ctx, slice_devices, current)
                devices = device_utilisation(slice_devices, log.timeline.utilisation(step_seconds))
                metrics = StepMetrics(rollout=current.stats, batch=batch_stats, train=train_stats, phases=timer.timings(),
                                      placement=placement, data=shard.length_stats, devices=devices,
                                      step_seconds=step_seconds).reduce(info)
                if evaluates:
                    run.acc_after = held_out_accuracy(cfg, shard, ctx, info)
                    if run.acc_after is not None:
                        metrics["eval/accuracy"] = run.acc_after
                if info.is_main:
                    for warning in health.warnings(health.check({"step": step, **metrics})):
                        print(warning, file=sys.stderr, flush=True)
                run.step = step
                run.rewards.append(metrics["reward/mean"])
                if checkpoints.due(step):
                    if producer is not None:
                        run.ahead = producer.queued()
                    metrics["time/checkpoint"] = checkpoints.save(step, capture_state(info, ctx, shard, run))
                    if producer is not None:
                        run.ahead = []  # the producer hands them out
                if producer is not None:  # the rollouts that need this update's weights may start
                    producer.permit(step)
                log.write(step, metrics, current.row_ids, ctx.workers.split)
                samples.write(step, current.groups)
                if info.is_main and cfg.run.report_every > 0 and step % cfg.run.report_every == 0:
                    draw_run_report(out)  # the driver writes the last one when the run ends
                progress.update(step, metrics)
                if "eval/accuracy" in metrics and 0 < cfg.run.stop_at_eval_accuracy <= metrics["eval/accuracy"]:
                    break  # the same all-reduced accuracy on every controller, so all stop at this step
        if producer is not None:
            producer.stop()
        checkpoints.close()
    finally:
        if producer is not None:
            producer.stop(reraise=False)
        log.close()
        samples.close()
    if cfg.run.save_final and info.is_main:
        ctx.workers.save_policy(str(out / "final"))
    barrier()
    return RunSummary(output_dir=str(out), steps=len(run.rewards), wall_seconds=time.perf_counter() - started,
                      first_reward=run.rewards[0], last_reward=run.rewards[-1],
                      eval_accuracy_before=run.acc_before, eval_accuracy_after=run.acc_after)


def produces_ahead(cfg: JobConfig, ctx: ControllerContext) -> bool:
    """Rollouts are made ahead in a thread (`RolloutProducer`): bounded staleness k > 1 on a plan that
    publishes weights to separate rollout devices (k = 1 keeps the rollout in the main thread, during
    the update)."""
    return ctx.plan.traits.overlaps_steps and ctx.plan.traits.publishes_weights and cfg.placement.max_staleness > 1


def start_producer(cfg: JobConfig, info: DistInfo, ctx: ControllerContext, shard: ControllerShard, run: RunProgress,
                   checkpoints: RunCheckpoints, log: ControllerLog) -> RolloutProducer:
    """The run's `RolloutProducer`, from where `run` stands (a resumed run's queued rollouts included).

    It rolls out up to the last step, and past it up to s + k for every step s that saves (a run resumed
    from that checkpoint with more steps finds the queue a longer run would have had). Its phases go
    to the controller's timeline, and each rollout carries its own `time/*` figures in its statistics.
    """
    k = cfg.placement.max_staleness
    last = max([cfg.run.steps] + [s + k for s in range(run.step + 1, cfg.run.steps + 1) if checkpoints.due(s)])
    timer = PhaseTimer(on_span=log.timeline.record)
    own = ctx.workers.generation

    def roll_out(step: int) -> StepRollout:
        timer.reset()
        ctx.workers.begin_step(step, own)
        started = time.perf_counter()
        rollout = rollout_phase(shard, shard.waves, ctx, cfg.sampling, timer, step_seeds(cfg.run.seed, step, info.rank),
                                trained_version=step - 1)
        rollout.stats.update(timer.timings())
        devices = ctx.workers.utilisation(time.perf_counter() - started, own)
        rollout.stats.update({f"{GENERATION_DEVICES}{key}": value for key, value in devices.items()})
        return rollout

    first = run.step + 1 + len(run.ahead)
    ready = {run.step + 1 + i: rollout for i, rollout in enumerate(run.ahead)}
    run.ahead = []
    return RolloutProducer(roll_out, ctx.workers.load_published, first=first, last=last, k=k, loaded=run.step,
                           ready=ready)


GENERATION_DEVICES = "generation_devices/"
"""Prefix of the rollout devices' utilisation in a producer's rollout statistics (`producer_devices`)."""


def producer_devices(ctx: ControllerContext, trainers: dict[str, float], rollout: StepRollout) -> dict[str, float]:
    """The slice's device figures under a producer: the trainers' (`trainers`, over the step) and the
    rollout devices' (measured by the producer over the rollout, carried in its statistics, which this
    takes them out of), averaged over all devices as `SliceClient.utilisation` averages them."""
    generation = {key.removeprefix(GENERATION_DEVICES): rollout.stats.pop(key)
                  for key in [k for k in rollout.stats if k.startswith(GENERATION_DEVICES)]}
    return reduce_stats([trainers] * len(ctx.workers.updaters) + [generation] * len(ctx.workers.generation))


def rollouts_ahead_until(step: int, max_staleness: int, steps: int, saves: bool) -> int:
    """The last step whose rollout is made during step `step`'s update under bounded staleness
    `max_staleness` (k): step + k, but not past the run's last step `steps` unless the run `saves` at
    this step or a later one (a run resumed from that save with more steps then finds the queue the
    longer run would have had: each rollout made during the same step, with the same weights)."""
    return step + max_staleness if saves else min(step + max_staleness, steps)


@dataclass
class RunProgress:
    """Where a controller's run stands between steps (what a checkpoint keeps besides the data order):
    the last finished step, the rollouts already made for the next ones (`ahead[i]` is step
    `step + 1 + i`'s; at most `placement.max_staleness`), the rebalancer's history, and the figures
    the summary reports."""

    step: int = 0
    ahead: list[StepRollout] = field(default_factory=list)
    loads: list[RolloutLoad] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    acc_before: float | None = None
    acc_after: float | None = None


def capture_state(info: DistInfo, ctx: ControllerContext, shard: ControllerShard, run: RunProgress) -> ControllerState:
    """This controller's checkpoint state after `run.step`."""
    return ControllerState(step=run.step, controllers=info.world_size, sampler=shard.sampler.state_dict(),
                           epoch=shard.sampler.epoch, drawn_rows=[shard.row_ids[i] for i in shard.sampler.drawn_in_epoch()],
                           waves=shard.waves.state_dict(encode_payload), loads=[load.as_dict() for load in run.loads],
                           rollout_devices=ctx.plan.rollout_devices, plan_version=ctx.plan.version,
                           ahead=[encode_rollout(rollout) for rollout in run.ahead],
                           rewards=list(run.rewards), eval_accuracy_before=run.acc_before,
                           eval_accuracy_after=run.acc_after)


def resume_run(cfg: JobConfig, info: DistInfo, ctx: ControllerContext, shard: ControllerShard,
               folder: Path) -> RunProgress:
    """Restore the trainers, the engines' weights, the plan and this controller's data state from the
    checkpoint `folder`, and return where the run stands.

    On the same number of controllers each takes up its own saved state. On another number, the
    sampler continues the epoch in progress with the rows no controller had drawn in it (rows of an
    epoch that a controller had not finished when another had moved on are not revisited), every
    controller ending that epoch after as many rows as the controller with the fewest left (the
    others' extra rows wait for the next epoch: no row is drawn twice in an epoch; going down to
    one controller, every row exactly once), and the rollouts that were in flight or buffered are
    dropped, their rows returned to the epoch.
    """
    saved = [ControllerState.read(folder / controller_file(k)) for k in range(_saved_controllers(folder))]
    mine = saved[info.rank] if len(saved) == info.world_size else None
    ctx.workers.load_checkpoint(str(folder))
    first = saved[0]
    if ctx.plan.traits.rebalances:  # the split and plan version the rebalancer had reached
        ctx.workers.apply_plan(replace(ctx.plan.with_rollout_devices(first.rollout_devices), version=first.plan_version))
    ctx.workers.sync_weights(first.step)
    if mine is not None:
        shard.sampler.load_state_dict(mine.sampler)
        decode = shard.payload_decoder(ctx)
        shard.waves.load_state_dict(mine.waves, decode)
        ahead = [decode_rollout(entry, decode) for entry in mine.rollouts_ahead()]
        if len(ahead) > cfg.placement.max_staleness:
            raise ConfigError("placement.max_staleness", f"the checkpoint '{folder}' holds {len(ahead)} rollouts made "
                              f"ahead, more than {cfg.placement.max_staleness} updates of staleness allow; resume with "
                              f"placement.max_staleness={len(ahead)} or more")
    else:
        epoch = max(state.epoch for state in saved)
        in_flight = {row for state in saved for row in _rows_in_flight(state)}
        drawn = {row for state in saved if state.epoch == epoch for row in state.drawn_rows} - in_flight
        shard.sampler.continue_epoch(epoch, [shard.local[row] for row in drawn if row in shard.local])
        # the shards of the new layout may hold different numbers of rows the epoch has not drawn: all
        # end the epoch with the smallest, so none draws a row twice (the others' extra rows come next epoch)
        fewest = -all_reduce_mean({"remaining_max": -float(shard.sampler.remaining_in_epoch)}, info.device)["remaining_max"]
        shard.sampler.end_epoch_after(int(fewest))
        shard.waves.load_state_dict(first.waves)  # the EMA only
        ahead = []
    return RunProgress(step=first.step, ahead=ahead, loads=first.rollout_loads(), rewards=list(first.rewards),
                       acc_before=first.eval_accuracy_before, acc_after=first.eval_accuracy_after)


def _saved_controllers(folder: Path) -> int:
    """How many controllers wrote the checkpoint (its controller files)."""
    count = len(list(folder.glob(controller_file(0).replace("0", "*"))))
    if count == 0:
        raise CheckpointError(f"checkpoint '{folder}' holds no {controller_file(0)}; it is not a complete checkpoint "
                              "of a training run")
    return count


def _rows_in_flight(state: ControllerState) -> list[int]:
    """Rows of a saved controller whose rollouts were in flight or buffered (a reshard drops them)."""
    rows = [group["payload"]["row_id"] for group in state.waves.get("buffer", []) if "payload" in group]
    for rollout in state.rollouts_ahead():
        rows.extend(rollout["row_ids"])
    return rows


class ControllerLog:
    """A controller's records: its timeline (`timeline/controller-<i>.jsonl`), the phase timer that
    feeds it, the prompt rows of each step (`prompts/controller-<i>.jsonl`), the trained rows' lengths
    (`lengths/controller-<i>.jsonl`), and on controller 0
    the run's `metrics.jsonl` and the other `run.loggers`."""

    def __init__(self, out: Path, info: DistInfo, cfg: JobConfig, first_step: int = 1):
        self.writer = (open_loggers(cfg.run.loggers, out, config=to_dict(cfg), key="run.loggers", first_step=first_step)
                       if info.is_main else None)  # first: a logger that fails to open leaves no file open
        self.timeline = TimelineRecorder(info.rank, out / "timeline" / f"controller-{info.rank}.jsonl",
                                         roles=CONTROLLER_ROLE_OF_PHASE, owner="controller")
        self.timer = PhaseTimer(on_span=self.timeline.record)
        prompts = out / "prompts" / f"controller-{info.rank}.jsonl"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        self.prompts = prompts.open("a", encoding="utf-8")
        splits = out / "lengths" / f"controller-{info.rank}.jsonl"
        splits.parent.mkdir(parents=True, exist_ok=True)
        self.splits = splits.open("a", encoding="utf-8")

    def begin_step(self, step: int) -> None:
        self.timer.reset()
        self.timeline.begin_step(step)

    def write(self, step: int, metrics: dict[str, float], row_ids: list[int], split: dict | None = None) -> None:
        """Record the step: its metrics (controller 0), the global prompt rows this controller drew for it, and
        how its trained rows were split over its trainers (`SliceClient.split`: each row's tokens and the
        number of trainer groups, in `lengths/controller-<i>.jsonl`: what `gcore-rl simulate --calibrate`
        replays through the simulator's split)."""
        if self.writer is not None:
            self.writer.write(step, metrics)
        self.prompts.write(json.dumps({"step": step, "rows": row_ids}) + "\n")
        self.prompts.flush()
        if split:
            self.splits.write(json.dumps({"step": step, **split}) + "\n")
            self.splits.flush()

    def close(self) -> None:
        self.timeline.close()
        self.prompts.close()
        self.splits.close()
        if self.writer is not None:
            self.writer.close()


@dataclass
class ControllerShard:
    """This controller's data: its prompt rows (every prompt checked against the policy's context
    before the first step), their order, its dynamic-sampling state and its held-out rows."""

    rows: list[dict]
    row_ids: list[int]
    eval_rows: list[dict]
    length_stats: dict[str, float]
    sampler: ShardedPromptSampler
    waves: WaveSampler

    @classmethod
    def load(cls, cfg: JobConfig, ctx: ControllerContext, info: DistInfo) -> ControllerShard:
        fitted = load_fitted_shard(cfg.data, ctx.prompts, prompt_room(cfg), info.rank, info.world_size,
                                   tools=prompt_tools(cfg.rollout))
        sampler = ShardedPromptSampler(len(fitted.rows), seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                       shard_index=info.rank)
        waves = WaveSampler(cfg.dynamic_sampling,
                            cfg.dynamic_sampling.resolve_target(cfg.run.prompts_per_step // info.world_size),
                            max_age=surplus_age_bound(cfg, ctx.plan.traits.overlaps_steps))
        return cls(rows=fitted.rows, row_ids=fitted.row_ids, eval_rows=fitted.eval_rows, length_stats=fitted.metrics,
                   sampler=sampler, waves=waves)

    def payload_decoder(self, ctx: ControllerContext) -> Callable[[dict], GroupPayload]:
        """`decode_payload` that gives a saved group's completions their prompt's images again (a checkpoint
        keeps token ids only; the images come from the group's row, re-encoded as rollout encoded it)."""
        if ctx.prompts.processor is None:
            return decode_payload

        def decode(entry: dict) -> GroupPayload:
            payload = decode_payload(entry)
            prompt = ctx.prompts(self.rows[self.local[payload.row_id]])
            for completion in payload.completions:
                completion.prompt_ids = prompt
            return payload
        return decode

    @functools.cached_property
    def local(self) -> dict[int, int]:
        """The position in `rows` of each global row number the shard holds."""
        return {row: index for index, row in enumerate(self.row_ids)}

    def draw(self, count: int) -> list[tuple[int, dict]]:
        """The next `count` prompt rows of the shard, each with its global row number."""
        return [(self.row_ids[i], self.rows[i]) for i in self.sampler.next_indices(count)]

    def rows_of(self, row_ids: Sequence[int]) -> list[tuple[int, dict]]:
        """The shard's rows of the global row numbers `row_ids` (rows of surplus groups to generate again)."""
        return [(row, self.rows[self.local[row]]) for row in row_ids]


def surplus_age_bound(cfg: JobConfig, overlaps_steps: bool) -> int | None:
    """Most trainer updates a buffered surplus group may lag the trainer when it is trained (None: dynamic
    sampling is off, nothing is buffered): the bounded staleness k of a plan that rolls out ahead, which
    holds for every trained sample, else `dynamic_sampling.max_surplus_age`."""
    if not cfg.dynamic_sampling.enabled:
        return None
    return cfg.placement.max_staleness if overlaps_steps else cfg.dynamic_sampling.max_surplus_age


def held_out_accuracy(cfg: JobConfig, shard: ControllerShard, ctx: ControllerContext, info: DistInfo) -> float | None:
    """Greedy accuracy on the held-out rows of every controller (a collective), or None without a task."""
    if not cfg.data.task or cfg.data.eval_prompts == 0:
        return None
    total, count = greedy_accuracy(shard.eval_rows, ctx, cfg.sampling.max_new_tokens, seed=evaluation_seed(cfg.run.seed))
    reduced = all_reduce_mean({"total": total, "count": float(count)}, info.device)
    return reduced["total"] / max(reduced["count"], 1.0)


def rebalance_split(cfg: JobConfig, ctx: ControllerContext, loads: list[RolloutLoad], info: DistInfo,
                    timer: PhaseTimer, work: Sequence[WaveWork] = (),
                    forecaster: RolloutForecaster | None = None) -> dict[str, float]:
    """Dynamic placement, between a rollout phase and its update: choose the next rollout / reward split.

    Each controller measures its slice's load and the work behind it, one all-reduce averages both
    over the controllers (float64, so every controller holds the same numbers), and each runs the
    same pure `rebalance` on the same history, so all slices move alike, to the same next plan
    version, without a central process. The new plan takes effect at this step's sync: only the
    devices that generate next load the policy's weights. Returns the step's placement metrics
    (`placement_metrics`).
    """
    own = ctx.workers.rollout_load(timer.timings().get("time/rollout", 0.0))
    counted = {f"placement/{name}": value for name, value in vars(ctx.workers.rollout_work()).items()}
    scalars = {name: value for name, value in vars(own).items() if name != "forecast"}  # the runtime forecasts nothing
    rounds = ctx.workers.engine_rounds() if forecaster is not None and forecaster.fits_engines else None
    forecasts = forecaster.forecast(work, own, rounds) if forecaster is not None else {}
    reduced = all_reduce_mean({**scalars, **counted, **forecasts}, info.device)
    measured = {name: reduced[name] for name in scalars}
    measured["rollout_devices"] = round(measured["rollout_devices"])  # the same on every controller
    load = RolloutLoad(**measured, forecast=forecaster.vector(reduced) if forecasts else ())
    loads.append(load)
    current = ctx.plan.rollout_devices
    min_devices = cfg.placement.min_devices
    min_reward = max([min_devices.get(role, 1) for role in REWARD_ROLES], default=1)
    decision = rebalance(loads, current, len(ctx.plan.slices[0]), cfg.placement.rebalance,
                         min_rollout=min_devices.get("rollout", 1), min_reward=min_reward)
    if decision.rollout_devices != current:
        ctx.workers.apply_plan(ctx.plan.with_rollout_devices(decision.rollout_devices))
    return {**placement_metrics(current, decision, load, ctx.plan.version), **{k: reduced[k] for k in counted},
            **{f"placement/{k}": v for k, v in reduced.items() if k in forecasts}}


def placement_metrics(current: int, decision: Decision, load: RolloutLoad, plan_version: int) -> dict[str, float]:
    """One step's `placement/*` metrics: the split used (`rollout_devices`) and the next one, the plan
    version after the decision, the rollout phase predicted at both splits (`predicted_rollout_s`,
    `next_predicted_rollout_s`: `Decision.current_s` / `predicted_s`) and measured, the step's load
    the rebalancer was fed (`generate_device_s`, `generate_fixed_s`, `score_device_s`,
    `score_fixed_s`, `swap_s`), and the move's cost: `moved_devices` (|next - current|) and
    `move_swap_s` (the step's `swap_s` when the split moves, else 0)."""
    moved = abs(decision.rollout_devices - current)
    return {"placement/rollout_devices": float(current), "placement/next_rollout_devices": float(decision.rollout_devices),
            "placement/next_plan_version": float(plan_version),
            "placement/predicted_rollout_s": decision.current_s, "placement/next_predicted_rollout_s": decision.predicted_s,
            "placement/measured_rollout_s": load.phase_s,
            "placement/generate_device_s": load.generate_s, "placement/generate_fixed_s": load.generate_fixed_s,
            "placement/score_device_s": load.score_s, "placement/score_fixed_s": load.score_fixed_s,
            "placement/swap_s": load.swap_s,
            "placement/moved_devices": float(moved), "placement/move_swap_s": load.swap_s if moved else 0.0}

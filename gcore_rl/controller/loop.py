"""The step loop of one controller: draw prompts → roll out (scored as results stream) → prepare and
update → sync → record.

The same loop runs in every runtime; only the `ControllerContext` differs (an in-process device
worker, or handles to the Ray workers of the slice). When the rollouts are made relative to the updates
is the `Schedule`'s to say (controller/schedules.py: synchronous, one-step-off, or made ahead by a
producer thread under bounded staleness k > 1); with the plan's trait `rebalances` the controllers
re-choose the rollout / reward split after each rollout phase (`rebalance_split`,
controller/rebalancing.py). Where the run stands and how it resumes is in controller/run_state.py, its
records in controller/controller_log.py, its data in controller/shard.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gcore_rl.checkpoint.layout import step_dir
from gcore_rl.controller.checkpointing import RunCheckpoints
from gcore_rl.controller.controller_log import ControllerLog
from gcore_rl.controller.preemption import Preempted, PreemptionWatch
from gcore_rl.controller.program import ControllerContext, StepRollout, rollout_phase
from gcore_rl.controller.rebalancing import rebalance_split
from gcore_rl.controller.run_state import RunProgress, capture_state, resume_run
from gcore_rl.controller.samples import SampleLog
from gcore_rl.controller.schedules import Schedule, schedule_for
from gcore_rl.controller.seeds import seed_global_rngs, step_seeds
from gcore_rl.controller.shard import ControllerShard
from gcore_rl.controller.step_metrics import StepMetrics, device_utilisation
from gcore_rl.distributed import DistInfo, barrier
from gcore_rl.report.run_report import draw_run_report
from gcore_rl.telemetry.health import HealthWatch
from gcore_rl.telemetry.metrics import PhaseTimer, read_metrics
from gcore_rl.telemetry.progress import TrainProgress


def run_controller(cfg: Any, info: DistInfo, ctx: ControllerContext, handles_signals: bool = True) -> Any:
    """Run every step of the job on this controller's shard; controller 0 writes the run directory. Returns the
    run's summary (`SampleKind.summary`: a language run's `RunSummary`).

    `cfg` is a job config of the policy kind whose samples `ctx.samples` are (a `JobConfig`, or a diffusion job's).
    `info` places this controller among the K controllers (its `device` carries their collectives).
    With `run.resume` (a checkpoint folder the driver chose and checked) the run continues after the
    checkpoint's step exactly as it would have without the interruption. SIGTERM (unless not `handles_signals`:
    a Ray actor's driver asks by a file instead) stops it at a step boundary, saved (controller/preemption.py).
    """
    kind = ctx.samples
    shard = kind.load_shard(cfg, ctx, info)
    resumed = resume_run(cfg, info, ctx, shard, Path(cfg.run.resume)) if cfg.run.resume else None
    out = Path(cfg.run.output_dir)
    # after the resume: a checkpoint that fails to load leaves no records
    log = ControllerLog(out, info, cfg, first_step=resumed.step + 1 if resumed else 1, clock=ctx.clock)
    samples = SampleLog(out / "samples.jsonl", ctx.tokenizer,
                        cfg.run.samples_per_step if info.is_main and kind.log_samples else 0)
    schedule: Schedule | None = None
    preemption = PreemptionWatch(cfg.run.preempt_grace_s, cfg.run.output_dir, handles_signals)
    preempted = steps = None
    try:  # the loggers (an MLflow or W&B run), the samples and the timeline close on every way out
        started = ctx.clock()
        run = resumed or RunProgress(eval_before=kind.evaluate(cfg, shard, ctx, info, "before"))
        steps = ControllerSteps(cfg, info, ctx, shard, run, log, samples, resumed=resumed is not None)

        def roll_out(step: int, timer: PhaseTimer) -> StepRollout:
            seeds = step_seeds(cfg.run.seed, step, info.rank)
            return rollout_phase(shard, shard.waves, ctx, cfg.sampling, timer, seeds, trained_version=step - 1)

        schedule = schedule_for(ctx, roll_out, log.timer, log.timeline.record, k=cfg.placement.max_staleness,
                                steps=cfg.run.steps, due=steps.checkpoints.due, done=run.step, queue=run.ahead)
        run.ahead = []  # the schedule holds them
        with TrainProgress(cfg.run.steps, enabled=cfg.run.progress, quiet=not info.is_main) as progress:
            for step in range(run.step + 1, cfg.run.steps + 1):
                metrics = steps.train(step, schedule)
                progress.update(step, metrics)
                if preemption.requested(info):  # SIGTERM on any controller: all stop here, saved
                    preempted = steps.save_now(step, schedule)
                    break
                if kind.stops(cfg, metrics):  # the same all-reduced evaluation on every controller: all stop here
                    break
        schedule.stop()
        steps.checkpoints.close()
    except BaseException:
        if steps is not None:
            steps.checkpoints.salvage()  # a failure later in a step does not cost the save before it
        raise
    finally:
        preemption.close()
        if schedule is not None:
            schedule.stop(reraise=False)
        log.close()
        samples.close()
    if preempted is not None:
        barrier()
        raise Preempted(f"stopped by SIGTERM after step {run.step}: the checkpoint '{preempted}' is complete; "
                        "continue with run.resume=auto")
    if cfg.run.save_final and info.is_main:
        ctx.workers.save_policy(str(out / "final"))
    barrier()
    return kind.summary(cfg, run, ctx.clock() - started)


class ControllerSteps:
    """What `run_controller` repeats: one step of this controller's run, from its rollout to its records
    (the schedule says when the rollout was made; see the module docstring)."""

    def __init__(self, cfg: Any, info: DistInfo, ctx: ControllerContext, shard: ControllerShard,
                 run: RunProgress, log: ControllerLog, samples: SampleLog, resumed: bool):
        self.cfg, self.info, self.ctx, self.shard, self.run, self.log, self.samples = cfg, info, ctx, shard, run, log, samples
        self.checkpoints = RunCheckpoints(cfg, info, ctx.workers, trainer_devices=len(ctx.plan.devices_of("update", "actor")),
                                          frozen=ctx.samples.frozen_models(cfg))
        self.forecaster = ctx.samples.forecaster(cfg, ctx) if ctx.plan.traits.rebalances else None
        earlier = Path(cfg.run.output_dir) / "metrics.jsonl"  # a resumed run's records, rewound to its checkpoint
        self.health = HealthWatch(cfg.run.health, run.eval_before.get("eval/accuracy"),
                                  history=read_metrics(earlier) if resumed and info.is_main and earlier.exists() else ())

    def train(self, step: int, schedule: Schedule) -> dict[str, float]:
        """Run step `step`: take its rollout, update, sync, evaluate when due; record and save it. Its metrics."""
        cfg, info, ctx, timer, checkpoints = self.cfg, self.info, self.ctx, self.log.timer, self.checkpoints
        self.log.begin_step(step)
        seed_global_rngs(cfg.run.seed, step, info.rank)
        ctx.workers.begin_step(step, schedule.own)
        step_start = ctx.clock()
        current = schedule.take(step)
        with timer.phase("rollout/wait"):  # controllers meet here; the time is what the fastest ones idle
            barrier()
        placement = (rebalance_split(cfg, ctx, self.run.loads, info, timer, current.work, self.forecaster)
                     if ctx.plan.traits.rebalances else {})
        with timer.phase("update/train"):
            pending, batch_stats = ctx.samples.start_update(current, ctx, cfg, trainer_version=step - 1)
            placement.update(schedule.during_update(step))  # rollouts made ahead while the trainers work
            train_stats = ctx.workers.finish_train(pending)
        with timer.phase("update/sync"):
            schedule.sync(step)
        with timer.phase("checkpoint/finish"):  # the previous step's save was written while this step ran
            checkpoints.finish(then_saving=checkpoints.due(step))
        evaluates = (cfg.run.eval_every > 0 and step % cfg.run.eval_every == 0) or step == cfg.run.steps
        if evaluates or checkpoints.due(step):
            schedule.settle(step)
        step_seconds = ctx.clock() - step_start
        slice_devices = schedule.devices(ctx.workers.utilisation(step_seconds, schedule.own), current)
        devices = device_utilisation(slice_devices, self.log.timeline.utilisation(step_seconds))
        metrics = StepMetrics(rollout=current.stats, batch=batch_stats, train=train_stats, phases=timer.timings(),
                              placement=placement, data=self.shard.length_stats, devices=devices,
                              step_seconds=step_seconds).reduce(info)
        if evaluates:
            self.run.eval_after = ctx.samples.evaluate(cfg, self.shard, ctx, info, "after")
            metrics.update(self.run.eval_after)
        self.record(step, metrics, current, schedule)
        return metrics

    def save_now(self, step: int, schedule: Schedule) -> Path:
        """Save step `step` now, out of the schedule (a preemption), unless it was saved as due; its folder."""
        if not self.checkpoints.due(step):
            schedule.settle(step)
            self.checkpoints.save(step, capture_state(self.info, self.ctx, self.shard, self.run, schedule.queued()))
        return step_dir(self.checkpoints.root, step)

    def record(self, step: int, metrics: dict[str, float], current: StepRollout, schedule: Schedule) -> None:
        """Warn of an unhealthy step, save the checkpoint when due, and write the step's records."""
        cfg, info, run = self.cfg, self.info, self.run
        if info.is_main:
            for warning in self.health.warnings(self.health.check({"step": step, **metrics})):
                print(warning, file=sys.stderr, flush=True)
        run.step = step
        run.rewards.append(metrics["reward/mean"])
        if self.checkpoints.due(step):
            state = capture_state(info, self.ctx, self.shard, run, schedule.queued())
            metrics["time/checkpoint"] = self.checkpoints.save(step, state)
        schedule.step_done(step)  # the rollouts that need this update's weights may start
        self.log.write(step, metrics, current.row_ids, self.ctx.workers.split)
        self.samples.write(step, current.groups)
        if info.is_main and cfg.run.report_every > 0 and step % cfg.run.report_every == 0:
            draw_run_report(Path(cfg.run.output_dir))  # the driver writes the last one when the run ends

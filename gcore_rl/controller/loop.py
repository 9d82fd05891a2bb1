"""The step loop of one controller: its shard, its waves, the phases of each step, metrics.

The same loop runs in every runtime; only the `Roles` differ (an in-process device worker, or
handles to the Ray workers of the slice). With `disaggregated` placement the loop is pipelined:
while the trainer devices update on step t, the rollout devices already generate step t+1 with
the weights of step t-1 (staleness at most one update, recorded per sample). With `dynamic`
placement the controllers re-choose the rollout / reward split after each rollout phase
(`rebalance_split`).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path

from gcore_rl.algos.dynamic_sampling import WaveSampler
from gcore_rl.config import JobConfig, prompt_room
from gcore_rl.controller.program import (
    SUMMED_METRICS,
    Roles,
    StepRollout,
    greedy_accuracy,
    pool_reward_stats,
    rollout_phase,
    start_update,
)
from gcore_rl.data.lengths import load_fitted_shard
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.distributed import DistInfo, all_reduce_mean, barrier
from gcore_rl.placement.plan import REWARD_ROLES
from gcore_rl.placement.rebalance import RolloutLoad, rebalance
from gcore_rl.telemetry.metrics import MetricsWriter, PhaseTimer
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


def run_controller(cfg: JobConfig, info: DistInfo, roles: Roles) -> RunSummary:
    """Run every step of the job on this controller's shard; controller 0 writes the run directory.

    `info` places this controller among the K controllers (its `device` carries their collectives).
    """
    # this controller's shard only, every prompt checked against the policy's context before the first step
    rows, eval_rows, length_stats = load_fitted_shard(cfg.data, roles.tokenizer, prompt_room(cfg), info.rank, info.world_size)
    sampler = ShardedPromptSampler(len(rows), seed=cfg.data.seed, shuffle=cfg.data.shuffle, shard_index=info.rank)
    waves = WaveSampler(cfg.dynamic_sampling, cfg.dynamic_sampling.resolve_target(cfg.run.prompts_per_step // info.world_size))
    out = Path(cfg.run.output_dir)
    timeline = TimelineRecorder(info.rank, out / "timeline" / f"controller-{info.rank}.jsonl",
                                roles=CONTROLLER_ROLE_OF_PHASE, owner="controller")
    timer = PhaseTimer(on_span=timeline.record)
    overlap = cfg.placement.strategy == "disaggregated"
    loads: list[RolloutLoad] | None = [] if cfg.placement.strategy == "dynamic" else None

    def rollout(step: int) -> StepRollout:
        seed = cfg.run.seed * 100_003 + step * 97 + info.rank
        return rollout_phase(lambda k: [rows[i] for i in sampler.next_indices(k)], waves, roles, cfg.sampling, timer, seed)

    def evaluate() -> float | None:
        if not cfg.data.task or cfg.data.eval_prompts == 0:
            return None
        total, count = greedy_accuracy(eval_rows, roles, cfg.sampling.max_new_tokens, seed=cfg.run.seed)
        reduced = all_reduce_mean({"total": total, "count": float(count)}, info.device)
        return reduced["total"] / max(reduced["count"], 1.0)

    started = time.perf_counter()
    writer = MetricsWriter(out / "metrics.jsonl") if info.is_main else None
    rewards: list[float] = []
    acc_before = acc_after = evaluate()
    ahead: StepRollout | None = None
    with TrainProgress(cfg.run.steps, enabled=cfg.run.progress, quiet=not info.is_main) as progress:
        for step in range(1, cfg.run.steps + 1):
            timer.reset()
            timeline.begin_step(step)
            roles.workers.begin_step(step)
            step_start = time.perf_counter()
            current = ahead if ahead is not None else rollout(step)
            with timer.phase("rollout/wait"):  # controllers meet here; the time is what the fastest ones idle
                barrier()
            placement = rebalance_split(cfg, roles, loads, info, timer) if loads is not None else {}
            with timer.phase("update/train"):
                pending, batch_stats = start_update(current, roles, cfg.sampling, cfg.algo, trainer_version=step - 1)
                ahead = rollout(step + 1) if overlap and step < cfg.run.steps else None
                train_stats = roles.workers.finish_train(pending)
            with timer.phase("update/sync"):
                roles.workers.sync_weights()
            step_seconds = time.perf_counter() - step_start
            local = {**current.stats, **batch_stats, **train_stats, **timer.timings(), **placement, **length_stats,
                     "time/step": step_seconds}
            local.update(_utilisation(roles, timeline, step_seconds))
            local["memory/controller_peak_rss_mib_max"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            local["throughput/tokens_per_s"] = local["rollout/generated_tokens"] / step_seconds
            metrics = pool_reward_stats(all_reduce_mean(local, info.device, sum_keys=SUMMED_METRICS))
            if (cfg.run.eval_every > 0 and step % cfg.run.eval_every == 0) or step == cfg.run.steps:
                acc_after = evaluate()
                if acc_after is not None:
                    metrics["eval/accuracy"] = acc_after
            rewards.append(metrics["reward/mean"])
            if writer is not None:
                writer.write(step, metrics)
            progress.update(step, metrics)
            if "eval/accuracy" in metrics and 0 < cfg.run.stop_at_eval_accuracy <= metrics["eval/accuracy"]:
                break  # the same all-reduced accuracy on every controller, so all stop at this step
    timeline.close()
    if writer is not None:
        writer.close()
    if cfg.run.save_final and info.is_main:
        roles.workers.save_policy(str(out / "final"))
    barrier()
    return RunSummary(output_dir=str(out), steps=len(rewards), wall_seconds=time.perf_counter() - started,
                      first_reward=rewards[0], last_reward=rewards[-1],
                      eval_accuracy_before=acc_before, eval_accuracy_after=acc_after)


def rebalance_split(cfg: JobConfig, roles: Roles, loads: list[RolloutLoad], info: DistInfo,
                    timer: PhaseTimer) -> dict[str, float]:
    """Dynamic placement, between a rollout phase and its update: choose the next rollout / reward split.

    Each controller measures its slice's load, one all-reduce averages it over the controllers
    (float64, so every controller holds the same numbers), and each runs the same pure `rebalance`
    on the same history, so all slices move alike without a central process. The new split takes
    effect at this step's sync: only the devices that generate next load the policy's weights.
    Returns the step's placement metrics.
    """
    phase_s = timer.timings().get("time/rollout", 0.0)
    measured = all_reduce_mean(vars(roles.workers.rollout_load(phase_s)), info.device)
    measured["rollout_devices"] = round(measured["rollout_devices"])  # the same on every controller
    loads.append(RolloutLoad(**measured))
    current = len(roles.workers.rollout)
    min_devices = cfg.placement.min_devices
    min_reward = max([min_devices.get(role, 1) for role in REWARD_ROLES], default=1)
    decision = rebalance(loads, current, cfg.runtime.devices_per_controller, cfg.placement.rebalance,
                         min_rollout=min_devices.get("rollout", 1), min_reward=min_reward)
    roles.workers.set_split(decision.rollout_devices)
    return {"placement/rollout_devices": float(current), "placement/next_rollout_devices": float(decision.rollout_devices),
            "placement/generate_device_s": measured["generate_s"], "placement/score_device_s": measured["score_s"],
            "placement/predicted_rollout_s": decision.current_s, "placement/measured_rollout_s": phase_s}


def _utilisation(roles: Roles, timeline: TimelineRecorder, step_seconds: float) -> dict[str, float]:
    """Device utilisation of the slice, with the controller's own reward and waiting time.

    A device is idle while its controller waits for the others, so that wait is taken out of
    the device's idle time and reported as `util/wait_s`.
    """
    devices = roles.workers.utilisation(step_seconds)
    own = timeline.utilisation(step_seconds)
    wait = own["util/wait_s"]
    devices["util/wait_s"] = wait
    devices["util/idle_s"] = max(devices.get("util/idle_s", 0.0) - wait, 0.0)
    if "util/rewards/busy_s" in own:
        devices["util/rewards/busy_s"] = own["util/rewards/busy_s"]
    return devices

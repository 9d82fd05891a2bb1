"""Local runtime: K SPMD controller processes on this machine (K = 1 runs in this process).

Each process owns one device, one prompt shard, one generation engine and one FSDP trainer
worker; the trainer workers of all processes form one `torch.distributed` group. Process 0
writes the run directory (config, metrics, final model) and shows progress.
"""

from __future__ import annotations

import os
import resource
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gcore_rl.config import JobConfig
from gcore_rl.configlib import dump_yaml, from_dict, to_dict
from gcore_rl.controller.program import Roles, greedy_accuracy, rl_step
from gcore_rl.controller.waves import WaveSampler
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows
from gcore_rl.errors import ConfigError, GcoreError
from gcore_rl.models.loading import load_causal_lm, load_tokenizer, quiet_hf_libraries, save_model_dir
from gcore_rl.placement.plan import plan
from gcore_rl.rewards.judge_role import JudgeRewarder
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.telemetry.metrics import MetricsWriter, PhaseTimer
from gcore_rl.telemetry.progress import TrainProgress
from gcore_rl.telemetry.timeline import TimelineRecorder
from gcore_rl.training.actor import Actor
from gcore_rl.training.distributed import (
    DistInfo,
    all_reduce_mean,
    destroy_process_group,
    free_port,
    init_process_group,
    resolve_device,
    shard_model,
)


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


def run_job(cfg: JobConfig) -> RunSummary:
    """Run a whole job on the configured runtime and return its summary (GcoreError on bad input)."""
    prepare_run_dir(cfg)
    if cfg.runtime.kind == "ray":
        from gcore_rl.runtime.ray_runtime import run_on_ray

        return run_on_ray(cfg)
    port = free_port()
    world = cfg.runtime.num_processes
    if world == 1:
        return controller_main(0, to_dict(cfg), port)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    context = mp.start_processes(_child, args=(to_dict(cfg), port, queue), nprocs=world, join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as exc:
        raise GcoreError(f"a controller process failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise GcoreError(f"a controller process exited unexpectedly: {exc}") from None
    return queue.get()


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Check everything that can be checked before processes start, then write the resolved config."""
    roles = ["actor", "rollout"] + (["reference"] if cfg.algo.uses_reference else []) + (["judge"] if cfg.judge.enabled else [])
    plan(cfg.placement.strategy, cfg.runtime.num_processes, roles, controllers=cfg.runtime.num_processes)
    # fail fast on bad model paths and reward functions before any process starts; the prompt
    # data is read only by the controllers (the driver never holds it)
    load_tokenizer(cfg.model.path)
    if cfg.judge.enabled:
        load_tokenizer(cfg.judge.model_path)
    RuleRewards(cfg.reward)
    out = Path(cfg.run.output_dir)
    if (out / "metrics.jsonl").exists():
        raise ConfigError("run.output_dir", f"'{out}' already holds a run (metrics.jsonl); choose a new "
                          "run.output_dir or remove the old one, so earlier results are never overwritten")
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out / "config.yaml")
    return out


def _child(rank: int, cfg_dict: dict, port: int, queue) -> None:
    summary = controller_main(rank, cfg_dict, port)
    if rank == 0:
        queue.put(summary)


def controller_main(rank: int, cfg_dict: dict, port: int, master_addr: str = "127.0.0.1",
                    local_device: int | None = None) -> RunSummary:
    """Entry point of controller `rank`: set up roles, run all steps, clean up.

    `local_device` is the CUDA index on this node (default: the rank, one node); `master_addr`
    is where rank 0 listens for the trainer group.
    """
    quiet_hf_libraries()
    cfg = from_dict(JobConfig, cfg_dict)
    world = cfg.runtime.num_processes
    threads = cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    device = resolve_device(cfg.runtime.device, local_rank=rank if local_device is None else local_device)
    info = init_process_group(rank, world, port, device, master_addr)
    try:
        return _train(cfg, info)
    except Exception:
        if world > 1:
            traceback.print_exc()
        raise
    finally:
        destroy_process_group()


def build_roles(cfg: JobConfig, info: DistInfo) -> Roles:
    """Load the models of this controller's roles and wrap the actor in FSDP2."""
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    actor_model = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation, info.device)
    engine_model = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation, info.device)
    reference = None
    if cfg.algo.uses_reference:
        reference = load_causal_lm(cfg.reference_path or cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation, info.device)
        reference.requires_grad_(False)
        reference = shard_model(reference, bf16=cfg.train.bf16 and info.device.type == "cuda")
    actor_model = shard_model(actor_model, bf16=cfg.train.bf16 and info.device.type == "cuda")
    actor = Actor(actor_model, cfg.train, cfg.algo, cfg.sampling.logprob_temperature, info.device)
    engine = GenerationEngine(engine_model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    judge = JudgeRewarder.from_config(cfg.judge, info.device, seed=cfg.run.seed) if cfg.judge.enabled else None
    return Roles(rollout=engine, actor=actor, reference=reference, rewards=RuleRewards(cfg.reward), tokenizer=tokenizer,
                 judge=judge)


def _train(cfg: JobConfig, info: DistInfo) -> RunSummary:
    roles = build_roles(cfg, info)
    rows = load_prompt_rows(cfg.data)
    eval_rows = load_eval_rows(cfg.data)[info.rank::info.world_size]
    sampler = ShardedPromptSampler(len(rows), info.rank, info.world_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    local_prompts = cfg.run.prompts_per_step // info.world_size
    waves = WaveSampler(cfg.dynamic_sampling, cfg.dynamic_sampling.resolve_target(local_prompts))

    def draw_rows(count: int) -> list[dict]:
        return [rows[i] for i in sampler.next_indices(count)]
    out = Path(cfg.run.output_dir)
    timeline = TimelineRecorder(info.rank, out / "timeline" / f"device-{info.rank}.jsonl")
    timer = PhaseTimer(on_span=timeline.record)
    started = time.perf_counter()
    rewards: list[float] = []

    def evaluate(step: int) -> float | None:
        if not cfg.data.task or cfg.data.eval_prompts == 0:
            return None
        total, count = greedy_accuracy(eval_rows, roles, cfg.sampling.max_new_tokens, seed=cfg.run.seed)
        reduced = all_reduce_mean({"total": total, "count": float(count)}, info.device)
        return reduced["total"] / max(reduced["count"], 1.0)

    writer = MetricsWriter(out / "metrics.jsonl") if info.is_main else None
    acc_before = evaluate(0)
    acc_after = acc_before
    with TrainProgress(cfg.run.steps, enabled=cfg.run.progress, quiet=not info.is_main) as progress:
        for step in range(1, cfg.run.steps + 1):
            timer.reset()
            timeline.begin_step(step)
            step_start = time.perf_counter()
            local = rl_step(draw_rows, waves, roles, cfg.sampling, cfg.algo, timer,
                            seed=cfg.run.seed * 100_003 + step * 97 + info.rank)
            step_seconds = time.perf_counter() - step_start
            local.update(timer.timings())
            local["time/step"] = step_seconds
            local.update(timeline.utilisation(step_seconds))
            local["memory/controller_peak_rss_mib_max"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            local["throughput/tokens_per_s"] = local["rollout/generated_tokens"] / step_seconds
            metrics = all_reduce_mean(local, info.device)
            if step % max(cfg.run.eval_every, 1) == 0 and cfg.run.eval_every > 0 or step == cfg.run.steps:
                acc_after = evaluate(step)
                if acc_after is not None:
                    metrics["eval/accuracy"] = acc_after
            rewards.append(metrics["reward/mean"])
            if writer is not None:
                writer.write(step, metrics)
            progress.update(step, metrics)
    timeline.close()
    if writer is not None:
        writer.close()
    if cfg.run.save_final and info.is_main:
        # the engine holds the full, freshly synced weights: no gather of the sharded actor needed
        save_model_dir(roles.rollout.model, roles.tokenizer, out / "final")
    if info.world_size > 1:
        dist.barrier()
    return RunSummary(output_dir=str(out), steps=cfg.run.steps, wall_seconds=time.perf_counter() - started,
                      first_reward=rewards[0], last_reward=rewards[-1],
                      eval_accuracy_before=acc_before, eval_accuracy_after=acc_after)

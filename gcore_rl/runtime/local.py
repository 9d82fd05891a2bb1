"""Local runtime: K SPMD controller processes on this machine (K = 1 runs in this process).

Each process is one controller with one device: its prompt shard, and a `DeviceWorker` in the
same process holding the engine(s) and the FSDP trainer worker; the trainer workers of all
processes form one `torch.distributed` group. Process 0 writes the run directory (config,
metrics, final model) and shows progress. Only `colocate` fits one device per controller; the
Ray runtime runs slices of several devices.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gcore_rl.config import JobConfig, build_plan, check_devices, model_reward_weights, prompt_room
from gcore_rl.configlib import dump_yaml, from_dict, to_dict
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.loop import RunSummary, run_controller
from gcore_rl.controller.program import Roles
from gcore_rl.controller.slice import SliceClient
from gcore_rl.distributed import destroy_process_group, free_port, init_process_group, resolve_device
from gcore_rl.errors import ConfigError, GcoreError
from gcore_rl.models.loading import check_model_dir, load_tokenizer, quiet_hf_libraries
from gcore_rl.placement.plan import worker_specs
from gcore_rl.rewards.reward_model import check_reward_model_dir
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.runtime.device_worker import DeviceWorker

__all__ = ["RunSummary", "controller_main", "prepare_run_dir", "run_job"]


def run_job(cfg: JobConfig) -> RunSummary:
    """Run a whole job on the configured runtime and return its summary (GcoreError on bad input).

    The summary is also written to the run directory as `summary.json`.
    """
    prepare_run_dir(cfg)
    summary = _run_controllers(cfg)
    (Path(cfg.run.output_dir) / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary


def _run_controllers(cfg: JobConfig) -> RunSummary:
    """Start the job's controllers on the configured runtime and wait for controller 0's summary."""
    if cfg.runtime.kind == "ray":
        from gcore_rl.runtime.ray_runtime import run_on_ray

        return run_on_ray(cfg)
    port = free_port()
    world = cfg.runtime.controllers
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
        reported = queue.get() if not queue.empty() else None
        if isinstance(reported, GcoreError):
            raise reported from None  # a user-facing error of a controller, shown as the one paragraph it is
        raise GcoreError(f"a controller process exited unexpectedly: {exc}") from None
    return queue.get()


def prepare_run_dir(cfg: JobConfig) -> Path:
    """Check everything that can be checked before processes start, then write the resolved config."""
    build_plan(cfg)
    check_devices(cfg)
    # fail fast on bad model paths and reward functions before any process starts; the prompt
    # data is read only by the controllers (the driver never holds it)
    load_tokenizer(cfg.model.path)
    prompt_room(cfg).budget()  # ConfigError when sampling.max_new_tokens fills the context
    if cfg.reference_path:
        check_model_dir(cfg.reference_path)
    if cfg.judge.enabled:
        load_tokenizer(cfg.judge.model_path)
    if cfg.reward_model.enabled:
        check_reward_model_dir(cfg.reward_model.model_path)
        load_tokenizer(cfg.reward_model.model_path)
    RuleRewards(cfg.reward)
    out = Path(cfg.run.output_dir)
    if (out / "metrics.jsonl").exists():
        raise ConfigError("run.output_dir", f"'{out}' already holds a run (metrics.jsonl); choose a new "
                          "run.output_dir or remove the old one, so earlier results are never overwritten")
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out / "config.yaml")
    return out


def _child(rank: int, cfg_dict: dict, port: int, queue) -> None:
    try:
        summary = controller_main(rank, cfg_dict, port)
    except GcoreError as exc:
        queue.put(exc)  # the driver shows it; the non-zero exit makes it stop the other controllers
        raise SystemExit(1) from None
    if rank == 0:
        queue.put(summary)


def controller_main(rank: int, cfg_dict: dict, port: int) -> RunSummary:
    """Entry point of local controller `rank`: its device worker lives in this same process.

    The process group of the K processes is both the trainer group (FSDP) and the controllers'
    group (metric all-reduce, step barrier).
    """
    quiet_hf_libraries()
    cfg = from_dict(JobConfig, cfg_dict)
    world = cfg.runtime.controllers
    torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world))
    device = resolve_device(cfg.runtime.device, local_rank=rank)
    info = init_process_group(rank, world, port, device)
    worker = None
    try:
        spec = worker_specs(build_plan(cfg))[rank]
        worker = DeviceWorker(spec, cfg_dict, trainer_group=None)
        workers = SliceClient([LocalHandle(worker)], [spec], stream_to_scorers=False)
        roles = Roles(workers=workers, rewards=RuleRewards(cfg.reward), tokenizer=worker.tokenizer,
                      model_weights=model_reward_weights(cfg))
        return run_controller(cfg, info, roles)
    except GcoreError:
        raise  # expected, user-facing: `_child` hands it to the driver
    except Exception:
        if world > 1:
            traceback.print_exc()
        raise
    finally:
        if worker is not None:
            worker.close()
        destroy_process_group()

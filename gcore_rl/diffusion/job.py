"""A Flow-GRPO job's controller processes on this machine: each hosts its one device's `FlowWorker` and runs
the program of `diffusion/program.py` over it (`runtime/flow.py` starts them, or Ray actors instead).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gcore_rl.configlib import from_dict, to_dict
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.program import FlowRunSummary, run_flow_controller
from gcore_rl.diffusion.slice import FlowSlice
from gcore_rl.diffusion.worker import FlowWorker
from gcore_rl.distributed import destroy_process_group, init_process_group, resolve_device
from gcore_rl.errors import ConfigError
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.placement.plan import Plan, plan, worker_specs


def check_output_dir(cfg: FlowGrpoJobConfig) -> None:
    """ConfigError when `run.output_dir` holds a finished run (the driver checks before starting controllers)."""
    out = Path(cfg.run.output_dir)
    if (out / "final").exists():
        raise ConfigError("run.output_dir", f"'{out}' already holds a finished run (final/); choose a new directory or remove it")


def flow_plan(cfg: FlowGrpoJobConfig) -> Plan:
    """The job's placement plan (ConfigError naming the key for an impossible layout)."""
    return plan(cfg.placement.strategy, cfg.runtime.devices, cfg.roles, controllers=cfg.runtime.controllers,
                rollout_devices=cfg.placement.rollout_devices, train_devices=cfg.placement.train_devices)


def flow_controller(rank: int, cfg_dict: dict, port: int) -> FlowRunSummary:
    """Local controller `rank`: its device's worker lives in this process; with K > 1 processes the group at
    `port` is both the trainer group (FSDP2) and the controllers' (metrics, stop decision)."""
    quiet_hf_libraries()
    cfg = from_dict(FlowGrpoJobConfig, cfg_dict)
    world = cfg.runtime.controllers
    torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world))
    device = resolve_device(cfg.runtime.device, local_rank=rank)  # controller k on CUDA device k
    grouped = world > 1
    if grouped:  # on CUDA an NCCL group: the controllers' reductions then run on the device too
        init_process_group(rank, world, port, device)
    worker = None
    try:
        job_plan = flow_plan(cfg)
        spec = worker_specs(job_plan)[rank]
        worker = FlowWorker(spec, cfg_dict, device=device)
        devices = FlowSlice([LocalHandle(worker)], [spec], job_plan, chunk=cfg.sampling.batch_size)
        return run_flow_controller(cfg, rank, world, devices, collectives=device)
    finally:
        if worker is not None:
            worker.close()
        if grouped:
            destroy_process_group()


def run_flow_grpo(cfg: FlowGrpoJobConfig) -> FlowRunSummary:
    """The job in this process, as its only controller (`gcore_rl.runtime.flow.run_flow_job` starts K of them)."""
    check_output_dir(cfg)
    return flow_controller(0, to_dict(cfg), port=0)

"""Local runtime: K SPMD controller processes on this machine (K = 1 runs in this process).

Each process is one controller with one device: its prompt shard, and a `DeviceWorker` in the
same process holding the engine(s) and the FSDP trainer worker; the trainer workers of all
processes form one `torch.distributed` group. Process 0 writes the run directory (config,
metrics, final model) and shows progress. Only a plan that does not split a slice (`colocate`) fits
one device per controller; the Ray runtime runs slices of several devices. The driver
(`runtime/driver.py`) calls `run_local` with the plan it built.

Failures (runtime/healing.py): a spawned controller that dies, or raises anything but a
`GcoreError` of our own checks, ends the job with `ProcessFailure` (the others are stopped), and so
does a hang, which the driver's `Watchdog` detects while it waits (`runtime.phase_timeout_s`);
`run_job` may then restart the job from its checkpoint. With one controller (K = 1) everything
runs in the driver's process: a process death takes the driver with it and cannot be healed, and
there is no watchdog.
"""

from __future__ import annotations

import os
import traceback

import torch

from gcore_rl.config import JobConfig
from gcore_rl.configlib import from_dict, to_dict
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.loop import RunSummary, run_controller
from gcore_rl.controller.program import ControllerContext
from gcore_rl.controller.slice import SliceClient
from gcore_rl.data.balance import SequenceCost
from gcore_rl.distributed import destroy_process_group, free_port, init_process_group, resolve_device
from gcore_rl.errors import GcoreError
from gcore_rl.models.loading import quiet_hf_libraries, read_model_config
from gcore_rl.placement.plan import Plan, worker_specs
from gcore_rl.runtime.device_worker import DeviceWorker
from gcore_rl.runtime.healing import enable_stack_dumps
from gcore_rl.runtime.spawn import spawn_controllers

__all__ = ["controller_main", "run_local"]


def run_local(cfg: JobConfig, job_plan: Plan) -> RunSummary:
    """Run the controllers of a job on this machine (one in this process, or K spawned processes)
    and return controller 0's summary."""
    port = free_port()
    world = cfg.runtime.controllers
    if world == 1:
        return controller_main(0, to_dict(cfg), job_plan, port)
    return spawn_controllers(controller_main, (to_dict(cfg), job_plan, port), world, cfg.run.output_dir,
                             cfg.runtime.phase_timeout_s)


def controller_main(rank: int, cfg_dict: dict, job_plan: Plan, port: int) -> RunSummary:
    """Entry point of local controller `rank`: its device worker lives in this same process.

    The process group of the K processes is both the trainer group (FSDP) and the controllers'
    group (metric all-reduce, step barrier).
    """
    quiet_hf_libraries()
    cfg = from_dict(JobConfig, cfg_dict)
    world = cfg.runtime.controllers
    if world > 1 and cfg.runtime.phase_timeout_s > 0:
        enable_stack_dumps(cfg.run.output_dir, f"controller-{rank}")  # this process also hosts device `rank`
    torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world))
    device = resolve_device(cfg.runtime.device, local_rank=rank)
    info = init_process_group(rank, world, port, device)
    worker = None
    try:
        spec = worker_specs(job_plan)[rank]
        worker = DeviceWorker(spec, cfg_dict, trainer_group=None)
        row_cost = SequenceCost.from_config(read_model_config(cfg.model.path))
        ctx = ControllerContext.for_job(cfg, SliceClient([LocalHandle(worker)], [spec], job_plan, row_cost=row_cost),
                                        worker.tokenizer)
        with ctx.rewards:  # stops the reward pool's processes on every way out
            return run_controller(cfg, info, ctx)
    except GcoreError:
        raise  # expected, user-facing: `spawn_controllers` hands it to the driver
    except Exception:
        if world > 1:
            traceback.print_exc()
        raise
    finally:
        if worker is not None:
            worker.close()
        destroy_process_group()

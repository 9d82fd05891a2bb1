"""Local runtime: K SPMD controller processes on this machine (K = 1 runs in this process).

Each process is one controller with one device: its prompt shard, and the device worker of the job's
kind (`runtime/kinds.py`: a `DeviceWorker`, or a diffusion job's `ImageDeviceWorker`) in the same process
holding the engine(s) and the FSDP trainer worker; the trainer workers of all
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
from typing import Any

import torch

from gcore_rl.configlib import to_dict
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.distributed import destroy_process_group, free_port, init_process_group, resolve_device
from gcore_rl.errors import GcoreError
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.placement.plan import Plan, worker_specs
from gcore_rl.runtime.healing import enable_stack_dumps
from gcore_rl.runtime.kinds import LANGUAGE, PolicyKind, policy_kind
from gcore_rl.runtime.spawn import spawn_controllers

__all__ = ["controller_main", "run_local"]


def run_local(cfg: Any, job_plan: Plan, kind: PolicyKind = LANGUAGE) -> Any:
    """Run the controllers of a job of `kind` on this machine (one in this process, or K spawned processes)
    and return controller 0's summary."""
    port = free_port()
    world = cfg.runtime.controllers
    if world == 1:
        return controller_main(0, kind.name, to_dict(cfg), job_plan, port)
    return spawn_controllers(controller_main, (kind.name, to_dict(cfg), job_plan, port), world, cfg.run.output_dir,
                             cfg.runtime.phase_timeout_s)


def controller_main(rank: int, kind_name: str, cfg_dict: dict, job_plan: Plan, port: int) -> Any:
    """Entry point of local controller `rank` of a job of kind `kind_name`: its device worker lives in this
    same process.

    The process group of the K processes is both the trainer group (FSDP) and the controllers'
    group (metric all-reduce, step barrier).
    """
    quiet_hf_libraries()
    kind = policy_kind(kind_name)
    cfg = kind.read_config(cfg_dict)
    world = cfg.runtime.controllers
    if world > 1 and cfg.runtime.phase_timeout_s > 0:
        enable_stack_dumps(cfg.run.output_dir, f"controller-{rank}")  # this process also hosts device `rank`
    torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // world))
    device = resolve_device(cfg.runtime.device, local_rank=rank)
    info = init_process_group(rank, world, port, device)
    worker = None
    try:
        spec = worker_specs(job_plan)[rank]
        worker = kind.worker()(spec, cfg_dict, trainer_group=None)
        return kind.controller(cfg, info, [LocalHandle(worker)], [spec], job_plan, None, True)
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

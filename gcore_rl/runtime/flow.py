"""The driver of a diffusion job: checks the run directory and the plan, then runs the controllers — in this
process (K = 1), as K local processes, or with the plan's device workers as Ray actors.

On Ray, each device of the plan gets a `FlowWorker` actor in its bundle of one placement group
(a GPU, or a logical `device` slot on a CPU-only machine) and each slice a controller actor; the
trainer workers form one `torch.distributed` group (FSDP2), the controllers another (metrics, stop
decision). Images and trajectories move only between a controller and its slice's workers; the driver
receives controller 0's summary.
"""

from __future__ import annotations

import os

from gcore_rl.config import check_devices
from gcore_rl.configlib import from_dict, load_config, to_dict
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.diffusion.job import check_output_dir, flow_controller, flow_plan, run_flow_grpo
from gcore_rl.diffusion.program import FlowRunSummary
from gcore_rl.diffusion.worker import FlowWorker
from gcore_rl.distributed import exit_without_teardown, free_port
from gcore_rl.errors import GcoreError, ProcessFailure
from gcore_rl.placement.plan import Plan, WorkerSpec, worker_specs
from gcore_rl.runtime.ray_runtime import (
    DEVICE_RESOURCE,
    RayProcess,
    _first_line,
    _wait_all,
    end_actors,
    ray_devices,
)
from gcore_rl.runtime.resume import JobKind, take_up
from gcore_rl.runtime.spawn import spawn_controllers

FLOW_JOB = JobKind(load=lambda path: load_config(FlowGrpoJobConfig, str(path), []),
                   fixed_keys=("model", "sampling", "train", "reward", "reward_model", "judge", "data", "run.seed",
                               "run.prompts_per_step", "runtime.controllers"),
                   frozen=lambda cfg: cfg.frozen_model_paths)
"""How a resumed diffusion job is compared with the one that saved its checkpoint (`runtime.resume.take_up`): what
shapes the model, the data and the update must agree, and the controllers too (each draws its own shard's prompts)."""


def run_flow_job(cfg: FlowGrpoJobConfig) -> FlowRunSummary:
    """Run a `kind: flow_grpo` job on its runtime (continuing from a checkpoint with `run.resume`); controller 0's summary."""
    check_output_dir(cfg)
    cfg = take_up(cfg, FLOW_JOB)
    if cfg.runtime.kind == "local":  # on Ray a diffusion job runs on the CPU (`auto` too): no GPU to count
        check_devices(cfg.runtime)
    job_plan = flow_plan(cfg)
    if cfg.runtime.kind == "ray":
        return _run_on_ray(cfg, job_plan)
    if cfg.runtime.controllers == 1:
        return run_flow_grpo(cfg)
    return spawn_controllers(flow_controller, (to_dict(cfg), free_port()), cfg.runtime.controllers, cfg.run.output_dir)


class FlowWorkerActor(RayProcess):
    """A `FlowWorker` as a Ray actor: created empty, set up once the trainer group's address is known."""

    def __init__(self, workdir: str, threads: int):
        import torch

        super().__init__(workdir)
        torch.set_num_threads(threads)
        self.worker: FlowWorker | None = None

    def setup(self, spec: WorkerSpec, cfg_dict: dict, trainer_group: tuple[str, int] | None) -> int:
        from gcore_rl.models.loading import quiet_hf_libraries

        quiet_hf_libraries()
        exit_without_teardown()  # the driver ends this process (`end_actors`); `close` leaves its group to that
        self.worker = FlowWorker(spec, cfg_dict, trainer_group)
        return spec.device

    # the worker's methods, as the controller's `RayHandle` calls them by name
    def sample(self, *args, **kwargs):
        return self.worker.sample(*args, **kwargs)

    def score(self, *args):
        return self.worker.score(*args)

    def train(self, *args):
        return self.worker.train(*args)

    def sync(self, *args):
        return self.worker.sync(*args)

    def publish(self):
        return self.worker.publish()

    def load_weights(self, *args):
        return self.worker.load_weights(*args)

    def save_checkpoint(self, *args):
        return self.worker.save_checkpoint(*args)

    def finish_checkpoint(self):
        return self.worker.finish_checkpoint()

    def load_checkpoint(self, *args):
        return self.worker.load_checkpoint(*args)

    def save_policy(self, *args):
        return self.worker.save_policy(*args)

    def timeline(self, *args):
        return self.worker.timeline(*args)

    def calls_made(self):
        return self.worker.calls_made()

    def close(self):
        return self.worker.close() if self.worker is not None else None


class FlowControllerActor(RayProcess):
    """One SPMD controller of a diffusion job on Ray: its shard, and handles to its slice's workers."""

    def run(self, rank: int, cfg_dict: dict, job_plan: Plan, group: tuple[str, int], workers: list,
            specs: list[WorkerSpec]) -> FlowRunSummary:
        import torch

        from gcore_rl.controller.handles import RayHandle
        from gcore_rl.diffusion.program import run_flow_controller
        from gcore_rl.diffusion.slice import FlowSlice
        from gcore_rl.distributed import init_process_group

        cfg = from_dict(FlowGrpoJobConfig, cfg_dict)
        torch.set_num_threads(1)  # the controller rewards pixels; the workers do the heavy work
        exit_without_teardown()  # the driver ends this process (`end_actors`); the group is left to that
        init_process_group(rank, cfg.runtime.controllers, group[1], torch.device("cpu"), group[0])
        devices = FlowSlice([RayHandle(w) for w in workers], specs, job_plan, chunk=cfg.sampling.batch_size)
        return run_flow_controller(cfg, rank, cfg.runtime.controllers, devices)


def _run_on_ray(cfg: FlowGrpoJobConfig, job_plan: Plan) -> FlowRunSummary:
    """Place one worker per device and one controller per slice in a placement group, run, always clean up."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    specs = worker_specs(job_plan)
    with ray_devices(cfg.runtime.ray_address, {DEVICE_RESOURCE: 1}, len(specs), job_plan.strategy) as group:
        def in_bundle(index: int, **options):
            return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                        **options)

        actors: list = []
        try:
            threads = cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // len(specs))
            workers = [ray.remote(FlowWorkerActor).options(**in_bundle(s.device, num_cpus=0, resources={DEVICE_RESOURCE: 1}))
                       .remote(os.getcwd(), threads) for s in specs]
            controllers = [ray.remote(FlowControllerActor).options(**in_bundle(devs[0], num_cpus=0)).remote(os.getcwd())
                           for devs in job_plan.slices]
            actors = workers + controllers
            first_trainer = next(w for w, s in zip(workers, specs, strict=True) if s.trainer_rank == 0)
            trainer_group = ray.get(first_trainer.rendezvous.remote())
            cfg_dict = to_dict(cfg)
            _wait_all(ray, [w.setup.remote(s, cfg_dict, trainer_group if s.trainer_rank is not None else None)
                            for w, s in zip(workers, specs, strict=True)])
            controller_group = ray.get(controllers[0].rendezvous.remote())
            pending = []
            for rank, (controller, devs) in enumerate(zip(controllers, job_plan.slices, strict=True)):
                mine = [(w, s) for w, s in zip(workers, specs, strict=True) if s.device in devs]
                pending.append(controller.run.remote(rank, cfg_dict, job_plan, controller_group, [w for w, _ in mine],
                                                     [s for _, s in mine]))
            _wait_all(ray, pending)
            return ray.get(pending[0])
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, GcoreError):
                raise exc.cause from None
            raise ProcessFailure(f"a controller or device worker failed on Ray: {_first_line(exc.cause or exc)}\n{exc}") from None
        except ray.exceptions.RayActorError as exc:
            raise ProcessFailure(f"a controller or device worker process died on Ray:\n{exc}") from None
        finally:
            end_actors(ray, actors)

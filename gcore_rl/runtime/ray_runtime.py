"""Ray runtime: the plan's device workers and the K SPMD controllers as Ray actors.

The driver (this process) turns the placement plan into one placement group with a bundle per
device, starts one `DeviceWorker` actor in each bundle and one controller actor per slice (on the
node of its slice's first device, using no device itself), waits, and receives the small
`RunSummary`. Prompts, completions and tensors move only between a controller and the workers of
its slice; the trainer workers of all slices form one `torch.distributed` group, the controllers
another (metrics all-reduce and step barrier). Devices are GPUs where the cluster has them, else
logical device slots declared as the Ray custom resource `device`, so the same placement code
runs on a CPU-only machine.
"""

from __future__ import annotations

import os
import socket

from gcore_rl.config import JobConfig, model_reward_weights
from gcore_rl.configlib import from_dict, to_dict
from gcore_rl.controller.loop import RunSummary
from gcore_rl.distributed import free_port
from gcore_rl.errors import GcoreError
from gcore_rl.faults import ENV as FAULT_ENV
from gcore_rl.placement.plan import Plan, WorkerSpec, worker_specs
from gcore_rl.runtime.device_worker import DeviceWorker
from gcore_rl.runtime.ray_connect import connect

#: Ray custom resource naming a logical device slot on CPU-only machines.
DEVICE_RESOURCE = "device"
READY_TIMEOUT_S = 300


def _rendezvous() -> tuple[str, int]:
    """Address and a free port of the calling process's node."""
    return socket.gethostbyname(socket.gethostname()), free_port()


class WorkerActor(DeviceWorker):
    """A `DeviceWorker` as a Ray actor: created empty, then `setup` once the trainer group's address is known."""

    def __init__(self, workdir: str):  # noqa: D107 - the real constructor runs in `setup`
        os.chdir(workdir)  # relative paths in the config resolve as they did for the driver

    def rendezvous(self) -> tuple[str, int]:
        return _rendezvous()

    def setup(self, spec: WorkerSpec, cfg_dict: dict, trainer_group: tuple[str, int] | None, use_gpu: bool) -> int:
        DeviceWorker.__init__(self, spec, cfg_dict, trainer_group=trainer_group, cuda_index=0 if use_gpu else None)
        return spec.device


class ControllerActor:
    """One SPMD controller: its shard, and handles to the device workers of its slice."""

    def __init__(self, workdir: str):
        os.chdir(workdir)

    def rendezvous(self) -> tuple[str, int]:
        return _rendezvous()

    def run(self, rank: int, cfg_dict: dict, job_plan: Plan, group: tuple[str, int], workers: list,
            specs: list[WorkerSpec]):
        import torch

        from gcore_rl.controller.handles import RayHandle
        from gcore_rl.controller.loop import run_controller
        from gcore_rl.controller.program import ControllerContext
        from gcore_rl.controller.slice import SliceClient
        from gcore_rl.distributed import destroy_process_group, init_process_group
        from gcore_rl.models.loading import load_tokenizer, quiet_hf_libraries
        from gcore_rl.rewards.rule import RuleRewards

        quiet_hf_libraries()
        cfg = from_dict(JobConfig, cfg_dict)
        torch.set_num_threads(max(cfg.runtime.threads_per_process, 1))
        device = torch.device("cpu")  # controllers talk over gloo; tensors stay with the workers
        info = init_process_group(rank, cfg.runtime.controllers, group[1], device, group[0])
        try:
            client = SliceClient([RayHandle(w) for w in workers], specs, job_plan)
            ctx = ControllerContext(workers=client, rewards=RuleRewards(cfg.reward),
                                    tokenizer=load_tokenizer(cfg.model.path), reward_model_weights=model_reward_weights(cfg))
            try:
                return run_controller(cfg, info, ctx)
            finally:
                client.close()
        finally:
            destroy_process_group()


def run_on_ray(cfg: JobConfig, job_plan: Plan) -> RunSummary:
    """Start (or join) Ray, place workers and controllers by the driver's plan, run, and always clean up."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    specs = worker_specs(job_plan)
    devices = len(specs)
    use_gpu = cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and _cuda_available())
    started_here = not ray.is_initialized()
    if started_here:
        if cfg.runtime.ray_address:
            connect(cfg.runtime.ray_address, log_to_driver=True)  # token auth, unreachable clusters: see ray_connect
        else:
            ray.init(num_cpus=os.cpu_count(), resources={DEVICE_RESOURCE: devices}, include_dashboard=False,
                     log_to_driver=True)
    bundle = {"GPU": 1} if use_gpu else {DEVICE_RESOURCE: 1}
    group = placement_group([bundle] * devices, strategy="PACK")
    actors: list = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=120)
        if not ready:
            raise GcoreError(f"Ray could not reserve {devices} bundles of {bundle} for the {job_plan.strategy} plan "
                             f"within 120 s; the cluster has {ray.cluster_resources()}")

        def in_bundle(index: int, **resources):
            return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                        runtime_env=_job_env(), **resources)
        worker_cls, controller_cls = ray.remote(WorkerActor), ray.remote(ControllerActor)
        device_res = {"num_gpus": 1} if use_gpu else {"resources": {DEVICE_RESOURCE: 1}}
        workers = [worker_cls.options(**in_bundle(s.device, num_cpus=0, **device_res)).remote(os.getcwd()) for s in specs]
        controllers = [controller_cls.options(**in_bundle(devs[0], num_cpus=0)).remote(os.getcwd())
                       for devs in job_plan.slices]
        actors = workers + controllers
        first_trainer = next(w for w, s in zip(workers, specs, strict=True) if s.trainer_rank == 0)
        trainer_group = ray.get(first_trainer.rendezvous.remote())
        _get_all(ray, [w.setup.remote(s, to_dict(cfg), trainer_group if s.trainer_rank is not None else None, use_gpu)
                       for w, s in zip(workers, specs, strict=True)])
        controller_group = ray.get(controllers[0].rendezvous.remote())
        cfg_dict = to_dict(cfg)
        pending = []
        for rank, (controller, devs) in enumerate(zip(controllers, job_plan.slices, strict=True)):
            mine = [(w, s) for w, s in zip(workers, specs, strict=True) if s.device in devs]
            pending.append(controller.run.remote(rank, cfg_dict, job_plan, controller_group, [w for w, _ in mine],
                                                 [s for _, s in mine]))
        _get_all(ray, pending)
        return ray.get(pending[0])
    except ray.exceptions.RayTaskError as exc:
        raise GcoreError(f"a controller or device worker failed on Ray:\n{exc}") from None
    except ray.exceptions.RayActorError as exc:
        raise GcoreError(f"a controller or device worker process died on Ray (out of memory, a crash or a "
                         f"lost node):\n{exc}") from None
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        if started_here:
            ray.shutdown()


def _job_env() -> dict:
    """The environment the job's actors need beyond the cluster's own: a fault to inject (`faults.ENV`), if set."""
    fault = os.environ.get(FAULT_ENV)
    return {"env_vars": {FAULT_ENV: fault}} if fault else {}


def _get_all(ray, pending: list) -> None:
    """Wait for every task; the first failure is raised at once (the caller kills the rest)."""
    remaining = list(pending)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        ray.get(done)  # raises RayTaskError when that task failed


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

"""Ray runtime: the K SPMD controllers run as Ray actors, one per device bundle.

The driver (this process) only starts the actors, waits and receives the small `RunSummary`:
prompts, completions and tensors stay inside each controller and its trainer group. Devices are
GPUs where the cluster has them, else logical device slots declared as the Ray custom resource
`device`, so the same placement code runs on a CPU-only machine.
"""

from __future__ import annotations

import os
import socket

from gcore_rl.config import JobConfig
from gcore_rl.configlib import to_dict
from gcore_rl.errors import GcoreError
from gcore_rl.runtime.local import RunSummary, controller_main
from gcore_rl.training.distributed import free_port

#: Ray custom resource naming a logical device slot on CPU-only machines.
DEVICE_RESOURCE = "device"


class ControllerActor:
    """One controller: its shard, engine and trainer worker, in a Ray worker process."""

    def __init__(self, workdir: str):
        os.chdir(workdir)  # relative paths in the config resolve as they did for the driver

    def rendezvous(self) -> tuple[str, int]:
        """Address and a free port of this actor's node (asked of rank 0 only)."""
        return socket.gethostbyname(socket.gethostname()), free_port()

    def run(self, rank: int, cfg_dict: dict, master_addr: str, port: int, use_gpu: bool) -> RunSummary:
        return controller_main(rank, cfg_dict, port, master_addr, local_device=0 if use_gpu else None)


def run_on_ray(cfg: JobConfig) -> RunSummary:
    """Start (or join) Ray, place K controllers on K device bundles, run, and always clean up."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = cfg.runtime.num_processes
    use_gpu = cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and _cuda_available())
    started_here = not ray.is_initialized()
    if started_here:
        if cfg.runtime.ray_address:
            ray.init(address=cfg.runtime.ray_address, log_to_driver=True)
        else:
            ray.init(num_cpus=os.cpu_count(), resources={DEVICE_RESOURCE: world}, include_dashboard=False,
                     log_to_driver=True)
    bundle = {"GPU": 1} if use_gpu else {DEVICE_RESOURCE: 1}
    group = placement_group([bundle] * world, strategy="PACK")
    actors = []
    try:
        ready, _ = ray.wait([group.ready()], timeout=120)
        if not ready:
            raise GcoreError(f"Ray could not reserve {world} bundles of {bundle} within 120 s; the cluster has "
                             f"{ray.cluster_resources()}")
        remote_cls = ray.remote(ControllerActor)
        actors = [
            remote_cls.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                               **({"num_gpus": 1} if use_gpu else {"resources": {DEVICE_RESOURCE: 1}})).remote(os.getcwd())
            for rank in range(world)
        ]
        master_addr, port = ray.get(actors[0].rendezvous.remote())
        cfg_dict = to_dict(cfg)
        pending = [actor.run.remote(rank, cfg_dict, master_addr, port, use_gpu) for rank, actor in enumerate(actors)]
        summary = ray.get(pending[0]) if _wait_all(ray, pending) else None
        return summary
    except ray.exceptions.RayTaskError as exc:
        raise GcoreError(f"a controller failed on Ray:\n{exc}") from None
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        if started_here:
            ray.shutdown()


def _wait_all(ray, pending: list) -> bool:
    """Wait for every controller; the first failure is raised at once (the others are killed by the caller)."""
    remaining = list(pending)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        ray.get(done)  # raises RayTaskError when that controller failed
    return True


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

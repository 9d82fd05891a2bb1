"""Ray runtime: the plan's device workers and the K SPMD controllers as Ray actors.

The driver (this process) turns the placement plan into one placement group with a bundle per
device, starts one device worker actor in each bundle (the class the job's `PolicyKind` names, made an
actor by `worker_actor`) and one controller actor per slice (on the node of its slice's first device,
using no device itself, running the kind's controller program), waits, and receives the small summary. Prompts, completions and tensors move only between a controller and the workers of
its slice; the trainer workers of all slices form one `torch.distributed` group, the controllers
another (metrics all-reduce and step barrier). Devices are GPUs where the cluster has them, else
logical device slots declared as the Ray custom resource `device`, so the same placement code
runs on a CPU-only machine.

Failures (runtime/healing.py): a device worker that holds no trainer shard is started with Ray's
`max_restarts` = `run.max_restarts`, and its controller revives it in place when it dies in the
rollout phase. Any other death of an actor, or an exception in one that is not a `GcoreError` of
our own checks, ends the attempt with `ProcessFailure`, as does a hang, which the driver's
`Watchdog` detects while it waits for the controllers (`runtime.phase_timeout_s`); `run_job`
may then restart the job from its checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from gcore_rl.configlib import to_dict
from gcore_rl.controller.handles import WorkerLost
from gcore_rl.controller.preemption import PreemptionWatch, request_preemption
from gcore_rl.distributed import exit_without_teardown, flush_outputs, free_port
from gcore_rl.errors import GcoreError, ProcessFailure
from gcore_rl.faults import job_env as fault_env
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.placement.plan import Plan, WorkerSpec, worker_specs
from gcore_rl.runtime.healing import Watchdog, enable_stack_dumps, record_device_restart
from gcore_rl.runtime.kinds import LANGUAGE, PolicyKind
from gcore_rl.runtime.ray_connect import connect

#: Ray custom resource naming a logical device slot on CPU-only machines.
DEVICE_RESOURCE = "device"
READY_TIMEOUT_S = 300


def _rendezvous() -> tuple[str, int]:
    """Address and a free port of the calling process's node."""
    return socket.gethostbyname(socket.gethostname()), free_port()


class NotSetUp(WorkerLost, AttributeError):
    """A call reached a worker process that Ray restarted and nobody has set up again yet."""


class RayWorker:
    """What makes a device worker class a Ray actor (`worker_actor`): created empty, then `setup` once the
    trainer group's address is known.

    Ray re-runs only `__init__` when it restarts the actor after its process died, so until the
    controller calls `setup` again every worker method fails with `NotSetUp`, which the controller
    takes for the lost worker it is (a `WorkerLost`) rather than for a bug.
    """

    def __init__(self, workdir: str):  # noqa: D107 - the worker's constructor runs in `setup`
        os.chdir(workdir)  # relative paths in the config resolve as they did for the driver

    def __getattr__(self, name: str):
        # reached only for attributes `setup` has not made yet (the worker's `__init__` has not run)
        raise NotSetUp(f"device worker process {os.getpid()} was restarted and is not set up yet (no {name!r})")

    def rendezvous(self) -> tuple[str, int]:
        return _rendezvous()

    def setup(self, spec: WorkerSpec, cfg_dict: dict, trainer_group: tuple[str, int] | None, use_gpu: bool) -> int:
        exit_without_teardown()  # the driver ends this process (`end_actors`); `close` leaves its group to that
        quiet_hf_libraries()
        super().__init__(spec, cfg_dict, trainer_group=trainer_group, cuda_index=0 if use_gpu else None)
        if self.cfg.runtime.phase_timeout_s > 0:
            enable_stack_dumps(self.cfg.run.output_dir, f"device-{spec.device}")
        return spec.device

    def flush_outputs(self) -> None:
        flush_outputs()


def worker_actor(worker: type) -> type:
    """The Ray actor class of a device worker class (`PolicyKind.worker`): the worker's methods, which a
    controller's `RayHandle` calls by name, and `RayWorker`'s set-up."""
    return type(f"{worker.__name__}Actor", (RayWorker, worker), {"__doc__": f"A `{worker.__name__}` as a Ray actor."})


class RayProcess:
    """An actor process that works in the driver's directory and can host a group's rank 0 (`rendezvous`)."""

    def __init__(self, workdir: str):
        os.chdir(workdir)  # relative paths in the config resolve as they did for the driver

    def rendezvous(self) -> tuple[str, int]:
        return _rendezvous()

    def flush_outputs(self) -> None:
        flush_outputs()


class ControllerActor(RayProcess):
    """One SPMD controller: its shard, and handles to the device workers of its slice."""

    def run(self, kind_name: str, rank: int, cfg_dict: dict, job_plan: Plan, group: tuple[str, int], workers: list,
            specs: list[WorkerSpec], use_gpu: bool):
        """Run controller `rank` of a job of kind `kind_name` over its slice's `workers` (one per spec); the ones
        that hold no trainer shard are revived in place when they die, if the job allows restarts."""
        import ray
        import torch

        from gcore_rl.controller.handles import RayHandle, results
        from gcore_rl.controller.worker_api import WorkerAPI
        from gcore_rl.distributed import init_process_group
        from gcore_rl.runtime.kinds import policy_kind

        quiet_hf_libraries()
        exit_without_teardown()  # the driver ends this process (`end_actors`); the group is left to that
        kind = policy_kind(kind_name)
        cfg = kind.read_config(cfg_dict)
        if cfg.runtime.phase_timeout_s > 0:
            enable_stack_dumps(cfg.run.output_dir, f"controller-{rank}")
        torch.set_num_threads(max(cfg.runtime.threads_per_process, 1))
        device = torch.device("cpu")  # controllers talk over gloo; tensors stay with the workers
        info = init_process_group(rank, cfg.runtime.controllers, group[1], device, group[0])

        def handle(worker, spec: WorkerSpec) -> RayHandle:
            if not _restarts_in_place(cfg, spec):
                return RayHandle(worker)
            return RayHandle(worker, setup=lambda actor: ray.get(actor.setup.remote(spec, cfg_dict, None, use_gpu)))

        def on_restart(device: int, step: int, cause: str, revive_s: float) -> None:
            record_device_restart(cfg.run.output_dir, rank, device, step, cause, revive_s)

        handles = [handle(w, s) for w, s in zip(workers, specs, strict=True)]
        try:
            return kind.controller(cfg, info, handles, specs, job_plan, on_restart, False)  # the driver takes SIGTERM
        finally:
            results([h.call(WorkerAPI.close) for h in handles])  # the process group stays: `end_actors` ends it


@contextlib.contextmanager
def ray_devices(address: str | None, bundle: dict, devices: int, strategy: str) -> Iterator:
    """Start (or join, at `address`) Ray and reserve one placement-group bundle per device; yields the group.

    On leaving, the group is removed and a Ray instance started here is shut down. Raises GcoreError
    when the cluster cannot give the bundles within 120 s.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    started_here = not ray.is_initialized()
    if started_here:
        if address:
            connect(address, log_to_driver=True)  # token auth, unreachable clusters: see ray_connect
        else:
            ray.init(num_cpus=os.cpu_count(), resources={DEVICE_RESOURCE: devices}, include_dashboard=False,
                     log_to_driver=True)
    group = placement_group([bundle] * devices, strategy="PACK")
    try:
        ready, _ = ray.wait([group.ready()], timeout=120)
        if not ready:
            raise GcoreError(f"Ray could not reserve {devices} bundles of {bundle} for the {strategy} plan "
                             f"within 120 s; the cluster has {ray.cluster_resources()}")
        yield group
    finally:
        remove_placement_group(group)
        if started_here:
            ray.shutdown()


def run_on_ray(cfg: Any, job_plan: Plan, kind: PolicyKind = LANGUAGE) -> Any:
    """Start (or join) Ray, place the workers of a job of `kind` and its controllers by the driver's plan, run,
    and always clean up.

    Raises `ProcessFailure` when an actor died, failed with an exception that is not a `GcoreError`,
    or the job hung; the `GcoreError` of an actor's own check is raised as such.
    """
    import ray

    specs = worker_specs(job_plan)
    use_gpu = cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and _cuda_available())
    watchdog = Watchdog(cfg.run.output_dir, cfg.runtime.phase_timeout_s) if cfg.runtime.phase_timeout_s > 0 else None
    bundle = {"GPU": 1} if use_gpu else {DEVICE_RESOURCE: 1}
    with ray_devices(cfg.runtime.ray_address, bundle, len(specs), job_plan.strategy) as group:
        actors: list = []
        try:
            workers, controllers = _start_actors(ray, cfg, job_plan, specs, group, use_gpu, kind)
            actors = workers + controllers
            first_trainer = next(w for w, s in zip(workers, specs, strict=True) if s.trainer_rank == 0)
            trainer_group = ray.get(first_trainer.rendezvous.remote())
            first_critic = next((w for w, s in zip(workers, specs, strict=True) if s.critic_rank == 0), None)
            critic_group = ray.get(first_critic.rendezvous.remote()) if first_critic is not None else None
            groups = [trainer_group if s.trainer_rank is not None else critic_group if s.critic_rank is not None else None
                      for s in specs]
            _wait_all(ray, [w.setup.remote(s, to_dict(cfg), group, use_gpu)
                            for w, s, group in zip(workers, specs, groups, strict=True)])
            controller_group = ray.get(controllers[0].rendezvous.remote())
            cfg_dict = to_dict(cfg)
            pending = []
            for rank, (controller, devs) in enumerate(zip(controllers, job_plan.slices, strict=True)):
                mine = [(w, s) for w, s in zip(workers, specs, strict=True) if s.device in devs]
                pending.append(controller.run.remote(kind.name, rank, cfg_dict, job_plan, controller_group, [w for w, _ in mine],
                                                     [s for _, s in mine], use_gpu))
            # SIGTERM comes to the driver: it asks the controllers by file, and exits 143 itself past the grace
            with PreemptionWatch(cfg.run.preempt_grace_s, cfg.run.output_dir,
                                 on_signal=lambda: request_preemption(cfg.run.output_dir)):
                _wait_all(ray, pending, watchdog)
            return ray.get(pending[0])
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, GcoreError):
                raise GcoreError(f"a controller or device worker failed on Ray:\n{exc}") from None
            raise ProcessFailure(f"a controller or device worker failed on Ray: {_first_line(exc.cause or exc)}\n{exc}") from None
        except ray.exceptions.RayActorError as exc:
            raise ProcessFailure(f"a controller or device worker process died on Ray (out of memory, a crash or a "
                                 f"lost node):\n{exc}") from None
        finally:
            end_actors(ray, actors)


def end_actors(ray, actors: list, flush_timeout_s: float = 2.0) -> None:
    """End every actor as a spawned controller ends (`distributed.end_process`): its output flushed, then
    the process killed (`ray.kill` runs no atexit handler, no interpreter finalisation and so no gloo
    teardown, which could abort it: `distributed.exit_without_teardown`). An actor that is dead or busy
    is killed without waiting for more than `flush_timeout_s` in all."""
    flushed = []
    for actor in actors:
        with contextlib.suppress(Exception):
            flushed.append(actor.flush_outputs.remote())
    if flushed:
        with contextlib.suppress(Exception):
            ray.wait(flushed, num_returns=len(flushed), timeout=flush_timeout_s)
    for actor in actors:
        ray.kill(actor)


def _start_actors(ray, cfg: Any, job_plan: Plan, specs: list[WorkerSpec], group, use_gpu: bool,
                  kind: PolicyKind) -> tuple[list, list]:
    """One worker actor per device in its bundle (Ray restarts those that may be revived in place),
    and one controller actor per slice in the bundle of the slice's first device."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def in_bundle(index: int, **options):
        return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                    runtime_env=_job_env(cfg), **options)

    worker_cls, controller_cls = ray.remote(worker_actor(kind.worker())), ray.remote(ControllerActor)
    device_res = {"num_gpus": 1} if use_gpu else {"resources": {DEVICE_RESOURCE: 1}}
    workers = [worker_cls.options(**in_bundle(s.device, num_cpus=0, **device_res),
                                  max_restarts=cfg.run.max_restarts if _restarts_in_place(cfg, s) else 0)
               .remote(os.getcwd()) for s in specs]
    controllers = [controller_cls.options(**in_bundle(devs[0], num_cpus=0)).remote(os.getcwd())
                   for devs in job_plan.slices]
    return workers, controllers


def _restarts_in_place(cfg: Any, spec: WorkerSpec) -> bool:
    """Whether the worker of `spec` is revived in place when it dies: it holds no trainer or critic shard
    (so no collective of the trainer or critic group breaks with it) and the job allows restarts."""
    return spec.group_rank is None and cfg.run.max_restarts > 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _job_env(cfg: Any) -> dict:
    """The environment the job's actors need beyond the cluster's own: a fault to inject, once per job
    (`faults.job_env`), if set."""
    env = fault_env(cfg.run.output_dir)
    return {"env_vars": env} if env else {}


SIGNAL_POLL_S = 0.2
"""How long the driver's wait on its Ray tasks blocks at most before a signal handler may run."""


def _wait_all(ray, pending: list, watchdog: Watchdog | None = None) -> None:
    """Wait for every task; the first failure is raised at once (the caller kills the rest). With a
    `watchdog`, a hang raises `ProcessFailure` (after the stacks are dumped). The wait returns to Python at least
    every `SIGNAL_POLL_S`, so a SIGTERM's handler (which runs only between bytecodes) asks the controllers to stop
    at once, not when the job has ended."""
    remaining = list(pending)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1, timeout=min(watchdog.poll_s, SIGNAL_POLL_S) if watchdog
                                   else SIGNAL_POLL_S)
        if done:
            ray.get(done)  # raises RayTaskError when that task failed
        elif watchdog is not None:
            watchdog.check()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

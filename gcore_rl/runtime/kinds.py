"""What the driver and the runtimes need to know of a job's policy kind, so that one driver and one set of
runtimes serve every kind.

A language or vision-language job (`JobConfig`) and a diffusion job (`FlowGrpoJobConfig`, recipes with
``kind: flow_grpo``) go through the same driver (`runtime/driver.py`: the checks before any process starts,
the run folder, restarts from the newest checkpoint after a lost process, the summary, the environment record
and the run report) and the same runtimes (`runtime/local.py`: K controller processes; `runtime/ray_runtime.py`:
a placement group, one actor per device and per controller, failures). What differs is a `PolicyKind`:

- `prepare(cfg)`: the kind's checks before any process starts, and the job's placement plan;
- `resume`: how a resumed job is compared with the one that saved its checkpoint (`runtime.resume.JobKind`);
- `worker()`: the class of a device's worker, built as ``worker(spec, cfg_dict, trainer_group, cuda_index)``
  (`DeviceWorker`, or a diffusion job's `ImageDeviceWorker`);
- `controller(cfg, info, handles, specs, plan, on_restart, handles_signals)`: one controller's program over the
  handles to its slice's workers; it returns the run's summary (a dataclass, written as ``summary.json``).

Kinds are looked up by name (`policy_kind`), so a process started by a runtime is told the name, not sent
functions. Everything a kind imports is imported when it is used: a language job never imports `diffusers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gcore_rl.configlib import from_dict, load_config
from gcore_rl.controller.handles import WorkerHandle
from gcore_rl.distributed import DistInfo
from gcore_rl.placement.plan import Plan, WorkerSpec
from gcore_rl.runtime.resume import JobKind

OnRestart = Callable[[int, int, str, float], None]
"""Told of each device revived in place: (device, step, cause, seconds from its loss to its return)."""


@dataclass(frozen=True)
class PolicyKind:
    """One kind of policy, as the driver and the runtimes see it (see the module docstring)."""

    name: str
    config: Callable[[], type]
    prepare: Callable[[Any], Plan]
    resume: JobKind
    worker: Callable[[], type]
    controller: Callable[[Any, DistInfo, Sequence[WorkerHandle], Sequence[WorkerSpec], Plan, OnRestart | None, bool], Any]

    def read_config(self, cfg_dict: dict) -> Any:
        """The job's config from the plain dict a runtime ships to its processes."""
        return from_dict(self.config(), cfg_dict)


# ---- language and vision-language policies --------------------------------------------------------


def _language_config() -> type:
    from gcore_rl.config import JobConfig

    return JobConfig


def _language_prepare(cfg: Any) -> Plan:
    from gcore_rl.runtime.driver import check_language_job

    return check_language_job(cfg)


def _device_worker() -> type:
    from gcore_rl.runtime.device_worker import DeviceWorker

    return DeviceWorker


def _language_controller(cfg: Any, info: DistInfo, handles: Sequence[WorkerHandle], specs: Sequence[WorkerSpec],
                         job_plan: Plan, on_restart: OnRestart | None, handles_signals: bool) -> Any:
    """The step loop (`controller.loop.run_controller`) over a `SliceClient` of the handles, with a language policy's
    samples."""
    from gcore_rl.controller.program import ControllerContext
    from gcore_rl.controller.slice import SliceClient
    from gcore_rl.data.balance import SequenceCost
    from gcore_rl.models.loading import load_tokenizer, read_model_config

    client = SliceClient(handles, specs, job_plan, on_restart=on_restart,
                         row_cost=SequenceCost.from_config(read_model_config(cfg.model.path)),
                         sequence_parallel=cfg.train.sequence_parallel,
                         bucket_bytes=max(1, int(cfg.runtime.weight_bucket_mib * 2**20)))
    return _run_loop(cfg, info, ControllerContext.for_job(cfg, client, load_tokenizer(cfg.model.path)), handles_signals)


def _run_loop(cfg: Any, info: DistInfo, ctx: Any, handles_signals: bool) -> Any:
    from gcore_rl.controller.loop import run_controller

    with ctx.rewards:  # stops the reward pool's processes on every way out
        return run_controller(cfg, info, ctx, handles_signals)


LANGUAGE = PolicyKind(name="language", config=_language_config, prepare=_language_prepare, resume=JobKind(),
                      worker=_device_worker, controller=_language_controller)


# ---- diffusion policies (Flow-GRPO) -----------------------------------------------------------------


def _flow_config() -> type:
    from gcore_rl.diffusion.config import FlowGrpoJobConfig

    return FlowGrpoJobConfig


def _flow_prepare(cfg: Any) -> Plan:
    """A diffusion job's checks beyond its config's own (the devices there are, LoRA's targets in the
    transformer), and its plan."""
    from gcore_rl.config import check_devices
    from gcore_rl.diffusion.config import flow_plan
    from gcore_rl.models.flow import transformer_skeleton
    from gcore_rl.models.lora import apply_lora

    check_devices(cfg.runtime)
    if cfg.model.lora.enabled:  # ConfigError naming model.lora.target_modules when they match nothing
        apply_lora(transformer_skeleton(cfg.model.path), cfg.model.lora)
    return flow_plan(cfg)


def _flow_frozen(cfg: Any) -> dict[str, str]:
    return cfg.frozen_model_paths


def _flow_worker() -> type:
    from gcore_rl.runtime.image_worker import ImageDeviceWorker

    return ImageDeviceWorker


def _flow_controller(cfg: Any, info: DistInfo, handles: Sequence[WorkerHandle], specs: Sequence[WorkerSpec],
                     job_plan: Plan, on_restart: OnRestart | None, handles_signals: bool) -> Any:
    """The step loop (`controller.loop.run_controller`) over a `SliceClient` of the handles, with a diffusion policy's
    samples (`diffusion.samples.ImageSamples`)."""
    from gcore_rl.config import model_reward_weights
    from gcore_rl.controller.program import ControllerContext
    from gcore_rl.controller.slice import SliceClient
    from gcore_rl.diffusion.samples import ImageSamples
    from gcore_rl.rewards.rule import RuleRewards

    client = SliceClient(handles, specs, job_plan, on_restart=on_restart,
                         bucket_bytes=max(1, int(cfg.runtime.weight_bucket_mib * 2**20)))
    ctx = ControllerContext(workers=client, rewards=RuleRewards(cfg.reward), tokenizer=None,
                            reward_model_weights=model_reward_weights(cfg), samples=ImageSamples())
    return _run_loop(cfg, info, ctx, handles_signals)


FLOW = PolicyKind(
    name="flow_grpo", config=_flow_config, prepare=_flow_prepare,
    resume=JobKind(load=lambda path: load_config(_flow_config(), str(path), []),
                   fixed_keys=("model", "sampling", "algo", "train", "reward", "reward_model", "judge", "data", "run.seed",
                               "run.prompts_per_step"),
                   frozen=_flow_frozen),
    worker=_flow_worker, controller=_flow_controller)
"""A diffusion job."""

POLICY_KINDS: dict[str, PolicyKind] = {kind.name: kind for kind in (LANGUAGE, FLOW)}


def policy_kind(name: str) -> PolicyKind:
    """The kind registered as `name` (KeyError naming the known ones otherwise)."""
    if name not in POLICY_KINDS:
        raise KeyError(f"no policy kind {name!r}; known: {', '.join(POLICY_KINDS)}")
    return POLICY_KINDS[name]


def kind_of(cfg: Any) -> PolicyKind:
    """The kind of a loaded job config: its ``kind`` field (a diffusion job's ``flow_grpo``), else a language job."""
    return policy_kind(getattr(cfg, "kind", LANGUAGE.name))

"""The driver of a job, for every runtime: check what can be checked, build the plan once, start the
controllers on the configured runtime, and write the run's summary.

The driver never holds prompt data: each controller reads its own shard. It ships the plan (a small
frozen dataclass) to the processes that need it instead of having each rebuild it from the config.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gcore_rl.config import JobConfig, build_plan, check_devices, prompt_room
from gcore_rl.configlib import dump_yaml
from gcore_rl.controller.forecast import RolloutForecaster
from gcore_rl.controller.preemption import clear_preemption
from gcore_rl.controller.token_samples import RunSummary
from gcore_rl.data.chat import resolve_chat_template
from gcore_rl.errors import ConfigError, ProcessFailure
from gcore_rl.faults import marker_path, maybe_fail
from gcore_rl.models.loading import check_model_dir, load_tokenizer, read_model_config
from gcore_rl.models.lora import check_lora_targets
from gcore_rl.models.value import value_source
from gcore_rl.models.vision import is_vision_config
from gcore_rl.placement.plan import Plan, worker_specs
from gcore_rl.report.environment import record_environment
from gcore_rl.report.run_report import draw_run_report
from gcore_rl.rewards.kinds import enabled_kinds
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.rollout.backends import APPLIES_ADAPTERS, engine_builder
from gcore_rl.rollout.functions import check_rollout
from gcore_rl.runtime.healing import failure_key, record_restart, record_training_again, restart_config
from gcore_rl.runtime.kinds import PolicyKind, kind_of
from gcore_rl.runtime.resume import take_up
from gcore_rl.training.sequence_parallel import check_divides

__all__ = ["RunSummary", "check_language_job", "prepare_run_dir", "run_job"]


def run_job(cfg: Any, on_ready: Callable[[Any], None] | None = None) -> Any:
    """Run a whole job (of any policy kind, `runtime/kinds.py`) on the configured runtime and return its summary
    (GcoreError on bad input).

    `on_ready(cfg)` is called once, when the run directory is prepared and every input checked, before
    any process starts (the CLI says there where the outputs go).

    When a process of the job dies or the job hangs (`ProcessFailure`), the job starts again from its
    newest complete checkpoint, up to `run.max_restarts` times (see runtime/healing.py); any other
    error ends it. The summary is also written to the run directory as `summary.json`, and the run's
    HTML report as `report.html`.
    """
    marker_path(cfg.run.output_dir).unlink(missing_ok=True)  # an injected fault fires once per job, not per run_job
    kind = kind_of(cfg)
    attempt = cfg
    last_failure: tuple[int, str] | None = None
    for restarts in itertools.count():
        attempt, job_plan = prepare_run_dir(attempt, kind)
        if restarts == 0 and on_ready is not None:
            on_ready(attempt)
        maybe_fail("driver", 0)
        try:
            summary = _run_runtime(attempt, job_plan, kind)
            break
        except ProcessFailure as failure:
            if restarts:
                record_training_again(cfg.run.output_dir)
            if restarts == cfg.run.max_restarts:
                raise
            key = failure_key(cfg.run.output_dir, failure)
            if key == last_failure:
                raise ProcessFailure(f"{failure}\nThe job failed the same way in step {key[0]} before its last restart, so "
                                     "another restart would repeat it; it stops here (run.resume=auto continues from the "
                                     "newest complete checkpoint once the cause is fixed).") from None
            last_failure = key
            record_restart(cfg.run.output_dir, restarts + 1, cfg.run.max_restarts, failure)
            attempt = restart_config(cfg)
    if restarts:
        record_training_again(cfg.run.output_dir)
    (Path(cfg.run.output_dir) / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    draw_run_report(cfg.run.output_dir)
    return summary


def _run_runtime(cfg: Any, job_plan: Plan, kind: PolicyKind) -> Any:
    if cfg.runtime.kind == "ray":
        from gcore_rl.runtime.ray_runtime import run_on_ray

        return run_on_ray(cfg, job_plan, kind)
    from gcore_rl.runtime.local import run_local

    return run_local(cfg, job_plan, kind)


def check_vision_policy(cfg: JobConfig, job_plan: Plan) -> None:
    """ConfigError for what a vision-language policy cannot do yet: a critic (the value model is a text
    model's), a reference on devices of its own (`interleave`: it receives completions without
    their prompts' images), and generation by vLLM (token ids are sent without images)."""
    if not is_vision_config(read_model_config(cfg.model.path)):
        return
    if cfg.algo.uses_critic:
        raise ConfigError("algo.advantage", f"'{cfg.algo.advantage}' needs a critic, and the policy "
                          f"'{cfg.model.path}' is a vision-language model, for which no critic is built yet; use a "
                          "critic-free estimator (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, remax)")
    if job_plan.traits.reference_in_rollout:
        raise ConfigError("placement.strategy", f"'{cfg.placement.strategy}' computes reference log-probs on devices "
                          "of their own, which do not get the prompts' images; with a vision-language policy use "
                          "colocate, partial, dynamic or disaggregated")
    if cfg.engine.backend == "vllm":
        raise ConfigError("engine.backend", f"the policy '{cfg.model.path}' is a vision-language model, and the vllm "
                          "backend sends prompts as token ids without their images (vLLM takes images only through "
                          "its own image processing, not wired yet: docs/engines.md); use engine.backend=builtin")


def check_sequence_parallel(cfg: JobConfig, job_plan: Plan) -> None:
    """ConfigError when `train.sequence_parallel` cannot split this job's passes: a degree that does not
    divide the policy's heads or each slice's trainer devices, a vision-language policy, or a critic."""
    degree = cfg.train.sequence_parallel
    if degree == 1:
        return
    config = read_model_config(cfg.model.path)
    try:
        check_divides(config, degree)
    except ValueError as exc:
        raise ConfigError("train.sequence_parallel", f"{exc} (policy '{cfg.model.path}')") from None
    trainers = set(job_plan.devices_of("update", "actor"))
    per_slice = [len(trainers.intersection(devices)) for devices in job_plan.slices]
    if any(count % degree for count in per_slice):
        raise ConfigError("train.sequence_parallel", f"{degree} must divide the trainer devices of every slice, and "
                          f"the '{cfg.placement.strategy}' plan gives the slices {per_slice}: a group of trainers "
                          "shares each pass within one slice (the local runtime has one device per controller; "
                          "use runtime.kind=ray with runtime.devices a multiple of the degree per controller)")
    if is_vision_config(config):
        raise ConfigError("train.sequence_parallel", f"the policy '{cfg.model.path}' is a vision-language model; "
                          "sequence parallelism splits text-only passes")
    if cfg.algo.uses_critic:
        raise ConfigError("train.sequence_parallel", f"algo.advantage='{cfg.algo.advantage}' trains a critic, whose "
                          "value passes are not split yet; use a critic-free estimator or train.sequence_parallel=1")


def check_lora(cfg: JobConfig) -> None:
    """ConfigError when LoRA's target modules match nothing in the policy (or the critic), or the policy's adapters
    alone are to be synced to an engine backend that cannot apply them."""
    check_lora_targets(cfg.model.path, cfg.model.lora)
    if cfg.algo.uses_critic:
        check_lora_targets(cfg.critic.model_path or cfg.model.path, cfg.critic.lora, critic=True)
    if cfg.model.lora.enabled and cfg.model.lora.sync == "adapters" and cfg.engine.backend not in APPLIES_ADAPTERS:
        raise ConfigError("model.lora.sync", f"engine.backend='{cfg.engine.backend}' does not apply LoRA adapters "
                          f"itself (those that do: {', '.join(sorted(APPLIES_ADAPTERS))}); use model.lora.sync=merged")


def check_engine_environments(cfg: JobConfig) -> None:
    """ConfigError when a role's engine backend runs in an environment of its own (vLLM) that is missing or
    cannot import it: said before any process starts, not by each device worker as it builds its engine."""
    from gcore_rl.rollout.vllm_server import vllm_missing

    engines = {"engine": cfg.engine, **{f"{kind.name}.engine": kind.engine(cfg) for kind in enabled_kinds(cfg)
                                        if kind.engine is not None}}
    for key, engine in engines.items():
        if engine.backend == "vllm":
            problem = vllm_missing(engine.vllm)
            if problem is not None:
                raise ConfigError(f"{key}.vllm.python", problem)


def check_offload(cfg: JobConfig, job_plan: Plan) -> None:
    """ConfigError when `train.offload` is on but no trainer shares its device with another role: there is no
    one to free the memory for (`disaggregated`: the trainers never generate)."""
    if cfg.train.offload == "none":
        return
    if not cfg.runtime.time_share:
        raise ConfigError("train.offload", "runtime.time_share=false keeps every model resident on its device, so "
                          "no role would use the memory the trainer's state frees; use train.offload=none, or "
                          "runtime.time_share=true to let the roles take turns")
    if not any(spec.time_share and spec.group_rank is not None for spec in worker_specs(job_plan)):
        raise ConfigError("train.offload", f"placement.strategy={cfg.placement.strategy} keeps every trainer on "
                          "devices of its own, so moving its state off the device frees memory for no other role; "
                          "use train.offload=none, or a strategy whose trainers also generate or score (colocate, "
                          "partial, interleave, dynamic)")


def check_language_job(cfg: JobConfig) -> Plan:
    """Check what a language or vision-language job's processes would find wrong only later (model and reference
    folders, the tokenizer and chat template, rewards, the rollout function, engines, LoRA, offload, sequence
    parallelism, the forecast's inputs); its plan (built here, once). The prompt data is read only by the
    controllers: the driver never holds it."""
    job_plan = build_plan(cfg)
    check_devices(cfg.runtime)
    tokenizer = load_tokenizer(cfg.model.path)
    if cfg.data.chat_template is not None:  # as the device workers render turns
        tokenizer.chat_template = resolve_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path)
    prompt_room(cfg).budget()  # ConfigError when sampling.max_new_tokens fills the context
    check_vision_policy(cfg, job_plan)
    check_lora(cfg)
    check_engine_environments(cfg)
    check_offload(cfg, job_plan)
    check_sequence_parallel(cfg, job_plan)
    if cfg.reference_path:
        check_model_dir(cfg.reference_path)
    if cfg.algo.uses_critic:  # a causal LM, a scalar reward model or a saved critic (ModelLoadError otherwise)
        value_source(cfg.critic.model_path or cfg.model.path)
    for kind in enabled_kinds(cfg):  # its model folder and, for a judge, its engine's backend
        kind.check(cfg)
    RuleRewards(cfg.reward)
    check_rollout(cfg.rollout, tokenizer)
    engine_builder(cfg.engine)
    if job_plan.traits.rebalances:  # reads the models' configs, the forecast's hardware preset and cost constants
        RolloutForecaster.from_config(cfg, len(job_plan.slices[0]))
    return job_plan


def prepare_run_dir(cfg: Any, kind: PolicyKind | None = None) -> tuple[Any, Plan]:
    """Check everything that can be checked before processes start (`kind.prepare`), choose the checkpoint to
    resume from, write the resolved config, and return the job as the controllers run it (`run.resume`
    resolved to a checked checkpoint folder or None) with its plan (built here, once)."""
    kind = kind or kind_of(cfg)
    job_plan = kind.prepare(cfg)
    out = Path(cfg.run.output_dir)
    cfg = take_up(cfg, kind.resume)
    out.mkdir(parents=True, exist_ok=True)
    clear_preemption(out)  # a run resumed after a preemption starts without the request that stopped it
    dump_yaml(cfg, out / "config.yaml")
    record_environment(out)
    return cfg, job_plan

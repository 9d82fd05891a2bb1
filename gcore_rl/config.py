"""The job's typed configuration: one dataclass tree, loaded from a YAML recipe plus overrides.

Each component keeps its own config next to its code; this module only composes them. Run
`gcore-rl config-reference` for every key with its type, default and meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig
from gcore_rl.algos.registry import check_advantage_inputs
from gcore_rl.checkpoint.adapters import BASE_ROLE, CRITIC_BASE_ROLE
from gcore_rl.configlib import load_config
from gcore_rl.data.config import RolloutDataConfig
from gcore_rl.data.indexed import is_environment_task
from gcore_rl.data.lengths import PromptRoom
from gcore_rl.errors import ConfigError
from gcore_rl.models.loading import ModelConfig, context_limit
from gcore_rl.placement.plan import BASE_ROLES, STRATEGY_TRAITS, PlacementConfig, Plan, plan
from gcore_rl.rewards.ecosystem import task_scorer
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.kinds import enabled_kinds, reward_kinds
from gcore_rl.rewards.reward_model import GROUP_SOFTMAX, RewardModelConfig
from gcore_rl.rewards.rule import RewardConfig, default_rules
from gcore_rl.rollout.backends import EngineConfig
from gcore_rl.rollout.functions import SINGLE_TURN, RolloutConfig
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.telemetry.health import HealthConfig
from gcore_rl.telemetry.loggers import check_loggers, default_loggers
from gcore_rl.training.actor import TrainConfig
from gcore_rl.training.critic import CriticConfig


@dataclass
class SharedRunSettings:
    """The part of a run section that every policy kind's job shares (a language job's `RunConfig`, a diffusion
    job's `FlowRunConfig`): when a run saves checkpoints, where and how, what it resumes from, how often the driver
    restarts it from them (`controller/checkpointing.py`, `runtime/healing.py`), when an update is unhealthy
    (`telemetry/health.py`), how often the run report is drawn, and how a preempted run stops
    (`controller/preemption.py`)."""

    checkpoint_every: int = field(default=0, metadata={"help": "Save a checkpoint (trainer state, data position, dynamic-sampling and placement state, batches in flight) after every this many steps (0 = never). Staged to host memory; the files are written while training goes on (see checkpoint_write)."})
    checkpoint_dir: str | None = field(default=None, metadata={"help": "Folder of the run's checkpoints (None = OUTPUT_DIR/checkpoints)."})
    checkpoint_write: Literal["auto", "background", "blocking"] = field(default="auto", metadata={"help": "How a trainer writes its staged checkpoint shards: 'background' (a writer thread, while training goes on), 'blocking' (before the step ends), 'auto' (blocking when the trainer state, all ranks together, is under 64 MiB; background otherwise)."})
    keep_checkpoints: int = field(default=2, metadata={"help": "Complete checkpoints to keep; older ones are deleted after each save (>= 1)."})
    resume: str | None = field(default=None, metadata={"help": "'auto': continue from the newest complete checkpoint in checkpoint_dir (a fresh start when there is none); a checkpoint folder's path: continue from it; None: start fresh."})
    max_restarts: int = field(default=0, metadata={"help": "Times the driver restarts the job from its newest complete checkpoint after a process died or runtime.phase_timeout_s detected a hang, never after a config, data, reward, model or checkpoint error (0 = never; a single local controller cannot be restarted); logged in OUTPUT_DIR/restarts.jsonl. On Ray, each device without a trainer shard may also be restarted in place this many times."})
    health: HealthConfig = field(default_factory=HealthConfig, metadata={"help": "Thresholds of an unhealthy update (KL to the sampling policy, clip fraction, entropy collapse, gradient-norm spike, reward or held-out accuracy falling below the start): a step past one is listed at the top of the run report and the first of each kind is printed as a warning."})
    report_every: int = field(default=0, metadata={"help": "Also write the HTML run report (OUTPUT_DIR/report.html, `gcore-rl report`) after every this many steps (0 = only at the end of the run, which always writes it)."})
    preempt_grace_s: float = field(default=25.0, metadata={"help": "After SIGTERM (a scheduler's preemption), the run stops at the next step boundary with a complete checkpoint and exits 143; if that checkpoint is not complete this many seconds after the signal, it exits 143 at once without one (Slurm's and Kubernetes' default grace before SIGKILL is 30 s)."})

    def validate_shared(self) -> None:
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints", f"must be at least 1, got {self.keep_checkpoints}")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.report_every < 0:
            raise ConfigError("report_every", f"must be >= 0, got {self.report_every}")
        if not self.preempt_grace_s > 0:
            raise ConfigError("preempt_grace_s", f"must be > 0, got {self.preempt_grace_s}")


@dataclass
class RunConfig(SharedRunSettings):
    """Length of the run and where its outputs go."""

    output_dir: str = field(default="runs/grpo", metadata={"help": "Run directory: resolved config, metrics.jsonl, final model."})
    steps: int = field(default=40, metadata={"help": "RL steps (generate → reward → prepare → train → sync)."})
    prompts_per_step: int = field(default=16, metadata={"help": "Prompts per step over all controllers (each yields sampling.n completions)."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling and data order."})
    eval_every: int = field(default=10, metadata={"help": "Greedy accuracy on the data.eval_prompts held-out prompts every this many steps (0 = only before and after)."})
    stop_at_eval_accuracy: float = field(default=0.0, metadata={"help": "End the run after the evaluation at which held-out greedy accuracy reaches this (0 = run all `steps`, which is then the cap)."})
    save_final: bool = field(default=True, metadata={"help": "Write the final policy to OUTPUT_DIR/final with save_pretrained (safetensors)."})
    progress: bool = field(default=True, metadata={"help": "Show a rich progress bar (plain lines when not on a terminal)."})
    samples_per_step: int = field(default=4, metadata={"help": "Completions (prompt, completion, reward) of each step written to OUTPUT_DIR/samples.jsonl for the report, from controller 0's first groups (0 = none)."})
    loggers: list[str] = field(default_factory=default_loggers, metadata={"help": "Where step metrics go, under the same names in each: 'jsonl' (OUTPUT_DIR/metrics.jsonl, always written; resume, `gcore-rl report` and the simulator read it), 'tensorboard' (OUTPUT_DIR/tensorboard), 'wandb' (offline in OUTPUT_DIR/wandb unless WANDB_MODE says otherwise), 'mlflow' (file store OUTPUT_DIR/mlruns unless MLFLOW_TRACKING_URI is set). The last three need `pip install 'gcore-rl[NAME]'`."})

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        self.validate_shared()
        if self.eval_every < 0:
            raise ConfigError("eval_every", f"must be >= 0, got {self.eval_every}")
        if self.samples_per_step < 0:
            raise ConfigError("samples_per_step", f"must be >= 0, got {self.samples_per_step}")
        if not 0.0 <= self.stop_at_eval_accuracy <= 1.0:
            raise ConfigError("stop_at_eval_accuracy", f"must be in [0, 1], got {self.stop_at_eval_accuracy}")
        check_loggers(self.loggers)
        if self.stop_at_eval_accuracy > 0 and self.eval_every == 0:
            raise ConfigError("stop_at_eval_accuracy", "needs evaluations during the run: set run.eval_every > 0")


@dataclass
class RuntimeConfig:
    """Which processes run the job."""

    kind: Literal["local", "ray"] = field(default="local", metadata={"help": "'local': SPMD controller processes on this machine, one device each (1 = everything in this process); 'ray': controllers and one worker per device as Ray actors in a placement group."})
    controllers: int = field(default=1, metadata={"help": "K SPMD controllers, each with its prompt shard and device slice."})
    devices_per_controller: int = field(default=1, metadata={"help": "Devices in each controller's slice (ray runtime; the local runtime has one device per controller)."})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "'auto' uses CUDA when present (one GPU per device worker), else CPU (devices are then logical slots)."})
    ray_address: str | None = field(default=None, metadata={"help": "Ray: address of an existing cluster ('auto' or HOST:PORT from `ray start --head`); None starts a local Ray instance."})
    time_share: bool = field(default=True, metadata={"help": "Where roles share a device (colocate and kin), each model gives the device up while another role works: the engine sleeps through the update (and train.offload moves the trainer's state off). false keeps every model resident: no swaps, and an engine's CUDA graphs are captured once instead of after each wake, where the device holds them all."})
    threads_per_process: int = field(default=0, metadata={"help": "torch intra-op threads per process (0 = CPU cores divided by processes)."})
    weight_bucket_mib: float = field(default=64.0, metadata={"help": "Where trainers publish the new weights to generation devices that hold no trainer (disaggregated, or critic devices that also generate): buckets of about this many MiB go through the object store, at most two in flight (verl's update_weights_bucket_megabytes)."})
    phase_timeout_s: float = field(default=0.0, metadata={"help": "Hang detection, in seconds (0 = off; Ray, and local with controllers >= 2): when no phase of any device worker has ended for this long, every process writes its threads' stacks to OUTPUT_DIR/stacks/<process>.txt and the job fails as hung (restarted if run.max_restarts allows). The watch begins when the first phase ends. Must exceed the longest phase."})

    @property
    def devices(self) -> int:
        return self.controllers * self.devices_per_controller

    def validate(self) -> None:
        for key in ("controllers", "devices_per_controller"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not self.weight_bucket_mib > 0:
            raise ConfigError("weight_bucket_mib", f"must be > 0 (MiB per published bucket), got {self.weight_bucket_mib}")
        if self.phase_timeout_s < 0:
            raise ConfigError("phase_timeout_s", f"must be >= 0 (0 = no hang detection), got {self.phase_timeout_s}")
        if self.kind == "local" and self.devices_per_controller != 1:
            raise ConfigError("devices_per_controller", "the local runtime gives each controller one device; "
                              "use runtime.kind=ray for slices of several devices")


@dataclass
class JobConfig:
    """A whole GRPO job."""

    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Length and outputs."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The policy to train."})
    reference_path: str | None = field(default=None, metadata={"help": "Reference model for the KL term (None = the initial policy, model.path)."})
    data: RolloutDataConfig = field(default_factory=RolloutDataConfig, metadata={"help": "Prompts."})
    sampling: SamplingConfig = field(default_factory=SamplingConfig, metadata={"help": "Rollout sampling."})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "The policy's generation engine: its backend and capacity."})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "The rollout function that turns each prompt into samples beside the engine (single-turn by default)."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "Reward functions."})
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig, metadata={"help": "DAPO dynamic sampling: waves until enough groups have differing rewards."})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "Generative reward model (LLM judge); its normalised verdict is added to the rule rewards with judge.weight."})
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig, metadata={"help": "Scalar reward model (sequence-classification head); its transformed score is added to the rewards with reward_model.weight."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"help": "Policy-gradient objective."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimiser and batching."})
    critic: CriticConfig = field(default_factory=CriticConfig, metadata={"help": "PPO's value model, trained next to the actor when algo.advantage=gae (ignored otherwise)."})
    placement: PlacementConfig = field(default_factory=PlacementConfig, metadata={"help": "Role placement."})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"help": "Processes and devices."})

    def validate(self) -> None:
        if self.run.prompts_per_step % self.runtime.controllers:
            raise ConfigError("run.prompts_per_step", f"{self.run.prompts_per_step} prompts cannot be split evenly "
                              f"over runtime.controllers={self.runtime.controllers} controllers")
        if self.run.stop_at_eval_accuracy > 0 and (not self.data.task or self.data.eval_prompts == 0):
            raise ConfigError("run.stop_at_eval_accuracy", "needs held-out evaluation: a built-in data.task with "
                              "data.eval_prompts > 0 (a prompt file has no held-out split); without one set run.stop_at_eval_accuracy=0 "
                              "to run all run.steps")
        if is_environment_task(self.data.task) and self.rollout.function == SINGLE_TURN:
            raise ConfigError("rollout.function", f"data.task={self.data.task} opens environment episodes, and the "
                              "default rollout function generates one turn without playing them; set "
                              f"rollout.function={ENV_TURNS}")
        if not self.reward.rules and not enabled_kinds(self) and self.rollout.function == SINGLE_TURN:
            raise ConfigError("reward.rules", f"is empty, and no judge, reward model or environment (rollout.function="
                              f"{ENV_TURNS}) gives a reward either; name at least one reward")
        if self.reward_model.enabled and self.reward_model.transform == GROUP_SOFTMAX:
            if self.sampling.n < 2:
                raise ConfigError("reward_model.transform", "group_softmax ranks each prompt's samples against each "
                                  "other, and sampling.n=1 gives one per prompt (its reward would always be 1); use "
                                  "sampling.n >= 2, or transform sigmoid")
            if self.algo.greedy_baseline:
                raise ConfigError("reward_model.transform", f"group_softmax ranks each prompt's samples against each "
                                  f"other, and algo.advantage={self.algo.advantage}'s baseline is one greedy "
                                  "completion rewarded alone (always 1); use transform sigmoid, or another estimator")
        if self.reward.overlong_buffer >= self.sampling.max_new_tokens:
            raise ConfigError("reward.overlong_buffer", f"{self.reward.overlong_buffer} tokens leave no room before the "
                              f"penalty starts: the buffer must be shorter than sampling.max_new_tokens="
                              f"{self.sampling.max_new_tokens} (DAPO's L_cache < L_max)")
        if self.critic != CriticConfig() and not self.algo.uses_critic:
            changed = next(f.name for f in fields(CriticConfig) if getattr(self.critic, f.name) != getattr(CriticConfig(), f.name))
            raise ConfigError(f"critic.{changed}", f"configures PPO's value model, and algo.advantage="
                              f"{self.algo.advantage} trains none: set algo.advantage=gae, or remove the critic section")
        if self.algo.uses_critic and self.critic.actor_freeze_steps >= self.run.steps:
            raise ConfigError("critic.actor_freeze_steps", f"{self.critic.actor_freeze_steps} warm-up steps leave the actor "
                              f"untrained in a run of run.steps={self.run.steps}; use fewer")
        if self.placement.critic_devices and self.algo.uses_critic and self.algo.kl_in_reward:
            raise ConfigError("placement.critic_devices", "a critic on devices of its own computes its returns from "
                              "the outcome rewards and its values, and algo.kl_in_reward would also need every "
                              "token's KL, which only the actor's devices have; set algo.kl_in_reward=false (the KL "
                              "then goes into the loss, algo.kl_coef) or critic_devices=0")
        # the rollout adds a greedy completion per prompt whenever the estimator needs its reward (ReMax)
        check_advantage_inputs(self.algo.advantage, self.sampling.n,
                               provided=frozenset({"greedy_rewards", *(["values"] if self.algo.uses_critic else [])}))
        if self.algo.advantage.startswith("reinforce_pp") and self.runtime.controllers > 1:
            raise ConfigError("algo.advantage", f"{self.algo.advantage} whitens advantages over the step's whole batch, "
                              f"and with runtime.controllers={self.runtime.controllers} each controller holds only its "
                              "share (the statistics are not all-reduced yet), so training would depend on the number "
                              "of controllers; use runtime.controllers=1, or grpo / rloo, whose statistics are per group")
        roles = [*BASE_ROLES, *reward_kinds()]
        for role in self.placement.min_devices:
            if role not in roles:
                raise ConfigError(f"placement.min_devices.{role}", f"unknown role; known roles are {', '.join(roles)}")
        if self.runtime.kind == "local" and STRATEGY_TRAITS[self.placement.strategy].splits_slice:
            raise ConfigError("placement.strategy", f"'{self.placement.strategy}' puts roles on separate devices of a "
                              "slice; the local runtime has one device per controller, so use runtime.kind=ray "
                              "with runtime.devices_per_controller >= 2")


def check_devices(runtime: RuntimeConfig) -> None:
    """Raise ConfigError when `runtime.device` asks for more CUDA devices than this machine has.

    For the driver, before any process starts: the local runtime's processes run on this machine,
    and so does a Ray instance the job starts itself. On an existing Ray cluster
    (`runtime.ray_address`) the driver's machine may have no GPU while the nodes do, so there the
    placement group's reservation says what is missing. Not part of `validate`, which also runs in
    controllers that hold no device.
    """
    if runtime.device == "cpu" or (runtime.kind == "ray" and runtime.ray_address):
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if runtime.device == "auto" and available == 0:
        return
    if available == 0:
        build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise ConfigError("runtime.device", f"is 'cuda', but this machine has no usable CUDA device ({build}, "
                          "torch.cuda.is_available() is False); use runtime.device=cpu, or auto to take CUDA "
                          "only where it is present")
    if available < runtime.devices:
        raise ConfigError("runtime.device", f"the job needs {runtime.devices} CUDA devices (runtime.controllers × "
                          f"runtime.devices_per_controller) but this machine has {available}; use fewer "
                          "controllers or runtime.device=cpu")


def prompt_room(cfg: JobConfig) -> PromptRoom:
    """Room for prompts in the policy's context (reads the model's config.json; ModelLoadError if it cannot): the
    model's, the trainer's token budget per pass, or the vLLM server's longest sequence, whichever is smallest."""
    return PromptRoom(context_limit(cfg.model.path), cfg.sampling.max_new_tokens, cfg.model.path,
                      token_budget=cfg.train.max_tokens_per_micro_batch, engine_limit=vllm_context(cfg.engine))


def engine_context(cfg: JobConfig) -> int | None:
    """The longest sequence (prompt + completion) the policy's engine takes: the model's, or the vLLM server's
    `engine.vllm.max_model_len` when smaller (None: no known limit). What a rollout function generates up to."""
    limits = [limit for limit in (context_limit(cfg.model.path), vllm_context(cfg.engine)) if limit]
    return min(limits) if limits else None


def vllm_context(engine: EngineConfig) -> int:
    """`engine.vllm.max_model_len` of a vLLM engine (0: the model's own limit, or not a vLLM engine)."""
    return engine.vllm.max_model_len if engine.backend == "vllm" else 0


def plan_roles(cfg: JobConfig) -> list[str]:
    """The roles a job needs, as `placement.plan` names them."""
    return (["actor", "rollout"] + (["reference"] if cfg.algo.uses_reference else [])
            + (["critic"] if cfg.algo.uses_critic else []) + [kind.name for kind in enabled_kinds(cfg)])


ENV_TURNS = "gcore_rl.agents.env_turns:env_turns"


def model_reward_weights(cfg: JobConfig) -> dict[str, float]:
    """Weight of each enabled model reward kind (``judge``, ``reward_model``, a registered kind) in a sample's reward."""
    return {kind.name: float(kind.section(cfg).weight) for kind in enabled_kinds(cfg)}


def frozen_model_paths(cfg: JobConfig) -> dict[str, str]:
    """The frozen models a checkpoint refers to (by path and checksum, never copied), by role."""
    paths = {}
    if cfg.model.lora.enabled:  # a LoRA policy's checkpoints hold only its adapters: the base is frozen
        paths[BASE_ROLE] = cfg.model.path
    if cfg.algo.uses_critic and cfg.critic.lora.enabled:  # a LoRA critic's checkpoints hold its adapters and head
        paths[CRITIC_BASE_ROLE] = cfg.critic.model_path or cfg.model.path
    if cfg.algo.uses_reference:
        paths["reference"] = cfg.reference_path or cfg.model.path
    for kind in enabled_kinds(cfg):  # each reward model's folder
        path = getattr(kind.section(cfg), "model_path", None)
        if path:
            paths[kind.name] = path
    return paths


def build_plan(cfg: JobConfig) -> Plan:
    """The job's placement plan; the driver builds it once and ships it to the processes that need it.

    Raises ConfigError naming the key for impossible layouts, and when a controller's rows of a step
    cannot be split evenly over its trainer devices.
    """
    job_plan = plan(cfg.placement.strategy, cfg.runtime.devices, plan_roles(cfg), controllers=cfg.runtime.controllers,
                    rollout_devices=cfg.placement.rollout_devices, train_devices=cfg.placement.train_devices,
                    min_devices=cfg.placement.min_devices, critic_devices=cfg.placement.critic_devices)
    rows = cfg.run.prompts_per_step // cfg.runtime.controllers * cfg.sampling.n
    for role in ("actor", "critic") if cfg.placement.critic_devices else ("actor",):
        devices = len([d for d in job_plan.devices_of("update", role) if d in job_plan.slices[0]])
        if rows % devices:
            raise ConfigError("run.prompts_per_step", f"each controller trains {rows} rows per step, which cannot be "
                              f"split evenly over its {devices} {role} devices; choose prompts_per_step × sampling.n / "
                              f"controllers divisible by the {role}'s training devices per slice")
    return job_plan


def load_job_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load a recipe YAML, apply dotted overrides and validate (raises ConfigError); a reasoning-gym task's
    rewards left at their `exact_match` defaults become the task's own scorer (`task_scorer`), and an environment
    task's (`textarena:ID`) become none: the environment's rewards are the reward."""
    cfg = load_config(JobConfig, recipe, overrides)
    task, reward = cfg.data.task, cfg.reward
    if is_environment_task(task):  # the environment gives the reward; there is no reference answer to match
        rules = [] if reward.rules == default_rules() else reward.rules
        accuracy = None if reward.accuracy_fn == RewardConfig().accuracy_fn else reward.accuracy_fn
        return replace(cfg, reward=replace(reward, rules=rules, accuracy_fn=accuracy))
    rules = [replace(rule, fn=task_scorer(task, rule.fn)) for rule in reward.rules] if reward.rules == default_rules() \
        else reward.rules
    accuracy = None if reward.accuracy_fn is None else task_scorer(task, reward.accuracy_fn)
    return replace(cfg, reward=replace(reward, rules=rules, accuracy_fn=accuracy))

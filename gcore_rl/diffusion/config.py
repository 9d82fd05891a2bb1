"""The configuration of a diffusion (Flow-GRPO) job: one dataclass tree, loaded from a ``kind: flow_grpo`` recipe."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from gcore_rl.checkpoint.adapters import BASE_ROLE
from gcore_rl.config import RuntimeConfig, SharedRunSettings
from gcore_rl.errors import ConfigError
from gcore_rl.models.lora import LoraSettings
from gcore_rl.placement.plan import STRATEGY_TRAITS, Plan, SharedPlacementSettings, plan
from gcore_rl.rewards.image_model import ImageRewardModelConfig
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.rule import RewardConfig
from gcore_rl.rollout.flow_sampler import ImageSamplingConfig
from gcore_rl.telemetry.loggers import check_loggers
from gcore_rl.training.flow_trainer import FlowTrainConfig

TEXT_ONLY_REWARDS = ("gcore_rl.rewards.builtin:",)
"""Import-path prefixes of built-in rewards that score text, which a diffusion job cannot use."""


@dataclass
class FlowRunConfig(SharedRunSettings):
    """Length of the run and where its outputs go."""

    output_dir: str = field(default="runs/flow-grpo", metadata={"help": "Run directory: resolved config, metrics.jsonl, sample grids, final model."})
    steps: int = field(default=60, metadata={"help": "RL steps at most (sample → reward → update → sync)."})
    prompts_per_step: int = field(default=8, metadata={"help": "Prompts per step (each yields sampling.n images)."})
    seed: int = field(default=0, metadata={"help": "Seed of the data order, the sampling noise and the trained steps."})
    eval_every: int = field(default=5, metadata={"help": "Deterministic samples of the held-out prompts every this many steps (eval/reward)."})
    stop_at_eval_reward: float = field(default=0.0, metadata={"help": "End the run after the evaluation at which eval/reward reaches this (0 = run all steps)."})
    save_final: bool = field(default=True, metadata={"help": "Write the final policy as a model folder to OUTPUT_DIR/final."})
    progress: bool = field(default=True, metadata={"help": "Show a rich progress bar (plain lines when not on a terminal)."})
    loggers: list[str] = field(default_factory=lambda: ["jsonl"], metadata={"help": "Metric sinks: jsonl (always), tensorboard, wandb, mlflow."})

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        self.validate_shared()
        if not (math.isfinite(self.stop_at_eval_reward)):
            raise ConfigError("stop_at_eval_reward", f"must be a finite number, got {self.stop_at_eval_reward}")
        check_loggers(self.loggers)


@dataclass
class FlowModelConfig:
    path: str = field(default="runs/tiny-flow-sft", metadata={"help": "The policy's model folder in diffusers' layout (transformer/, scheduler/, text_encoder/, tokenizer/, optional vae/; an SD3 or FLUX release folder with all its text encoders; `gcore-rl init-tiny-diffusion`)."})
    lora: LoraSettings = field(default_factory=LoraSettings, metadata={"help": "LoRA adapters on the transformer's linear layers (peft), as Flow-GRPO trains SD3.5: only they train and go into checkpoints, the KL's reference is the transformer with its adapters off, and the image engines get merged weights (sync: merged only)."})

    def validate(self) -> None:
        if self.lora.enabled and self.lora.sync != "merged":
            raise ConfigError("lora.sync", f"'{self.lora.sync}': the image engine applies merged weights only (it "
                              "holds a plain transformer); use model.lora.sync=merged")


@dataclass
class FlowDataConfig:
    """The prompts: the built-in shapes task (every colour × shape prompt)."""

    task: Literal["shapes"] = field(default="shapes", metadata={"help": "Built-in prompt set: shapes (\"a red circle\", ...; rows carry colour and shape)."})
    eval_prompts: int = field(default=12, metadata={"help": "Held-out evaluation prompts (the task's first this many rows, each sampled 4 times)."})

    def validate(self) -> None:
        if self.eval_prompts < 1:
            raise ConfigError("eval_prompts", f"must be at least 1, got {self.eval_prompts}")


@dataclass
class FlowPlacementConfig(SharedPlacementSettings):
    """Where the roles of a diffusion job run (see docs/placement.md); the split, rebalancing and staleness keys
    are a language job's."""

    strategy: Literal["colocate", "partial", "dynamic", "disaggregated"] = field(default="colocate", metadata={"help": "colocate: every device samples, scores and trains in turn; partial: the image reward model scores on devices of its own while the others still sample, all devices train; dynamic: as partial, the sampling / scoring split re-chosen after each step from the measured work; disaggregated: sampling and scoring on devices apart from the trainers, which publish new weights to them after each step."})

    def validate(self) -> None:
        self.validate_shared(self.strategy)
        for role in self.min_devices:
            if role not in ("actor", "rollout", "reward_model"):
                raise ConfigError(f"min_devices.{role}", "unknown role; a diffusion job's roles are actor, rollout, "
                                  "reward_model")


@dataclass
class FlowAlgoConfig:
    """How a Flow-GRPO step turns its rewards into advantages: an estimator of the shared registry
    (`gcore_rl.algos.registry.ADVANTAGES`) that needs nothing but the step's rewards (no critic, no greedy sample)."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = field(default="grpo", metadata={"help": "Advantage estimator, the language jobs' algo.advantage (see docs/algorithms.md): grpo (group mean/std), dr_grpo (group centring only), rloo (leave-one-out baseline), reinforce_pp (global whitening), reinforce_pp_baseline (group centring + global whitening); each image's reward is its trajectory's outcome."})


def _default_image_rewards() -> RewardConfig:
    from gcore_rl.rewards.rule import RewardFnConfig

    return RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.image:colour_coverage")],
                        accuracy_fn="gcore_rl.rewards.image:colour_accuracy")


@dataclass
class FlowGrpoJobConfig:
    """A Flow-GRPO job for a text-to-image flow model (`gcore-rl train RECIPE` with ``kind: flow_grpo``)."""

    kind: Literal["flow_grpo"] = field(default="flow_grpo", metadata={"help": "Selects this recipe type."})
    run: FlowRunConfig = field(default_factory=FlowRunConfig, metadata={"help": "Length and outputs."})
    model: FlowModelConfig = field(default_factory=FlowModelConfig, metadata={"help": "The diffusion policy."})
    data: FlowDataConfig = field(default_factory=FlowDataConfig, metadata={"help": "Prompts."})
    sampling: ImageSamplingConfig = field(default_factory=ImageSamplingConfig, metadata={"help": "Image sampling."})
    reward: RewardConfig = field(default_factory=_default_image_rewards, metadata={"help": "Rule rewards on pixels: fn(prompt, image, **row) with image a [H, W, 3] array in [0, 1]."})
    reward_model: ImageRewardModelConfig = field(default_factory=ImageRewardModelConfig, metadata={"help": "Scalar image reward model."})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={
        "help": "A generative vision-language judge (judge.model_path: a Qwen2-VL folder) that looks at each image, "
                "{completion} in its template standing for the image, and writes a verdict; its reward is added with "
                "judge.weight. It runs where the reward model would (the reward_model role); one of the two at a time."})
    algo: FlowAlgoConfig = field(default_factory=FlowAlgoConfig, metadata={"help": "Advantages."})
    train: FlowTrainConfig = field(default_factory=FlowTrainConfig, metadata={"help": "The policy update."})
    placement: FlowPlacementConfig = field(default_factory=FlowPlacementConfig, metadata={"help": "Role placement."})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"help": "Controller processes and devices (the language jobs' section)."})

    @property
    def roles(self) -> list[str]:
        """The roles of the job, as `placement.plan` names them."""
        return ["actor", "rollout"] + (["reward_model"] if self.scores_with_a_model else [])

    @property
    def scores_with_a_model(self) -> bool:
        """Whether a model (the image reward model or the judge) scores the images besides the rules."""
        return self.reward_model.enabled or self.judge.enabled

    @property
    def frozen_model_paths(self) -> dict[str, str]:
        """The frozen models a checkpoint refers to by path and checksum, by role: the reference (the start
        transformer, with train.kl_coef > 0), a LoRA policy's base transformer and the scoring model."""
        paths = {"reference": f"{self.model.path}/transformer"} if self.train.kl_coef > 0 else {}
        if self.model.lora.enabled:  # its checkpoints hold only the adapters
            paths[BASE_ROLE] = f"{self.model.path}/transformer"
        if self.judge.enabled:
            paths["judge"] = self.judge.model_path
        if self.reward_model.enabled:
            paths["reward_model"] = self.reward_model.model_path
        return paths

    @property
    def model_reward_weight(self) -> float:
        """The weight of the scoring model's reward (the judge's or the reward model's)."""
        return self.judge.weight if self.judge.enabled else self.reward_model.weight

    def validate(self) -> None:
        traits = STRATEGY_TRAITS[self.placement.strategy]
        if traits.splits_slice and self.runtime.kind == "local":
            raise ConfigError("placement.strategy", f"'{self.placement.strategy}' puts roles on separate devices of a slice; "
                              "the local runtime has one device per controller, so use runtime.kind=ray with "
                              "runtime.devices_per_controller >= 2")
        if not self.reward.rules and not (self.judge.enabled or self.reward_model.enabled):
            raise ConfigError("reward.rules", "is empty, and no judge or image reward model scores the images either; "
                              "name at least one reward")
        if self.judge.enabled and self.reward_model.enabled:
            raise ConfigError("judge.enabled", "a diffusion job scores its images with one model: the judge or the "
                              "image reward model (reward_model.enabled), not both")
        if traits.streams_to_scorers and not traits.publishes_weights and not self.scores_with_a_model:
            raise ConfigError("placement.strategy", f"'{self.placement.strategy}' gives the image reward model devices of "
                              "its own, and neither reward_model.model_path nor judge.model_path is set: set one, or "
                              "use colocate")
        if self.algo.advantage.startswith("reinforce_pp") and self.runtime.controllers > 1:
            raise ConfigError("algo.advantage", f"{self.algo.advantage} whitens advantages over the step's whole batch, "
                              f"and with runtime.controllers={self.runtime.controllers} each controller holds only its "
                              "share; use runtime.controllers=1, or grpo / dr_grpo / rloo, whose statistics are per group")
        if self.run.prompts_per_step % self.runtime.controllers:
            raise ConfigError("run.prompts_per_step", f"{self.run.prompts_per_step} prompts cannot be split evenly over "
                              f"runtime.controllers={self.runtime.controllers} controllers")
        paths = [(f"reward.rules.{i}.fn", rule.fn) for i, rule in enumerate(self.reward.rules)]
        paths.append(("reward.accuracy_fn", self.reward.accuracy_fn or ""))
        for key, path in paths:
            if path.startswith(TEXT_ONLY_REWARDS):
                raise ConfigError(key, f"`{path}` scores text, and a diffusion policy's samples are images: use an image "
                                  "reward such as gcore_rl.rewards.image:colour_coverage (reward.accuracy_fn: "
                                  "gcore_rl.rewards.image:colour_accuracy, or null)")




def flow_plan(cfg: FlowGrpoJobConfig) -> Plan:
    """The job's placement plan (ConfigError naming the key for an impossible layout)."""
    return plan(cfg.placement.strategy, cfg.runtime.devices, cfg.roles, controllers=cfg.runtime.controllers,
                rollout_devices=cfg.placement.rollout_devices, train_devices=cfg.placement.train_devices,
                min_devices=cfg.placement.min_devices)

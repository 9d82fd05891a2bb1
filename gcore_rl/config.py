"""The job's typed configuration: one dataclass tree, loaded from a YAML recipe plus overrides.

Each component keeps its own config next to its code; this module only composes them. Run
`gcore-rl config-reference` for every key with its type, default and meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.configlib import load_config
from gcore_rl.controller.waves import DynamicSamplingConfig
from gcore_rl.data.config import DataConfig
from gcore_rl.errors import ConfigError
from gcore_rl.models.loading import ModelConfig
from gcore_rl.placement.plan import PlacementConfig
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.rule import RewardConfig
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.training.actor import TrainConfig


@dataclass
class RunConfig:
    """Length of the run and where its outputs go."""

    output_dir: str = field(default="runs/grpo", metadata={"help": "Run directory: resolved config, metrics.jsonl, final model."})
    steps: int = field(default=40, metadata={"help": "RL steps (generate → reward → prepare → train → sync)."})
    prompts_per_step: int = field(default=16, metadata={"help": "Prompts per step over all controllers (each yields sampling.n completions)."})
    seed: int = field(default=0, metadata={"help": "Seed of sampling and data order."})
    eval_every: int = field(default=10, metadata={"help": "Greedy accuracy on the data.eval_prompts held-out prompts every this many steps (0 = only before and after)."})
    save_final: bool = field(default=True, metadata={"help": "Write the final policy to OUTPUT_DIR/final with save_pretrained (safetensors)."})
    progress: bool = field(default=True, metadata={"help": "Show a rich progress bar (plain lines when not on a terminal)."})

    def validate(self) -> None:
        for key in ("steps", "prompts_per_step"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise ConfigError("eval_every", f"must be >= 0, got {self.eval_every}")


@dataclass
class RuntimeConfig:
    """Which processes run the job."""

    kind: Literal["local", "ray"] = field(default="local", metadata={"help": "'local': SPMD controller processes on this machine (1 = everything in this process); 'ray': controllers as Ray actors in a placement group."})
    num_processes: int = field(default=1, metadata={"help": "Controllers, each with its prompt shard, engine and FSDP trainer worker."})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={"help": "'auto' uses CUDA when present (one GPU per process), else CPU."})
    ray_address: str | None = field(default=None, metadata={"help": "Ray: address of an existing cluster ('auto' or HOST:PORT from `ray start --head`); None starts a local Ray instance."})
    threads_per_process: int = field(default=0, metadata={"help": "torch intra-op threads per process (0 = CPU cores divided by processes)."})

    def validate(self) -> None:
        if self.num_processes < 1:
            raise ConfigError("num_processes", f"must be at least 1, got {self.num_processes}")


@dataclass
class JobConfig:
    """A whole GRPO job."""

    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "Length and outputs."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The policy to train."})
    reference_path: str | None = field(default=None, metadata={"help": "Reference model for the KL term (None = the initial policy, model.path)."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompts."})
    sampling: SamplingConfig = field(default_factory=SamplingConfig, metadata={"help": "Rollout sampling."})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"help": "Reward functions."})
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig, metadata={"help": "DAPO dynamic sampling: waves until enough groups have differing rewards."})
    judge: JudgeConfig = field(default_factory=JudgeConfig, metadata={"help": "Generative reward model (LLM judge); its normalised verdict is added to the rule rewards with judge.weight."})
    algo: AlgoConfig = field(default_factory=AlgoConfig, metadata={"help": "Policy-gradient objective."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Optimiser and batching."})
    placement: PlacementConfig = field(default_factory=PlacementConfig, metadata={"help": "Role placement."})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"help": "Processes and devices."})

    def validate(self) -> None:
        if self.run.prompts_per_step % self.runtime.num_processes:
            raise ConfigError("run.prompts_per_step", f"{self.run.prompts_per_step} prompts cannot be split evenly "
                              f"over runtime.num_processes={self.runtime.num_processes} controllers")
        if self.placement.strategy != "colocate":
            raise ConfigError("placement.strategy", f"the runtimes run 'colocate' only so far; '{self.placement.strategy}' "
                              "needs separate rollout/judge engines, which are not built yet")
        if self.algo.name == "grpo" and self.sampling.n < 2:
            raise ConfigError("sampling.n", "GRPO needs at least 2 completions per prompt to form a group")


def load_job_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load a recipe YAML, apply dotted overrides and validate (raises ConfigError)."""
    return load_config(JobConfig, recipe, overrides)

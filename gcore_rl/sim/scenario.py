"""Scenario files: one YAML describes a cluster, the models, the workload and what to compare.

Loaded with the project's `gcore_rl.configlib.load_config`, so an unknown key, a value of the
wrong type or a failed check raises `ConfigError` naming the dotted key (`gcore-rl simulate`
exits with status 2). Build one in code with `Scenario(...)` or `from_dict(Scenario, {...})`;
`resolve_job(scenario)` turns it into the concrete `Job` the simulator runs.

A `sweep` runs the scenario once per value of a dotted key, e.g. `sweep: {controllers: [1, 8, 64]}`
(several keys: every combination). Keys joined by commas move together, one list of values per
variant: `sweep: {"gpus,controllers": [[64, 8], [512, 64]]}`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gcore_rl.configlib import apply_overrides, from_dict, load_config, to_dict
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import HARDWARE, Hardware, hardware_preset
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.models import ModelSpec, model_preset
from gcore_rl.costmodel.work import Workload
from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import RebalanceConfig

Strategy = Literal["colocate", "partial", "dynamic", "disaggregated", "interleave", "streaming"]
SIM_STRATEGIES: tuple[str, ...] = ("colocate", "partial", "dynamic", "disaggregated", "interleave", "streaming")
#: what a scenario compares when it names no strategies (streaming models rule rewards only, so it is opt-in)
DEFAULT_STRATEGIES: tuple[str, ...] = SIM_STRATEGIES[:5]


@dataclass(frozen=True)
class HardwareChoice:
    """A GPU preset, with any of its figures overridden (null keeps the preset's)."""

    preset: str = field(default="H100", metadata={"help": "One of " + ", ".join(HARDWARE) + " (see gcore_rl/costmodel/hardware.py for sources)."})
    name: str | None = field(default=None, metadata={"help": "Label in reports when the figures no longer describe the preset (e.g. a CPU being calibrated)."})
    peak_flops: float | None = field(default=None, metadata={"help": "Dense bf16 FLOP/s per GPU."})
    hbm_bandwidth: float | None = field(default=None, metadata={"help": "Device memory bandwidth, B/s."})
    memory_bytes: float | None = field(default=None, metadata={"help": "Device memory, bytes."})
    host_link_bandwidth: float | None = field(default=None, metadata={"help": "Effective host <-> device bandwidth (PCIe), B/s."})
    interconnect_bandwidth: float | None = field(default=None, metadata={"help": "Intra-node GPU <-> GPU bandwidth per GPU (NVLink), B/s."})
    network_bandwidth: float | None = field(default=None, metadata={"help": "Inter-node bandwidth per GPU, B/s."})
    gpus_per_node: int | None = field(default=None, metadata={"help": "GPUs per node (NVLink domain)."})

    def validate(self) -> None:
        hardware_preset(self.preset)
        for key in ("peak_flops", "hbm_bandwidth", "memory_bytes", "host_link_bandwidth", "interconnect_bandwidth",
                    "network_bandwidth", "gpus_per_node"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(key, f"must be > 0, got {value}")

    def resolve(self) -> Hardware:
        overrides = {k: v for k, v in to_dict(self).items() if k != "preset"}
        return hardware_preset(self.preset).with_overrides(**overrides)


@dataclass(frozen=True)
class ModelChoice:
    """A model: a preset name, an explicit shape, or a Hugging Face config.json; and its engines' tensor parallelism."""

    preset: str | None = field(default=None, metadata={"help": "A preset name (gcore_rl/costmodel/models.py), e.g. Qwen2.5-7B."})
    shape: ModelSpec | None = field(default=None, metadata={"help": "An explicit shape (name, params, layers, hidden, kv_heads, head_dim, vocab, bytes_per_param)."})
    hf_config: str | None = field(default=None, metadata={"help": "Path of a Hugging Face config.json (dense Llama/Qwen2-style)."})
    tp: int = field(default=1, metadata={"help": "Devices per inference engine of this model (tensor parallel)."})

    def validate(self) -> None:
        given = [k for k in ("preset", "shape", "hf_config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError("preset", f"give exactly one of preset, shape, hf_config (got {', '.join(given) or 'none'})")
        if self.preset is not None:
            model_preset(self.preset)
        if self.tp < 1:
            raise ConfigError("tp", f"must be at least 1, got {self.tp}")

    def resolve(self) -> ModelSpec:
        if self.preset is not None:
            return model_preset(self.preset)
        if self.shape is not None:
            return self.shape
        path = Path(str(self.hf_config))
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError("hf_config", f"cannot read {path}: {exc}") from None
        return ModelSpec.from_hf_config(config, name=path.parent.name or path.stem)


def _default_policy() -> ModelChoice:
    return ModelChoice(preset="Qwen2.5-7B")


@dataclass(frozen=True)
class ModelsConfig:
    """The policy, the generative judge (optional) and whether a reference model is used."""

    policy: ModelChoice = field(default_factory=_default_policy, metadata={"help": "The policy (trained, and served by the rollout engines)."})
    judge: ModelChoice | None = field(default=None, metadata={"help": "Generative reward model; null = rule rewards only (no judge phase)."})
    reference: bool = field(default=True, metadata={"help": "A frozen reference (KL term): one more log-prob pass per step, same shape as the policy."})


@dataclass(frozen=True)
class EngineSettings:
    """Capacity of every inference engine (policy and judge)."""

    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences an engine decodes at once (continuous batching)."})
    memory_utilization: float = field(default=0.9, metadata={"help": "Share of device memory an engine may use for weights + KV cache; fewer sequences run at once when their KV does not fit."})

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        if not 0 < self.memory_utilization <= 1:
            raise ConfigError("memory_utilization", f"must be in (0, 1], got {self.memory_utilization}")


@dataclass(frozen=True)
class PlacementSettings:
    """Device counts per controller slice for the strategies that split a slice."""

    rollout_devices: int | None = field(default=None, metadata={"help": "partial (and dynamic's first step): policy-rollout devices per slice; the rest run the judge. null = half the slice."})
    train_devices: int | None = field(default=None, metadata={"help": "disaggregated: training devices per slice. null = half the slice."})
    generation_rollout_devices: int | None = field(default=None, metadata={"help": "disaggregated: rollout devices among the slice's generation devices (the rest run the judge). null = half of them; 0 devices left for the judge = rollout and judge take turns."})
    dynamic_model: Literal["replay", "counters"] = field(default="replay", metadata={"help": "dynamic: how the rebalancer predicts a split's rollout phase. replay = the step's counted work replayed through the simulator's phase model at every split (what a run with a calibrated simulator would do); counters = the runtime's closed-form model from busy time and fixed parts (RolloutLoad.predict)."})
    wave_resplit: bool = field(default=False, metadata={"help": "dynamic: at each wave boundary of a step, replay the finished wave's counted work (repeated to the next wave's size) at the splits within one move and re-split for the next wave if that saves more than the move costs (gcore_rl.sim.wave_split); false = one split per step."})
    offload_trainer: bool = field(default=True, metadata={"help": "Time-shared strategies move the trainer's state to host during the rollout phase and back for training (needed to fit; disable to model a trainer that stays resident)."})
    max_staleness: float = field(default=1.0, metadata={"help": "streaming: k, the most weight versions a trained sample may lag: a sample of step s starts generating only once the engines hold the weights of update s - k or newer (the runtime's placement.max_staleness). May be fractional, as verl's staleness_threshold: at most (1 + k) steps' samples ahead of the trainer's weights; 0 = generation never runs ahead."})
    partial_rollout: bool = field(default=False, metadata={"help": "streaming: at a weight sync the engines interrupt their sequences and resume them on the new weights (re-prefilling what they hold); false = they stop taking new sequences and finish the running ones first."})
    train_chunks: int = field(default=1, metadata={"help": "streaming: the trainer cuts each step's batch into this many parts and trains on a part as soon as its samples are complete (verl's require_batches x trigger_parameter_sync_step); 1 = wait for the whole batch."})
    recompute_logprobs: bool = field(default=True, metadata={"help": "streaming: the trainer recomputes old log-probs (one forward pass per trained token); false = it uses the engines' log-probs of the sampled tokens."})


@dataclass(frozen=True)
class Scenario:
    """A simulated RLHF job and the strategies to compare on it."""

    name: str = field(default="scenario", metadata={"help": "Label of the scenario in reports."})
    description: str = field(default="", metadata={"help": "Free text shown in the summary."})
    gpus: int = field(default=8, metadata={"help": "GPUs of the job."})
    controllers: int = field(default=1, metadata={"help": "K parallel controllers; each owns gpus / K devices (a slice) and 1/K of the prompts."})
    steps: int = field(default=20, metadata={"help": "RL steps to simulate."})
    seed: int = field(default=0, metadata={"help": "Seed of the length and validity draws (the same work for every strategy)."})
    strategies: tuple[Strategy, ...] = field(default=DEFAULT_STRATEGIES, metadata={"help": "Strategies to compare: " + ", ".join(SIM_STRATEGIES) + " (default: all but streaming)."})
    hardware: HardwareChoice = field(default_factory=HardwareChoice, metadata={"help": "The GPUs."})
    models: ModelsConfig = field(default_factory=ModelsConfig, metadata={"help": "Policy, judge, reference."})
    workload: Workload = field(default_factory=Workload, metadata={"help": "Prompts, lengths, dynamic sampling, payload."})
    engine: EngineSettings = field(default_factory=EngineSettings, metadata={"help": "Inference-engine capacity."})
    placement: PlacementSettings = field(default_factory=PlacementSettings, metadata={"help": "Splits of a slice."})
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig, metadata={"help": "dynamic: the shared rebalancer's settings (gcore_rl.placement.rebalance); unit is raised to the engines' tensor-parallel size."})
    costs: CostConstants = field(default_factory=CostConstants, metadata={"help": "Cost-model constants (gcore_rl/costmodel/cost.py)."})
    sweep: dict[str, list[Any]] = field(default_factory=dict, metadata={"help": "Run once per value of each dotted key, e.g. {controllers: [1, 8, 64]} (several keys: every combination). Keys joined by commas take one list of values each, together: {\"gpus,controllers\": [[64, 8], [512, 64]]}."})

    def validate(self) -> None:
        if self.gpus < 1:
            raise ConfigError("gpus", f"must be at least 1, got {self.gpus}")
        if self.controllers < 1 or self.gpus % self.controllers:
            raise ConfigError("controllers", f"must divide gpus={self.gpus}, got {self.controllers}")
        if self.steps < 1:
            raise ConfigError("steps", f"must be at least 1, got {self.steps}")
        if not self.strategies:
            raise ConfigError("strategies", "name at least one strategy")
        if self.workload.prompts_per_step % self.controllers:
            raise ConfigError("workload.prompts_per_step", f"{self.workload.prompts_per_step} prompts cannot be split "
                              f"evenly over {self.controllers} controllers")
        for key in self.sweep:
            if not self.sweep[key]:
                raise ConfigError(f"sweep.{key}", "give at least one value")
        resolve_job(self)  # shapes, memory and splits

    @property
    def slice_devices(self) -> int:
        return self.gpus // self.controllers


def resolve_job(s: Scenario) -> Job:
    """Resolve presets and default splits, checking that models fit and splits divide into engines."""
    hw = s.hardware.resolve()
    policy = s.models.policy.resolve()
    judge = s.models.judge.resolve() if s.models.judge is not None else None
    p_tp = s.models.policy.tp
    j_tp = s.models.judge.tp if s.models.judge is not None else 1
    D = s.gpus // s.controllers
    _check_fits(policy, p_tp, hw, s.engine.memory_utilization, "models.policy.tp")
    if judge is not None:
        _check_fits(judge, j_tp, hw, s.engine.memory_utilization, "models.judge.tp")
    if D % p_tp:
        raise ConfigError("models.policy.tp", f"{p_tp} does not divide the {D} devices of a slice")
    if judge is not None and D % j_tp:
        raise ConfigError("models.judge.tp", f"{j_tp} does not divide the {D} devices of a slice")
    unit = math.lcm(p_tp, j_tp)
    rollout = s.placement.rollout_devices
    if rollout is None:
        rollout = max(p_tp, (D // 2) // unit * unit) if judge is not None else D
    split_needed = judge is not None and any(x in s.strategies for x in ("partial", "dynamic"))
    if split_needed:
        _check_split("placement.rollout_devices", rollout, D, p_tp, j_tp)
    train = s.placement.train_devices if s.placement.train_devices is not None else D // 2
    generation = D - train
    gen_rollout = s.placement.generation_rollout_devices
    if gen_rollout is None:
        gen_rollout = generation if judge is None else max(p_tp, (generation // 2) // unit * unit)
    if "streaming" in s.strategies:
        _check_streaming(s, judge)
    if "disaggregated" in s.strategies or "streaming" in s.strategies:
        if not 1 <= train < D:
            raise ConfigError("placement.train_devices", f"must leave 1 .. {D - 1} devices of a {D}-device slice "
                              f"for generation, got {train}")
        if not p_tp <= gen_rollout <= generation or gen_rollout % p_tp or (generation - gen_rollout) % j_tp:
            raise ConfigError("placement.generation_rollout_devices",
                              f"{gen_rollout} rollout devices do not fit the {generation} generation devices of a slice "
                              f"in engines of {p_tp} (policy) and {j_tp} (judge) devices")
        if judge is None and gen_rollout != generation:
            raise ConfigError("placement.generation_rollout_devices", "without a judge every generation device rolls out")
    _check_sequence_parallel(s, policy, D, train)
    rebalance = dataclasses.replace(s.rebalance, unit=math.lcm(s.rebalance.unit, unit))
    return Job(hardware=hw, policy=policy, judge=judge, reference=s.models.reference, policy_tp=p_tp, judge_tp=j_tp,
               costs=s.costs, workload=s.workload, gpus=s.gpus, controllers=s.controllers,
               max_num_seqs=s.engine.max_num_seqs, memory_utilization=s.engine.memory_utilization,
               offload_trainer=s.placement.offload_trainer, rollout_devices=rollout, train_devices=train,
               generation_rollout_devices=gen_rollout, rebalance=rebalance,
               rebalance_model=s.placement.dynamic_model, wave_resplit=s.placement.wave_resplit,
               max_staleness=s.placement.max_staleness,
               partial_rollout=s.placement.partial_rollout, train_chunks=s.placement.train_chunks,
               recompute_logprobs=s.placement.recompute_logprobs)


def _check_sequence_parallel(s: Scenario, policy: ModelSpec, slice_devices: int, train_devices: int) -> None:
    """`workload.sequence_parallel` divides the policy's query and key/value heads and every trainer
    group the scenario's strategies use (the runtime's checks, `training.sequence_parallel.check_divides`)."""
    n = s.workload.sequence_parallel
    if n == 1:
        return
    key = "workload.sequence_parallel"
    if s.workload.kind == "diffusion":
        raise ConfigError(key, "sequence parallelism splits token sequences; a diffusion workload trains images "
                               "(set it to 1)")
    if s.workload.images.enabled:
        raise ConfigError(key, "the runtime does not split a vision-language policy's sequences yet (its "
                               "train.sequence_parallel refuses one); set it to 1 for a workload with images")
    heads = policy.query_heads
    if heads % n or policy.kv_heads % n:
        raise ConfigError(key, f"{n} must divide {policy.name}'s attention heads ({heads}) and key/value heads "
                               f"({policy.kv_heads}): each device attends with a whole share of them")
    apart = {"disaggregated", "streaming"}  # strategies that train on placement.train_devices
    trainers = []
    if set(s.strategies) - apart:
        trainers.append(("the devices of a slice", slice_devices))
    if set(s.strategies) & apart:
        trainers.append(("placement.train_devices", train_devices))
    for what, devices in trainers:
        if devices % n:
            raise ConfigError(key, f"{n} does not divide {what} ({devices}), which train the policy")


def _check_streaming(s: Scenario, judge: ModelSpec | None) -> None:
    if judge is not None:
        raise ConfigError("strategies", "streaming models rule rewards only (no judge engines yet); set models.judge: "
                          "null or leave streaming out")
    if s.workload.kind == "diffusion":
        raise ConfigError("strategies", "streaming models token generation only (its event loop decodes tokens); "
                          "leave streaming out of a diffusion workload")
    if s.placement.max_staleness < 0:
        raise ConfigError("placement.max_staleness", f"must be >= 0, got {s.placement.max_staleness}")
    if s.placement.train_chunks < 1:
        raise ConfigError("placement.train_chunks", f"must be at least 1, got {s.placement.train_chunks}")


def _check_fits(model: ModelSpec, tp: int, hw: Hardware, utilisation: float, key: str) -> None:
    shard = model.weight_bytes / tp
    if shard >= utilisation * hw.memory_bytes:
        raise ConfigError(key, f"{model.name} needs {shard / 1e9:.1f} GB of weights per device with tp={tp}, more than "
                          f"{utilisation:.0%} of the {hw.memory_bytes / 1e9:.0f} GB of a {hw.name}; raise tp")


def _check_split(key: str, rollout: int, devices: int, policy_tp: int, judge_tp: int) -> None:
    if not policy_tp <= rollout <= devices - judge_tp or rollout % policy_tp or (devices - rollout) % judge_tp:
        raise ConfigError(key, f"{rollout} rollout devices do not split a {devices}-device slice into policy engines of "
                          f"{policy_tp} and judge engines of {judge_tp} devices (at least one of each)")


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read a scenario YAML and apply dotted overrides (raises ConfigError naming the key)."""
    return load_config(Scenario, path, overrides)


def variants(scenario: Scenario) -> list[tuple[str, Scenario]]:
    """(label, scenario) for every combination of the sweep's values; [("", scenario)] without a sweep."""
    if not scenario.sweep:
        return [("", scenario)]
    keys = list(scenario.sweep)
    base = to_dict(scenario)
    base["sweep"] = {}
    out = []
    for values in itertools.product(*(scenario.sweep[k] for k in keys)):
        pairs = [pair for key, value in zip(keys, values, strict=True) for pair in _sweep_pairs(key, value)]
        overrides = [f"{k}={json.dumps(v)}" for k, v in pairs]
        try:
            variant = from_dict(Scenario, apply_overrides(base, overrides, schema=Scenario))
        except ConfigError as err:
            raise ConfigError(f"sweep.{err.key}", err.message) from None
        out.append((" ".join(f"{k}={v}" for k, v in pairs), variant))
    return out


def _sweep_pairs(key: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted key, value) of one sweep entry: `key` itself, or each of its comma-joined keys with its value."""
    names = [name.strip() for name in key.split(",")]
    if len(names) == 1:
        return [(key, value)]
    if not isinstance(value, (list, tuple)) or len(value) != len(names):
        raise ConfigError(f"sweep.{key}", f"each value must list {len(names)} values (one per key), got {value!r}")
    return list(zip(names, value, strict=True))

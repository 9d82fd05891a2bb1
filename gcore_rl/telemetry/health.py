"""Is an update healthy? Thresholds on a step's metrics that say when training has left its trust region or
lost what it started from, as pure functions over the lines of `metrics.jsonl`.

Each rule reads one metric of a step and compares it with a threshold, some of them relative to the run's
own start (its first step, or the held-out accuracy before training):

| rule | flagged when | why this threshold |
|---|---|---|
| `approx_kl` | KL to the policy that sampled the batch > `max_approx_kl` (0.1 nat/token) | PPO-style trust regions stop or shrink an update near 0.01-0.1 (Schulman et al. 2017 use a KL target of 0.01; OpenAI baselines stop at 1.5x a 0.01-0.03 target); a whole nat per token means the update rewrote the policy |
| `clip_fraction` | more than `max_clip_fraction` (0.3) of the tokens clipped | with ratio clips near 0.2, healthy PPO runs clip about 0.05-0.2 of the tokens; past 0.3 most of the update is outside the region the objective trusts |
| `entropy` | below `min_entropy_fraction` (0.1) of the first step's | an entropy that falls by 10x has collapsed onto a few answers, and GRPO's groups stop differing |
| `grad_norm` | above `grad_norm_spike` (10) times the median of the 10 steps before (from the 4th step on), the median taken as at least `grad_norm_floor` (1) | a spike an order of magnitude over the run's recent norm is a blow-up, whatever the scale of the model; recent, because a norm that grows as a run learns is no spike (the vision demo's rose from 0.5 to 15 over 25 steps, clipped to 1 all along); the floor keeps a run whose gradients are near zero (a task its warm start already solves: reversal's median was 0.09, and a rare wrong answer gave 1.45, clipped to the default `train.grad_clip` of 1) from being flagged for an ordinary step |
| `reward/mean` | more than `max_reward_drop` (0.05) below the first step's (what the warm start earned), and more than three standard errors of the difference of the two means | RL from a warm start should not lose what the warm start had; but a step's mean over a few hundred samples moves by several hundredths with the prompts drawn (the recipe with PPO's frozen actor went 0.211 -> 0.125 with its weights unchanged), so a drop inside the noise is not flagged. The standard error is `reward/std / sqrt(reward/count)`, which counts the samples of one prompt as independent and so understates it: hence three |
| `eval/accuracy` | more than `max_reward_drop` below the held-out accuracy before training | the same, on held-out prompts |
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gcore_rl.errors import ConfigError

SPIKE_WINDOW = 10
"""Steps before a step whose median gradient norm a spike is measured against."""


@dataclass
class HealthConfig:
    """Thresholds of the health checks (the run report marks a step past one; the console warns once per rule)."""

    max_approx_kl: float = field(default=0.1, metadata={"help": "Flag a step whose approx_kl (KL to the policy that sampled its batch, nat/token) exceeds this."})
    max_clip_fraction: float = field(default=0.3, metadata={"help": "Flag a step that clipped more than this fraction of its tokens."})
    min_entropy_fraction: float = field(default=0.1, metadata={"help": "Flag a step whose entropy fell below this fraction of the first step's (entropy collapse)."})
    grad_norm_spike: float = field(default=10.0, metadata={"help": "Flag a step whose gradient norm exceeds this many times the median of the 10 steps before it (from the 4th step)."})
    grad_norm_floor: float = field(default=1.0, metadata={"help": "The median of grad_norm_spike counts as at least this, so a run whose gradients are near zero is not flagged for an ordinary step."})
    max_reward_drop: float = field(default=0.05, metadata={"help": "Flag a step whose sampled reward falls more than this below the first step's, or whose held-out accuracy falls more than this below the accuracy before training."})

    def validate(self) -> None:
        for key in ("max_approx_kl", "max_clip_fraction", "min_entropy_fraction", "grad_norm_spike", "grad_norm_floor",
                    "max_reward_drop"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(key, f"must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class Flag:
    """One metric of one step past its threshold."""

    step: int
    key: str
    value: float
    threshold: float
    above: bool  # the value is too high (else too low)

    def __str__(self) -> str:
        return f"step {self.step}: {self.key} {self.value:.3g} {'>' if self.above else '<'} {self.threshold:.3g}"


def _number(line: dict[str, Any], key: str) -> float | None:
    value = line.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def step_flags(history: Sequence[dict[str, Any]], line: dict[str, Any], cfg: HealthConfig,
               accuracy_before: float | None = None) -> list[Flag]:
    """The flags of metrics line `line`, given the lines of the steps before it (`history`, oldest first) and
    the held-out accuracy before training (None: not measured)."""
    step = int(line.get("step", len(history) + 1))
    first = history[0] if history else line
    flags: list[Flag] = []

    def above(key: str, threshold: float | None) -> None:
        value = _number(line, key)
        if value is not None and threshold is not None and value > threshold:
            flags.append(Flag(step, key, value, threshold, True))

    def below(key: str, threshold: float | None) -> None:
        value = _number(line, key)
        if value is not None and threshold is not None and value < threshold:
            flags.append(Flag(step, key, value, threshold, False))

    above("approx_kl", cfg.max_approx_kl)
    above("clip_fraction", cfg.max_clip_fraction)
    entropy = _number(first, "entropy")
    below("entropy", entropy * cfg.min_entropy_fraction if entropy else None)
    norms = [n for n in (_number(h, "grad_norm") for h in history[-SPIKE_WINDOW:]) if n is not None]
    above("grad_norm", max(statistics.median(norms), cfg.grad_norm_floor) * cfg.grad_norm_spike if len(norms) >= 3 else None)
    reward = _number(first, "reward/mean")
    below("reward/mean", reward - max(cfg.max_reward_drop, 3 * _difference_error(first, line)) if reward is not None else None)
    below("eval/accuracy", accuracy_before - cfg.max_reward_drop if accuracy_before is not None else None)
    return flags


def _difference_error(first: dict[str, Any], line: dict[str, Any]) -> float:
    """Standard error of the difference of two steps' mean rewards (0 when a step lacks `reward/std` or `reward/count`)."""
    variance = 0.0
    for one in (first, line):
        std, count = _number(one, "reward/std"), _number(one, "reward/count")
        if std is None or not count:
            return 0.0
        variance += std * std / count
    return math.sqrt(variance)


def run_flags(metrics: Sequence[dict[str, Any]], cfg: HealthConfig, accuracy_before: float | None = None) -> list[Flag]:
    """Every flag of a run's metrics lines, step by step."""
    return [flag for index, line in enumerate(metrics)
            for flag in step_flags(metrics[:index], line, cfg, accuracy_before)]


class HealthWatch:
    """The checks as a run goes: `check(line)` returns the flags of a new step (a metrics line with its "step"),
    and `warnings` the ones to print (the first flag of each metric in the run; later ones only go to the report).
    A resumed run passes the lines before it as `history`: its start stays the run's start, and what was warned
    of before is not warned of again."""

    def __init__(self, cfg: HealthConfig, accuracy_before: float | None = None, history: Sequence[dict[str, Any]] = ()):
        self.cfg = cfg
        self.accuracy_before = accuracy_before
        self.history: list[dict[str, Any]] = []
        self.warned: set[str] = set()
        for line in history:
            self.warned.update(flag.key for flag in self.check(line))

    def check(self, line: dict[str, Any]) -> list[Flag]:
        flags = step_flags(self.history, line, self.cfg, self.accuracy_before)
        self.history.append(line)
        return flags

    def warnings(self, flags: Sequence[Flag]) -> list[str]:
        out = []
        for flag in flags:
            if flag.key not in self.warned:
                self.warned.add(flag.key)
                out.append(f"warning: unhealthy update, {flag} (run.health.{_setting(flag.key)}; later steps past it "
                           "are listed in the run report only)")
        return out


def _setting(key: str) -> str:
    return {"approx_kl": "max_approx_kl", "clip_fraction": "max_clip_fraction", "entropy": "min_entropy_fraction",
            "grad_norm": "grad_norm_spike"}.get(key, "max_reward_drop")

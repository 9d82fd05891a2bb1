"""What a simulation returns: one record per step, the timeline, and summary figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gcore_rl.costmodel.timeline import Timeline

#: phase keys of `StepRecord.phases`, in display order
PHASES = ("rollout/data", "rollout/generate", "rollout/judge", "rollout/reference", "swap", "update/data",
          "update/prepare", "update/train", "update/sync")


@dataclass(frozen=True)
class StepRecord:
    """One simulated step.

    `phases` holds seconds on the step's critical path: for the rollout phase, the slice that
    finished last; for overlapping work (a streaming judge, disaggregated pipelining) the part
    not hidden behind other work (e.g. `rollout/judge` under `partial` is the judge's tail after
    generation ended). Under colocate, partial, dynamic and interleave the phases sum to
    `seconds`; under disaggregated the rollout phases overlap the previous update and the sum exceeds it.

    `features` holds the work behind the phases (tokens, decode steps, bytes), for calibration.
    """

    step: int
    start: float
    end: float
    phases: dict[str, float]
    waves: int
    valid_fraction: float
    trained_samples: int
    generated_tokens: int
    trained_tokens: int
    generate_device_seconds: float  # per slice (mean over slices)
    judge_device_seconds: float  # per slice (mean over slices)
    generate_fixed_seconds: float = 0.0  # per device of the slice's slowest policy engine: decode steps x fixed step cost
    judge_fixed_seconds: float = 0.0  # per device: the slice's largest judge batch's decode steps x fixed step cost
    rollout_seconds: float = 0.0  # the rollout phase (all waves, up to the barrier) of the slowest slice
    rollout_devices: int | None = None  # per slice, for strategies that split a slice
    decision: str | None = None
    wave_splits: tuple[int, ...] = ()  # dynamic with placement.wave_resplit: the split of each wave (empty: one split)
    features: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    """A simulated run of one strategy on one scenario (variant)."""

    scenario: str
    strategy: str
    variant: str
    gpus: int
    controllers: int
    steps: list[StepRecord]
    timeline: Timeline

    @property
    def label(self) -> str:
        return f"{self.strategy} [{self.variant}]" if self.variant else self.strategy

    @property
    def total_seconds(self) -> float:
        return self.steps[-1].end if self.steps else 0.0

    @property
    def mean_step_seconds(self) -> float:
        return float(np.mean([s.seconds for s in self.steps])) if self.steps else 0.0

    def mean_phases(self) -> dict[str, float]:
        """Mean seconds per step of each phase."""
        keys = [k for k in PHASES if any(k in s.phases for s in self.steps)]
        return {k: float(np.mean([s.phases.get(k, 0.0) for s in self.steps])) for k in keys}

    def utilisation(self) -> dict[str, float]:
        """Share of device-time in each role over the whole run."""
        return self.timeline.utilisation()

    def throughput(self) -> dict[str, float]:
        """Trained samples per second, trained tokens per second and generated tokens per second."""
        total = self.total_seconds or 1.0
        return {"samples_per_s": sum(s.trained_samples for s in self.steps) / total,
                "trained_tokens_per_s": sum(s.trained_tokens for s in self.steps) / total,
                "generated_tokens_per_s": sum(s.generated_tokens for s in self.steps) / total}

    def summary(self) -> dict[str, Any]:
        """The figures a comparison table shows."""
        return {"scenario": self.scenario, "strategy": self.strategy, "variant": self.variant, "gpus": self.gpus,
                "controllers": self.controllers, "steps": len(self.steps), "total_s": self.total_seconds,
                "mean_step_s": self.mean_step_seconds, "mean_waves": float(np.mean([s.waves for s in self.steps])),
                "phases": self.mean_phases(), "utilisation": self.utilisation(), "throughput": self.throughput()}

    def to_dict(self) -> dict[str, Any]:
        """Summary plus every step record (JSON-friendly)."""
        out = self.summary()
        out["step_records"] = [dict(asdict(s), seconds=s.seconds) for s in self.steps]
        return out

"""The distributions a workload draws from: token lengths and latencies, log-normal (a long right tail, as
response lengths and tool calls have), clipped."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: log-normal with the given median and log-space sigma, rounded, clipped to [min, max]."""

    median: float = field(default=512.0, metadata={"help": "Median length in tokens (before clipping)."})
    sigma: float = field(default=0.5, metadata={"help": "Standard deviation of log(length); 0 gives a fixed length. ~1 gives a long tail."})
    max: int = field(default=4096, metadata={"help": "Largest length (max_new_tokens for responses); longer draws are cut here."})
    min: int = field(default=1, metadata={"help": "Smallest length."})

    def validate(self) -> None:
        if not self.median > 0:
            raise ConfigError("median", f"must be > 0, got {self.median}")
        if self.sigma < 0:
            raise ConfigError("sigma", f"must be >= 0, got {self.sigma}")
        if self.min < 1 or self.max < self.min:
            raise ConfigError("max", f"need 1 <= min <= max, got min={self.min}, max={self.max}")

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...], scale: float | np.ndarray = 1.0) -> np.ndarray:
        """Integer lengths of the given shape; `scale` (a number, or an array that broadcasts to `shape`)
        multiplies the median (drift over training, a heavier shard)."""
        raw = self.median * scale * np.exp(self.sigma * rng.standard_normal(shape))
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class LatencyDistribution:
    """Seconds: log-normal with the given median and log-space sigma, clipped to [0, max_s]."""

    median_s: float = field(default=1.0, metadata={"help": "Median seconds."})
    sigma: float = field(default=1.0, metadata={"help": "Standard deviation of log(seconds); 0 gives a fixed latency, 1.5 a long tail (a few calls 20x the median)."})
    max_s: float = field(default=60.0, metadata={"help": "Longest latency (a call's timeout): longer draws are cut here."})

    def validate(self) -> None:
        if not self.median_s >= 0:
            raise ConfigError("median_s", f"must be >= 0, got {self.median_s}")
        if not self.sigma >= 0:
            raise ConfigError("sigma", f"must be >= 0, got {self.sigma}")
        if not self.max_s >= 0:
            raise ConfigError("max_s", f"must be >= 0, got {self.max_s}")

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.clip(self.median_s * np.exp(self.sigma * rng.standard_normal(shape)), 0.0, self.max_s)

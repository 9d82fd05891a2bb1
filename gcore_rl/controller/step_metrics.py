"""One step's measurements on one controller, collected in one object and merged once.

The loop fills a `StepMetrics` as the phases finish; `reduce` turns it into the step's line of
`metrics.jsonl`: every controller's numbers merged in a fixed order, all-reduced over the
controllers (sums for counts, maxima for `*max`, means otherwise) and the reward statistics and
the other per-sample means (accuracy, judge and reward-model scores, overlong penalty) pooled over
all samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gcore_rl.controller.program import is_summed, pool_reward_stats, sample_mean_count, weight_sample_means
from gcore_rl.distributed import DistInfo, all_reduce_mean
from gcore_rl.telemetry.metrics import peak_rss_mib

THROUGHPUT = {"rollout/generated_tokens": "throughput/tokens_per_s", "rollout/generated_images": "throughput/images_per_s"}
"""The step's rates: what the policy generated (a language policy's tokens, a diffusion policy's images) per second."""


@dataclass
class StepMetrics:
    """What one controller measured in one step (each field a group of `metrics.jsonl` keys)."""

    rollout: dict[str, float]
    """Rewards, accuracy and dynamic-sampling statistics of everything generated (`StepRollout.stats`)."""
    batch: dict[str, float] = field(default_factory=dict)
    """Lengths, truncation and staleness of the trained completions (`rollout_metrics`)."""
    train: dict[str, float] = field(default_factory=dict)
    """The trainer workers' update statistics (loss, clip fraction, KL, log-prob gap)."""
    phases: dict[str, float] = field(default_factory=dict)
    """`time/<phase>` seconds of the controller's phases."""
    placement: dict[str, float] = field(default_factory=dict)
    """Dynamic placement: the split used, the next one and the loads behind the choice."""
    data: dict[str, float] = field(default_factory=dict)
    """Prompts truncated or dropped to fit the context (the shard's, every step)."""
    devices: dict[str, float] = field(default_factory=dict)
    """Busy / swap / idle seconds, work counts and memory of the slice's devices (`device_utilisation`)."""
    step_seconds: float = 0.0

    def local(self) -> dict[str, float]:
        """This controller's metrics as one flat dict."""
        merged = {**self.rollout, **self.batch, **self.train, **self.phases, **self.placement, **self.data,
                  "time/step": self.step_seconds, **self.devices}
        merged["memory/controller_peak_rss_mib_max"] = peak_rss_mib()
        for count, rate in THROUGHPUT.items():
            if count in merged:
                merged[rate] = merged[count] / self.step_seconds
        return merged

    def reduce(self, info: DistInfo) -> dict[str, float]:
        """The step's metrics over all controllers (a collective: every controller calls it)."""
        local = self.local()
        summed = frozenset(key for key in local if is_summed(key) or sample_mean_count(key) is not None)
        return pool_reward_stats(all_reduce_mean(weight_sample_means(local), info.device, sum_keys=summed))


def device_utilisation(devices: dict[str, float], controller: dict[str, float]) -> dict[str, float]:
    """The slice's device utilisation (`SliceClient.utilisation`) with the controller's own reward and
    waiting time (`TimelineRecorder.utilisation` of the controller).

    A device is idle while its controller waits for the others, so that wait is taken out of the
    device's idle time and reported as `util/wait_s`.
    """
    out = dict(devices)
    wait = controller["util/wait_s"]
    out["util/wait_s"] = wait
    out["util/idle_s"] = max(out.get("util/idle_s", 0.0) - wait, 0.0)
    if "util/rewards/busy_s" in controller:
        out["util/rewards/busy_s"] = controller["util/rewards/busy_s"]
    return out

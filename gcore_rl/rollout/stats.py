"""What a generation engine did: counts and timed decode rounds, summed over calls, for the work counters
and dynamic placement's engine fit (`gcore_rl.costmodel.replay.fit_engine`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gcore_rl.records import Completion
from gcore_rl.rollout.sampling import SamplingConfig

if TYPE_CHECKING:
    from gcore_rl.rollout.protocol import RolloutEngine


@dataclass
class EngineStats:
    """What an engine's generate calls did (`RolloutEngine.take_stats`); sums over calls with `+`.

    Counts: `decode_steps` forwards that decode, `prefills` forwards that prefill (one per admission, or per
    chunk), `prefill_rows` prompts prefilled, `prefill_tokens` positions they computed, `generated_tokens`,
    `sample_steps` sampling rounds, `peak_batch` the most sequences decoded together. `round_batches` /
    `round_seconds`: live rows and wall time of each decode round without a prefill. `longest`: the decode
    steps on the calls' critical path (the longest completion of each call, summed over calls, which run one
    after another). `cached_tokens`: prompt positions taken from the prefix cache instead of prefilled.
    `host_syncs`: times the decode loop waited to read the device (its checks for finished rows).
    """

    decode_steps: int = 0
    prefills: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    sample_steps: int = 0
    peak_batch: int = 0
    round_batches: list[int] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    longest: int = 0
    calls: int = 0
    cached_tokens: int = 0
    host_syncs: int = 0

    @property
    def mean_batch(self) -> float:
        """Sequences per decode step on average (how full continuous batching kept the batch)."""
        return self.generated_tokens / max(1, self.sample_steps)

    @property
    def fixed_seconds(self) -> float:
        """Seconds that a smaller share of the prompts would not have saved: the critical path's decode steps
        × the per-step cost at a batch of zero (`fixed_step_seconds`)."""
        return self.longest * fixed_step_seconds(self.round_batches, self.round_seconds)

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(
            decode_steps=self.decode_steps + other.decode_steps, prefills=self.prefills + other.prefills,
            prefill_rows=self.prefill_rows + other.prefill_rows, prefill_tokens=self.prefill_tokens + other.prefill_tokens,
            generated_tokens=self.generated_tokens + other.generated_tokens,
            sample_steps=self.sample_steps + other.sample_steps, peak_batch=max(self.peak_batch, other.peak_batch),
            round_batches=self.round_batches + other.round_batches, round_seconds=self.round_seconds + other.round_seconds,
            longest=self.longest + other.longest, calls=self.calls + other.calls,
            cached_tokens=self.cached_tokens + other.cached_tokens, host_syncs=self.host_syncs + other.host_syncs)


def fixed_step_seconds(batches: Sequence[int], seconds: Sequence[float]) -> float:
    """Intercept of a least-squares line `seconds ≈ a + b × batch` over decode rounds: the part of a
    decode step that does not grow with the batch (weights read, launch and Python overhead).

    Needs rounds at 3 or more batch sizes (a long tail provides them); otherwise returns 0, i.e.
    all work counts as divisible. Clamped to [0, the fastest round].
    """
    if len(set(batches)) < 3:
        return 0.0
    n = len(batches)
    mean_x, mean_y = sum(batches) / n, sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in batches)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(batches, seconds, strict=True)) / var
    return min(max(mean_y - slope * mean_x, 0.0), min(seconds))


def counted_stats(completions: Sequence[Completion]) -> EngineStats:
    """What the caller can count of a rollout whose engine keeps no statistics: the policy's tokens (loss
    mask 1) as generated, every sampled row's prompt as prefilled once, and the longest completion's policy
    tokens as the decode steps. No decode rounds (so no fixed per-step time)."""
    policy = [c.policy_token_count for c in completions]
    return EngineStats(decode_steps=max(policy, default=0), prefills=1 if completions else 0,
                       prefill_rows=len(completions), prefill_tokens=sum(len(c.prompt_ids) for c in completions),
                       generated_tokens=sum(policy), sample_steps=max(policy, default=0),
                       peak_batch=len(completions), longest=max(policy, default=0), calls=1 if completions else 0)


PROBE_BATCHES = (1, 4, 16)
"""Batch sizes `probe_rounds` times decode steps at."""


def probe_rounds(engine: RolloutEngine, token_id: int, batches: Sequence[int] = PROBE_BATCHES,
                 steps: int = 8) -> tuple[list[int], list[float]]:
    """Decode rounds timed at several batch sizes: (batch sizes, seconds), one entry per round; empty for a
    backend that keeps no statistics. The prompts repeat `token_id`, a token of the engine's own vocabulary
    (its pad id).

    A run's own rounds often have one batch size (every row of a call writes the same number of tokens),
    from which the split of a decode step into its fixed and its per-sequence part cannot be told; these
    rounds give the line its slope (`gcore_rl.costmodel.replay.fit_engine`). One untimed call first takes the
    first forwards' one-off costs. Rows never stop early (`ignore_eos`), so each call's rounds share its
    batch size.
    """
    sampling = SamplingConfig(n=1, max_new_tokens=steps, temperature=1.0, ignore_eos=True)
    engine.generate([[token_id] * 4], sampling, seed=0)
    engine.take_stats()
    sizes: list[int] = []
    seconds: list[float] = []
    for batch in batches:
        engine.generate([[token_id] * 4] * batch, sampling, seed=0)
        stats = engine.take_stats()
        if stats is None:
            return [], []
        sizes.extend(stats.round_batches)
        seconds.extend(stats.round_seconds)
    return sizes, seconds

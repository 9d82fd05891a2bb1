"""Generative reward model (LLM judge): the pure text side.

A judge model reads the prompt and completion rendered through `JudgeConfig.template` and writes
a verdict such as ``score: 7``. This module renders judge prompts, parses verdict text into a
reward in [0, 1], summarises a batch of verdicts and combines named reward components by weight.
Generating the verdicts (with a judge engine) happens elsewhere.

Template rendering never calls `str.format` on user text: the template is split into literal
text and ``{field}`` placeholders once, and the prompt, completion and answer are inserted
verbatim, so braces inside them are kept literally.

Verdicts are matched case-insensitively (`re.IGNORECASE`), so ``Score = 4`` and ``SCORE: 4``
parse like ``score: 4``. The first match of `verdict_pattern` in the text decides the verdict.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gcore_rl.errors import ConfigError
from gcore_rl.records import Verdict
from gcore_rl.rewards.judge_template import template_fields
from gcore_rl.rollout.backends import EngineConfig


@dataclass
class JudgeConfig:
    """An LLM judge that scores completions; its parsed score becomes a reward in [0, 1]."""

    enabled: bool = field(default=False, metadata={"help": "Score completions with a generative judge model."})
    model_path: str | None = field(
        default=None, metadata={"help": "Local Hugging Face folder of the judge model (required when enabled)."}
    )
    template: str = field(
        default="Q:{prompt} A:{completion} score:",
        metadata={
            "help": "Judge prompt with placeholders {prompt}, {completion} (required) and {answer} "
            "(empty when the row has none); write {{ and }} for literal braces."
        },
    )
    verdict_pattern: str = field(
        default=r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
        metadata={
            "help": "Regular expression (matched case-insensitively) whose group 1 is the score; "
            "the first match in the verdict wins."
        },
    )
    score_min: float = field(default=0.0, metadata={"help": "Lowest judge score; lower scores are clamped to it (reward 0)."})
    score_max: float = field(default=10.0, metadata={"help": "Highest judge score; higher scores are clamped to it (reward 1)."})
    unparsed_score: float = field(
        default=0.0, metadata={"help": "Reward (0..1 scale) for a verdict whose score cannot be parsed."}
    )
    weight: float = field(default=1.0, metadata={"help": "Multiplier of the judge reward when combined with other rewards."})
    max_new_tokens: int = field(default=8, metadata={"help": "Most tokens the judge may generate per verdict."})
    temperature: float = field(default=0.0, metadata={"help": "Judge sampling temperature (0: greedy verdicts)."})
    added_seconds_per_sample: float = field(default=0.0, metadata={"help": "Experiments: the judge device also waits this long per judged sample (counted as judge time), to emulate a judge slower than the policy."})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "The judge's generation engine: its backend and capacity, as the policy's `engine`."})

    def validate(self) -> None:
        if self.enabled and not (isinstance(self.model_path, str) and self.model_path.strip()):
            raise ConfigError("model_path", "is required when the judge is enabled")
        fields = template_fields(self.template)
        if "completion" not in fields:
            raise ConfigError("template", "must contain the {completion} placeholder")
        _compile_pattern(self.verdict_pattern)
        for key in ("score_min", "score_max", "unparsed_score", "weight", "temperature", "added_seconds_per_sample"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(key, f"must be a finite number, got {value!r}")
        if self.score_max <= self.score_min:
            raise ConfigError("score_max", f"must be greater than score_min ({self.score_min}), got {self.score_max}")
        if not 0.0 <= self.unparsed_score <= 1.0:
            raise ConfigError("unparsed_score", f"must be between 0 and 1 (a reward), got {self.unparsed_score}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be a positive integer, got {self.max_new_tokens!r}")
        for key in ("temperature", "added_seconds_per_sample"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")


@functools.lru_cache(maxsize=64)
def _compile_pattern(pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ConfigError("verdict_pattern", f"must be a string, got {type(pattern).__name__}")
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise ConfigError("verdict_pattern", f"is not a valid regular expression: {exc}") from None
    if compiled.groups < 1:
        raise ConfigError("verdict_pattern", "needs a capturing group (group 1 is the score)")
    return compiled


def parse_verdict(text: str, cfg: JudgeConfig) -> Verdict:
    """Parse the first match of `cfg.verdict_pattern` in `text` into a Verdict.

    No match, an empty group 1, or a number that is not finite (nan, inf) gives parsed=False and
    reward `cfg.unparsed_score`. Numbers outside [score_min, score_max] are clamped (parsed=True).
    """
    pattern = _compile_pattern(cfg.verdict_pattern)
    text = "" if text is None else str(text)
    unparsed = Verdict(score=None, reward=float(cfg.unparsed_score), parsed=False, text=text)
    match = pattern.search(text)
    if match is None or match.group(1) is None:
        return unparsed
    try:
        score = float(match.group(1).strip())
    except ValueError:
        return unparsed
    if not math.isfinite(score):
        return unparsed
    lo, hi = float(cfg.score_min), float(cfg.score_max)
    clamped = min(max(score, lo), hi)
    return Verdict(score=score, reward=(clamped - lo) / (hi - lo), parsed=True, text=text)


@dataclass(frozen=True)
class VerdictStats:
    """Batch summary: number of verdicts, how many did not parse, and the mean reward (0.0 if empty)."""

    count: int
    unparsed: int
    mean_reward: float


def summarise_verdicts(verdicts: Sequence[Verdict]) -> VerdictStats:
    """Count verdicts and unparsed ones and average their rewards (unparsed ones included)."""
    count = len(verdicts)
    unparsed = sum(1 for v in verdicts if not v.parsed)
    mean = sum(v.reward for v in verdicts) / count if count else 0.0
    return VerdictStats(count=count, unparsed=unparsed, mean_reward=mean)


def combine_rewards(components: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[float]:
    """Weighted per-sample sum of named reward components (rule functions, scalar RM, judge, ...).

    All components must have the same length and every component needs a finite weight, else
    ValueError naming the offending component. Weights for absent components are ignored. No
    components gives an empty list.
    """
    expected: int | None = None
    first = ""
    for name, values in components.items():
        if name not in weights:
            raise ValueError(f"reward component {name!r} has no weight")
        weight = weights[name]
        if not math.isfinite(weight):
            raise ValueError(f"reward component {name!r} has a non-finite weight {weight}")
        if expected is None:
            expected, first = len(values), name
        elif len(values) != expected:
            raise ValueError(
                f"reward component {name!r} has {len(values)} values but {first!r} has {expected}"
            )
    total = [0.0] * (expected or 0)
    for name, values in components.items():
        weight = float(weights[name])
        for i, value in enumerate(values):
            total[i] += weight * float(value)
    return total

"""Generative reward model (LLM judge): the model side.

`JudgeRewarder` renders each sample through `JudgeConfig.template`, lets a judge model generate a
short verdict with an engine of the backend `judge.engine.backend` (a `RolloutEngine`), and parses it
with `parse_verdict`.

What is parsed. A judge prompt usually ends with the verdict's label (the default template ends
in ``score:``), so the judge writes only the number. The rewarder therefore parses
``trailing + generation``, where ``trailing`` is the template's literal text after its last
placeholder (``" score:"`` for the default template). ``trailing`` comes from the configuration
only, never from the prompt or the policy's completion, so a completion that contains
``score: 10`` cannot inject a verdict. A judge that writes the full ``score: 7`` itself also
parses (the first match wins and ``" score:score: 7"`` matches at the second label). The
returned `Verdict.text` is the judge's raw generation (special tokens removed).

Images. A vision-language judge (a Qwen2-VL folder: `JudgeRewarder.from_config` loads its image
processor) sees the images of a sample: the policy prompt's images (`row["images"]`, matching the
`<image>` placeholders that the rendered `{prompt}` carries), and, when the completion itself is an
image (a diffusion policy's `[H, W, 3]` array in [0, 1]), that image in place of `{completion}`. A
text-only judge reads the placeholders as text and is refused image completions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from gcore_rl.errors import RewardError
from gcore_rl.models.vision import VisionProcessor
from gcore_rl.records import RewardInput, Verdict
from gcore_rl.rewards.judge import JudgeConfig, VerdictStats, parse_verdict, summarise_verdicts
from gcore_rl.rewards.judge_template import is_image, parse_template, render_sample, sample_images
from gcore_rl.rewards.kinds import RewardKind, register_reward_kind
from gcore_rl.rollout.backends import EngineSource, build_engine, engine_dtype
from gcore_rl.rollout.protocol import RolloutEngine
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.rollout.stats import EngineStats, counted_stats


def template_trailing_text(template: str) -> str:
    """The literal text after the last placeholder of `template` (the whole text if it has none)."""
    # `string.Formatter().parse` yields (literal, placeholder) pieces, each literal preceding its
    # placeholder; an escaped brace splits a literal into several pieces without a placeholder.
    trailing: list[str] = []
    for literal, name in parse_template(template):
        trailing = [] if name is not None else [*trailing, literal]
    return "".join(trailing)


class JudgeRewarder:
    """Scores samples with a generative judge model.

    Args:
        cfg: the judge configuration (template, verdict pattern, score range, sampling).
        engine: a `RolloutEngine` serving the judge model.
        tokenizer: the judge model's tokenizer (prompts encoded without special tokens).
        seed: optional sampling seed (only matters when ``cfg.temperature > 0``).
        processor: the judge's image processor (a vision-language judge), else None.
    """

    def __init__(self, cfg: JudgeConfig, engine: RolloutEngine, tokenizer, seed: int | None = None,
                 processor: VisionProcessor | None = None):
        cfg.validate()
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.processor = processor
        self.seed = seed
        self.trailing = template_trailing_text(cfg.template)
        self.sampling = SamplingConfig(n=1, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        self.sampling.validate()
        self._counted = EngineStats()  # what `score` saw of its calls, for a backend that keeps no statistics

    @classmethod
    def from_config(cls, cfg: JudgeConfig, device: torch.device | str = "cpu", seed: int | None = None) -> JudgeRewarder:
        """Load the judge model and tokenizer from `cfg.model_path` (a local HF folder) onto `device`."""
        from gcore_rl.errors import ConfigError
        from gcore_rl.models.loading import load_tokenizer, read_model_config
        from gcore_rl.models.vision import is_vision_config

        if not (isinstance(cfg.model_path, str) and cfg.model_path.strip()):
            raise ConfigError("model_path", "is required to load a judge model")
        tokenizer = load_tokenizer(cfg.model_path)
        engine = build_engine(cfg.engine, EngineSource(cfg.model_path, torch.device(device), tokenizer.eos_token_id,
                                                        tokenizer.pad_token_id, engine_dtype(cfg.engine, "float32")),
                              key="judge.engine.backend")
        processor = None
        if is_vision_config(read_model_config(cfg.model_path)):
            processor = VisionProcessor.from_model_dir(cfg.model_path, tokenizer)
        return cls(cfg, engine, tokenizer, seed=seed, processor=processor)

    def render(self, sample: RewardInput) -> str:
        """The judge prompt of one sample (`render_sample`: an image completion is an `IMAGE_PLACEHOLDER`)."""
        return render_sample(self.cfg.template, sample)

    def encode(self, sample: RewardInput) -> Sequence[int]:
        """The judge prompt's token ids: a `VisionPrompt` with the sample's images for a vision-language judge."""
        text = self.render(sample)
        images = sample_images(sample)
        if self.processor is None and is_image(sample.completion):
            raise RewardError("the judge is a text-only model and the completion is an image; use a "
                              "vision-language judge (judge.model_path: a Qwen2-VL folder)")
        if self.processor is None or not images:
            return self.tokenizer.encode(text, add_special_tokens=False)
        try:
            return self.processor.encode(text, images)
        except ValueError as exc:
            raise RewardError(f"judge prompt: {exc} (judge.template and the row's images must agree)") from exc

    def parse(self, generation: str) -> Verdict:
        """Parse one judge generation (see the module docstring); `Verdict.text` is `generation`."""
        verdict = parse_verdict(self.trailing + generation, self.cfg)
        return dataclasses.replace(verdict, text=generation)

    def score(self, samples: Sequence[RewardInput]) -> tuple[list[Verdict], VerdictStats]:
        """One verdict per sample (input order) and their summary."""
        if not samples:
            return [], summarise_verdicts([])
        prompts = [self.encode(s) for s in samples]
        completions = self.engine.generate(prompts, self.sampling, seed=self.seed)
        self._counted = self._counted + counted_stats(completions)
        verdicts = [
            dataclasses.replace(self.parse(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)),
                                prompt_tokens=len(prompt), tokens=len(c.token_ids))
            for prompt, c in zip(prompts, completions, strict=True)
        ]
        return verdicts, summarise_verdicts(verdicts)

    def take_stats(self) -> EngineStats:
        """What the judge's engine did since the last take: its own statistics, or, for a backend that keeps
        none, what the verdicts' completions tell (`counted_stats`)."""
        stats = self.engine.take_stats()
        counted, self._counted = self._counted, EngineStats()
        return stats if stats is not None else counted


# ---- the judge as a model reward kind (`gcore_rl.rewards.kinds`) --------------------------------------------


class JudgeScorer:
    """The job's judge on a device, as a `RewardScorer`: its verdicts, and the per-sample wait
    `judge.added_seconds_per_sample` (experiments: a judge slower than the policy)."""

    def __init__(self, judge: JudgeRewarder):
        self.judge = judge
        self.engine = judge.engine
        self.pad_id = judge.tokenizer.pad_token_id

    @property
    def resident(self) -> RolloutEngine:
        return self.judge.engine

    def score(self, samples: Sequence[RewardInput]) -> list[Verdict]:
        verdicts, _ = self.judge.score(samples)
        time.sleep(self.judge.cfg.added_seconds_per_sample * len(samples))
        return verdicts

    def take_stats(self) -> EngineStats:
        return self.judge.take_stats()


def _check_judge(cfg) -> None:
    from gcore_rl.models.loading import load_tokenizer
    from gcore_rl.rollout.backends import engine_builder

    load_tokenizer(cfg.judge.model_path)
    engine_builder(cfg.judge.engine, "judge.engine.backend")


def _build_judge(cfg, device, seed: int) -> JudgeScorer:
    return JudgeScorer(JudgeRewarder.from_config(cfg.judge, device, seed=seed))


JUDGE = register_reward_kind(RewardKind(name="judge", section=lambda cfg: cfg.judge, build=_build_judge,
                                        check=_check_judge, generates=True, engine=lambda cfg: cfg.judge.engine))

"""Scalar reward model: a sequence-classification head that scores a whole sample with one number.

A scalar reward model (RM) is a Hugging Face ``AutoModelForSequenceClassification`` with one
label (``num_labels=1``), e.g. a Bradley–Terry model trained on preference pairs. The sample is
rendered through `RewardModelConfig.template` (placeholders as for the judge: ``{prompt}``,
``{completion}``, ``{answer}``), tokenised, and the head's logit at the last token is the raw
score. `RewardModelConfig.transform` maps it to the reward: ``raw`` keeps the logit, ``sigmoid``
squashes it into (0, 1) (the Bradley–Terry probability of beating a sample of score 0), which
puts it on the scale of 0/1 rule rewards and judge verdicts before weighting.

Batches are left-padded with explicit position ids (counted from each sample's first real
token), so a sample's score does not depend on what it is batched with, and the last position
of every row is its last real token.

Images. A reward model that reads images is a vision-language model with a scalar head
(`gcore_rl.models.vision_reward`, trained by ``gcore-rl rm`` from a Qwen2-VL policy): it scores the
rendered text with the sample's images (`gcore_rl.rewards.judge_template.sample_images`: the prompt
row's, and a diffusion policy's image completion in place of ``{completion}``), M-RoPE positions and
all, through the same padding and pooling. A text-only reward model reads a row's ``<image>``
placeholders as text and is refused image completions.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from gcore_rl.errors import ConfigError, ModelLoadError, RewardError
from gcore_rl.models.residency import HostOffload
from gcore_rl.models.vision import VisionProcessor, is_vision_config
from gcore_rl.models.vision_reward import (
    check_vision_reward_dir,
    is_vision_reward_dir,
    load_vision_reward_model,
)
from gcore_rl.records import RewardInput, Verdict, prompt_images
from gcore_rl.rewards.judge_template import is_image, render_sample, sample_images, template_fields
from gcore_rl.rewards.kinds import RewardKind, register_reward_kind

GROUP_SOFTMAX = "group_softmax"
"""The transform taken over each prompt's samples (`group_softmax`), not sample by sample."""
TRANSFORMS = ("raw", "sigmoid", GROUP_SOFTMAX)


@dataclass
class RewardModelConfig:
    """A scalar reward model (sequence-classification head); its transformed score is added with `weight`."""

    enabled: bool = field(default=False, metadata={"help": "Score completions with a scalar reward model."})
    model_path: str | None = field(
        default=None,
        metadata={"help": "Local Hugging Face folder of a sequence-classification model with num_labels=1 (required when enabled)."},
    )
    template: str = field(
        default="{prompt}{completion}",
        metadata={"help": "Text the reward model scores, with placeholders {prompt}, {completion} (required) and {answer}."},
    )
    transform: Literal["raw", "sigmoid", "group_softmax"] = field(
        default="sigmoid",
        metadata={"help": "raw: the head's logit is the reward; sigmoid: squash it into (0, 1); group_softmax: the probability, with the logits as Bradley–Terry strengths, that the sample's answer ranks first among the distinct answers sampled for its prompt (needs sampling.n >= 2; a hedge the model half-likes on every prompt earns little)."},
    )
    weight: float = field(default=1.0, metadata={"help": "Multiplier of the reward model's score when combined with other rewards."})
    batch_size: int = field(default=64, metadata={"help": "Samples per forward pass of the reward model."})
    max_length: int = field(default=1024, metadata={"help": "Longest scored text in tokens; longer ones keep their last max_length tokens."})
    add_special_tokens: bool = field(
        default=False, metadata={"help": "Let the tokenizer add its special tokens (e.g. BOS) as the reward model was trained."}
    )

    def validate(self) -> None:
        if self.enabled and not (isinstance(self.model_path, str) and self.model_path.strip()):
            raise ConfigError("model_path", "is required when the reward model is enabled")
        if "completion" not in template_fields(self.template):
            raise ConfigError("template", "must contain the {completion} placeholder")
        if self.transform not in TRANSFORMS:
            raise ConfigError("transform", f"must be one of {', '.join(TRANSFORMS)}, got {self.transform!r}")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or not math.isfinite(self.weight):
            raise ConfigError("weight", f"must be a finite number, got {self.weight!r}")
        for key in ("batch_size", "max_length"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(key, f"must be a positive integer, got {value!r}")


def check_reward_model_dir(path: str) -> None:
    """Raise ModelLoadError unless `path` is a local model folder whose config declares one sequence-classification
    output, or a vision reward model (`gcore_rl.models.vision_reward`).

    Reads only ``config.json`` (cheap enough for the driver to check before any process starts).
    """
    import json

    from gcore_rl.models.loading import check_model_dir

    config = json.loads((check_model_dir(path) / "config.json").read_text())
    if is_vision_config(config):
        check_vision_reward_dir(path)
        return
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ModelLoadError(f"reward model '{path}' is not a sequence-classification model (architectures: "
                             f"{architectures or 'none'}); train one with `gcore-rl rm` or point "
                             "reward_model.model_path at a folder saved from AutoModelForSequenceClassification")
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if labels != 1:
        raise ModelLoadError(f"reward model '{path}' has {labels} labels; a scalar reward model needs a single "
                             "output (num_labels=1)")


def load_reward_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a sequence-classification model with a single output from a local folder (never the hub).

    Raises ModelLoadError naming `path` when the folder is not a model, the architecture has no
    sequence-classification class, or the head has more than one label.
    """
    from transformers import AutoModelForSequenceClassification

    from gcore_rl.models.loading import check_model_dir

    model_dir = check_model_dir(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load a sequence-classification reward model from '{model_dir}': {exc}") from exc
    if model.config.num_labels != 1:
        raise ModelLoadError(f"reward model '{model_dir}' has num_labels={model.config.num_labels}; a scalar reward "
                             "model needs a single output (num_labels=1)")
    model.requires_grad_(False)
    return model.eval().to(device)


def left_pad(sequences: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded `[B, T]` input ids, attention mask and position ids (0 at each row's first real token)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def last_token_scores(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The head's output at the last position of each left-padded row, `[B]` (fp32)."""
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0].float()


class ScalarRewardModel(HostOffload):
    """Scores samples with a sequence-classification reward model (see the module docstring), or with a
    vision reward model (`gcore_rl.models.vision_reward`) that also reads the samples' images; it sleeps
    and wakes like an engine on a time-shared device (`HostOffload`).

    Args:
        model: a sequence-classification model with one output, or a `VisionRewardModel`.
        processor: the vision reward model's `VisionProcessor` (None for a text model).
    """

    def __init__(self, cfg: RewardModelConfig, model, tokenizer, device: torch.device | str = "cpu",
                 processor: VisionProcessor | None = None):
        cfg.validate()
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.device = torch.device(device)
        self.state = "awake"  # or "offloaded" (time-shared devices, see `sleep`)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        # HF pools at the rightmost non-pad token: with left padding that is the last position, as long as
        # the model knows the pad id (some configs leave it unset, and then refuse batches larger than one)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.pad_id

    @classmethod
    def from_config(cls, cfg: RewardModelConfig, device: torch.device | str = "cpu") -> ScalarRewardModel:
        from gcore_rl.models.loading import load_tokenizer

        if not (isinstance(cfg.model_path, str) and cfg.model_path.strip()):
            raise ConfigError("model_path", "is required to load a reward model")
        tokenizer = load_tokenizer(cfg.model_path)
        if is_vision_reward_dir(cfg.model_path):
            return cls(cfg, load_vision_reward_model(cfg.model_path, device), tokenizer, device,
                       VisionProcessor.from_model_dir(cfg.model_path, tokenizer))
        return cls(cfg, load_reward_model(cfg.model_path, device), tokenizer, device)

    def render(self, sample: RewardInput) -> str:
        return render_sample(self.cfg.template, sample)

    def encode(self, sample: RewardInput) -> Sequence[int]:
        """The token ids the model scores: the rendered text's last `max_length` tokens, or for a vision
        reward model and a sample with images a `VisionPrompt` (whose image tokens are never cut).

        Raises RewardError for an image completion given to a text model, images that do not pair up
        with the text's placeholders, or a sample with images longer than `max_length`."""
        text = self.render(sample)
        images = sample_images(sample)
        if self.processor is None and is_image(sample.completion):
            raise RewardError("the reward model is a text-only model and the completion is an image; use a vision "
                              "reward model (reward_model.model_path: a folder `gcore-rl rm` trained from a Qwen2-VL "
                              "policy)")
        if self.processor is None or not images:
            ids = self.tokenizer.encode(text, add_special_tokens=self.cfg.add_special_tokens)[-self.cfg.max_length:]
            return ids or [self.pad_id]
        try:
            encoded = self.processor.encode(text, images)
        except ValueError as exc:
            raise RewardError(f"reward model input: {exc} (reward_model.template and the row's images must "
                              "agree)") from exc
        if len(encoded) > self.cfg.max_length:
            raise RewardError(f"a sample with images is {len(encoded)} tokens long, over reward_model.max_length="
                              f"{self.cfg.max_length}; image tokens cannot be cut off: raise max_length")
        return encoded

    def forward_scores(self, encoded: Sequence[Sequence[int]]) -> torch.Tensor:
        """Raw scores `[B]` (fp32) of encoded samples (`encode`) in one left-padded batch; differentiable
        when gradients are on (the reward-model trainer uses this very function)."""
        ids, mask, positions = left_pad([list(e) for e in encoded], self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.processor is not None:
            return self.model(ids, mask, [prompt_images(e) for e in encoded])
        return last_token_scores(self.model, ids, mask, positions.to(self.device))

    @torch.no_grad()
    def raw_scores(self, samples: Sequence[RewardInput]) -> list[float]:
        """The head's logit for each sample (input order)."""
        if self.state != "awake":
            raise RuntimeError("the reward model is asleep (offloaded); call wake() before scoring")
        encoded = [self.encode(s) for s in samples]
        # batch samples of similar length together: less padding, same scores
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        scores = [0.0] * len(encoded)
        for start in range(0, len(order), self.cfg.batch_size):
            chunk = order[start:start + self.cfg.batch_size]
            for i, value in zip(chunk, self.forward_scores([encoded[i] for i in chunk]).tolist(), strict=True):
                scores[i] = value
        return scores

    def score(self, samples: Sequence[RewardInput]) -> list[float]:
        """The reward of each sample: the transformed raw score (input order)."""
        return [transform_score(s, self.cfg.transform) for s in self.raw_scores(samples)]


def transform_score(raw: float, transform: str) -> float:
    """`raw` (a logit) mapped to a reward: unchanged for ``raw`` (and for ``group_softmax``, which the controller
    applies over each prompt's samples: `group_softmax`), ``1 / (1 + e^-raw)`` for ``sigmoid``."""
    if transform in ("raw", GROUP_SOFTMAX):
        return float(raw)
    if transform == "sigmoid":
        return 1.0 / (1.0 + math.exp(-raw)) if raw >= 0 else math.exp(raw) / (1.0 + math.exp(raw))
    raise ValueError(f"unknown reward-model transform {transform!r}")


def group_softmax(scores: Sequence[float], groups: Sequence[int], answers: Sequence[Hashable]) -> list[float]:
    """Each sample's reward under ``transform: group_softmax``: the Plackett–Luce probability, with the raw scores
    as log-strengths, that its answer ranks first among the distinct answers of its group,
    ``exp(s_a) / sum over the group's distinct answers a' of exp(s_a')``.

    `scores`, `groups` (a sample's prompt) and `answers` (what makes two samples the same answer: their token
    ids) are per sample. A sample repeating an answer shares that answer's value (the first sample's score
    stands for it), so a group that agrees gets 1 everywhere and no advantage; a wrong answer the model half-likes
    on every prompt gets little wherever a better one was sampled beside it, unlike its sigmoid score.
    """
    strength: dict[tuple[int, Hashable], float] = {}
    for score, group, answer in zip(scores, groups, answers, strict=True):
        strength.setdefault((group, answer), float(score))
    top: dict[int, float] = {}
    for (group, _), score in strength.items():
        top[group] = max(top.get(group, -math.inf), score)
    total: dict[int, float] = {}
    for (group, _), score in strength.items():
        total[group] = total.get(group, 0.0) + math.exp(score - top[group])
    return [math.exp(strength[group, answer] - top[group]) / total[group] for group, answer in zip(groups, answers, strict=True)]


# ---- the scalar reward model as a model reward kind (`gcore_rl.rewards.kinds`) ------------------------------


class ScalarScorer:
    """The job's scalar reward model on a device, as a `RewardScorer`: each transformed score is a verdict
    (`Verdict.of_score`); it sleeps and wakes itself (`HostOffload`) and generates nothing."""

    engine = None
    pad_id = None

    def __init__(self, model: ScalarRewardModel):
        self.model = model

    @property
    def resident(self) -> ScalarRewardModel:
        return self.model

    def score(self, samples: Sequence[RewardInput]) -> list[Verdict]:
        return [Verdict.of_score(score) for score in self.model.score(samples)]

    def take_stats(self) -> None:
        return None


def _check_reward_model(cfg) -> None:
    from gcore_rl.models.loading import load_tokenizer

    check_reward_model_dir(cfg.reward_model.model_path)
    load_tokenizer(cfg.reward_model.model_path)


def _build_reward_model(cfg, device, seed: int) -> ScalarScorer:
    return ScalarScorer(ScalarRewardModel.from_config(cfg.reward_model, device))


REWARD_MODEL = register_reward_kind(RewardKind(name="reward_model", section=lambda cfg: cfg.reward_model,
                                               build=_build_reward_model, check=_check_reward_model))

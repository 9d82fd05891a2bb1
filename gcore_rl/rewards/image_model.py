"""A scalar image reward model: any `transformers` image classifier with one output, scoring images,
or a vision reward model that reads the prompt with the image.

An image classifier's folder is loaded with `AutoModelForImageClassification` (e.g. a ViT with
``num_labels=1``); images in [0, 1] are resized to the model's ``image_size`` and normalised to
[-1, 1] (mean 0.5, std 0.5 per channel, the ViT convention); the single logit is the score. A vision
reward model (`gcore_rl.models.vision_reward`, a Qwen2-VL with a scalar head, ``gcore-rl rm``) scores
the prompt's text followed by the image (`ScalarRewardModel` with the template
``{prompt}{completion}``, the image standing for {completion}); its raw head output is the score.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from gcore_rl.errors import ConfigError, ModelLoadError, RewardError
from gcore_rl.models.loading import read_model_config
from gcore_rl.models.vision import is_vision_config
from gcore_rl.models.vision_reward import check_vision_reward_dir, is_vision_reward_dir
from gcore_rl.records import RewardInput, Verdict
from gcore_rl.rewards.reward_model import RewardModelConfig, ScalarRewardModel


@dataclass
class ImageRewardModelConfig:
    """A scalar image reward model whose score is added to the rule rewards."""

    model_path: str | None = field(default=None, metadata={"help": "Folder of an image classifier with one output (AutoModelForImageClassification, num_labels=1), or of a vision reward model (`gcore-rl rm` from a Qwen2-VL policy: it reads the prompt with the image); None = no reward model."})
    weight: float = field(default=1.0, metadata={"help": "Multiplier of its score in the reward."})
    batch_size: int = field(default=64, metadata={"help": "Images scored per forward pass."})
    added_seconds_per_image: float = field(default=0.0, metadata={"help": "Testing and demonstration: the reward device waits this long per image it scores (a slower reward model, as judge.added_seconds_per_sample makes a slower judge)."})

    @property
    def enabled(self) -> bool:
        return self.model_path is not None

    def validate(self) -> None:
        if not math.isfinite(self.weight):
            raise ConfigError("weight", f"must be a finite number, got {self.weight}")
        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be at least 1, got {self.batch_size}")
        if not (math.isfinite(self.added_seconds_per_image) and self.added_seconds_per_image >= 0):
            raise ConfigError("added_seconds_per_image", f"must be a finite number >= 0, got {self.added_seconds_per_image}")


class ImageRewardModel:
    """Scores ``[B, 3, H, W]`` images in [0, 1] with a one-output image classifier (on `device`; images from any)."""

    def __init__(self, cfg: ImageRewardModelConfig, device: torch.device | str = "cpu"):
        from transformers import AutoModelForImageClassification

        path = Path(str(cfg.model_path))
        self.device = torch.device(device)
        self.path = path
        self.cfg = cfg
        self.reader: ScalarRewardModel | None = None  # a vision reward model: reads the prompt and the image
        if is_vision_reward_dir(path):
            self.reader = ScalarRewardModel.from_config(RewardModelConfig(
                enabled=True, model_path=str(path), template="{prompt}{completion}", transform="raw",
                batch_size=cfg.batch_size), self.device)
            return
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"image reward model '{path}' has no config.json; reward_model.model_path must be a "
                                 "transformers image-classification model folder")
        if is_vision_config(read_model_config(path)):
            check_vision_reward_dir(path)  # a vision-language folder without a (fitting) reward head: say so
        try:
            self.model = AutoModelForImageClassification.from_pretrained(path, dtype=torch.float32).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the image reward model at '{path}': {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        self.model.to(self.device)
        self.size = int(getattr(self.model.config, "image_size", 0) or 0)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str] | None = None) -> list[float]:
        """The score of each image ``[B, 3, H, W]`` in [0, 1] (`prompts[i]`: image i's prompt, which only a
        vision reward model reads, and needs)."""
        if self.reader is not None:
            if prompts is None:
                raise ValueError("a vision reward model scores an image with its prompt: pass `prompts`")
            arrays = images.float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
            samples = [RewardInput(prompt, array, {}) for prompt, array in zip(prompts, arrays, strict=True)]
            return self._check(torch.tensor(self.reader.raw_scores(samples))).tolist()
        scores = []
        for batch in images.to(self.device).split(self.cfg.batch_size):
            pixels = F.interpolate(batch, size=(self.size, self.size), mode="bilinear", align_corners=False) if self.size else batch
            logits = self.model(pixel_values=(pixels - 0.5) / 0.5).logits
            if logits.shape != (len(batch), 1):
                raise RewardError(f"image reward model '{self.path}' returned scores of shape {tuple(logits.shape)} for "
                                  f"{len(batch)} images; a scalar reward model gives one score per image (num_labels=1)")
            scores.append(self._check(logits[:, 0]))
        return torch.cat(scores).cpu().tolist() if scores else []

    def _check(self, values: Tensor) -> Tensor:
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(f"image reward model '{self.path}' gave a non-finite score ({float(values[bad[0]])}) to image "
                              f"{bad[0]} of a batch; check the model's weights")
        return values


class ImageModelScorer:
    """The image reward model on a device, as a `RewardScorer` (`gcore_rl.rewards.kinds`): each sample's
    completion is an image, a ``[H, W, 3]`` array in [0, 1] as rule rewards see it; the verdict's reward is the
    model's score. It stays on its device (`resident` None: nothing to swap), and waits
    `added_seconds_per_image` per image (experiments: a slower reward model)."""

    engine = None
    pad_id = None
    resident = None

    def __init__(self, model: ImageRewardModel):
        self.model = model

    def score(self, samples: Sequence[RewardInput]) -> list[Verdict]:
        images = torch.stack([torch.as_tensor(sample.completion).permute(2, 0, 1) for sample in samples])
        scores = self.model(images, [sample.prompt for sample in samples])
        time.sleep(self.model.cfg.added_seconds_per_image * len(samples))
        return [Verdict.of_score(score) for score in scores]

    def take_stats(self) -> None:
        return None

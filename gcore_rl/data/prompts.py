"""A prompt row → the token sequence the engine and the trainer get.

A text row's prompt is its tokens; a row with an `env` column (the environment episode it opens) an
`EpisodePrompt`, its tokens with that spec. A row with `images` (a list of RGB `PIL.Image`s, loaded by the
data source) becomes a `VisionPrompt`: the text's `IMAGE_PLACEHOLDER`s expanded to the images'
token slots, with the pixels the vision tower reads. Every place that turns rows into prompts
(rollout waves, held-out evaluation, SFT) goes through one `PromptEncoder`, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from gcore_rl.errors import DataError
from gcore_rl.models.loading import read_model_config
from gcore_rl.models.vision import IMAGE_PLACEHOLDER, VisionProcessor, count_of, is_vision_config
from gcore_rl.records import EpisodePrompt


class PromptEncoder:
    """Encodes prompt rows for one policy.

    Args:
        tokenizer: the policy's tokenizer.
        processor: the policy's `VisionProcessor` (None for a text-only policy: a row with images is
            then refused, naming the row).
        model_path: the policy's folder, named in messages.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, processor: VisionProcessor | None = None, model_path: str = ""):
        self.tokenizer = tokenizer
        self.processor = processor
        self.model_path = model_path

    def text(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def __call__(self, row: dict[str, Any], where: str = "a prompt row") -> Sequence[int]:
        """The row's prompt as token ids, a `VisionPrompt` when it has images, an `EpisodePrompt` when it has an
        `env` column (the environment episode it opens)."""
        images = self._images(row, where)
        if row.get("env") is not None:
            if images:
                raise DataError(f"{where} has both images and an `env` column; environment episodes with images "
                                "are not supported")
            return EpisodePrompt(self.text(row["prompt"]), row["env"])
        if not images:
            return self.text(row["prompt"])
        try:
            return self.processor.encode(row["prompt"], images)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from exc

    def length(self, row: dict[str, Any], where: str = "a prompt row") -> int:
        """`len(self(row, where))`, with the same checks, without preprocessing the row's pixels."""
        images = self._images(row, where)
        if not images:
            return len(self.text(row["prompt"]))
        try:
            return self.processor.token_count(row["prompt"], images)
        except ValueError as exc:
            raise DataError(f"{where}: {exc}") from exc

    def _images(self, row: dict[str, Any], where: str) -> list:
        """The row's images; DataError when the policy cannot read the row (images for a text-only policy,
        placeholders without images for a vision-language one)."""
        images = row.get("images") or []
        if not images and IMAGE_PLACEHOLDER in row["prompt"] and self.processor is not None:
            raise DataError(f"{where}: the prompt has {row['prompt'].count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} "
                            "placeholders but the row has no images")
        if images and self.processor is None:
            model = f" ('{self.model_path}')" if self.model_path else ""
            raise DataError(f"{where} has {count_of(len(images), 'image')} but the policy{model} is a text-only model; "
                            "use a vision-language model (e.g. `gcore-rl init-tiny DIR arch=qwen2_vl`) or drop the images")
        return images

    def encode_rows(self, rows: Sequence[dict[str, Any]]) -> list[Sequence[int]]:
        """`self(row)` for each row, in order."""
        return [self(row) for row in rows]


def policy_prompt_encoder(model_path: str, tokenizer: PreTrainedTokenizerBase) -> PromptEncoder:
    """The `PromptEncoder` of the policy in `model_path`: with its image processor when it is a
    vision-language model."""
    config = read_model_config(model_path)
    processor = VisionProcessor.from_model_dir(model_path, tokenizer) if is_vision_config(config) else None
    return PromptEncoder(tokenizer, processor, model_path)

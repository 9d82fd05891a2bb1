"""Vision-language policies: a tiny Qwen2-VL built locally, its image processing, and M-RoPE positions.

A Qwen2-VL prompt is text with image slots: each image becomes ``<|vision_start|>`` + one
``<|image_pad|>`` token per merged patch + ``<|vision_end|>``, and the model's vision tower writes the
image's features over the pad tokens. Positions are 3-D (M-RoPE: time, height, width): text tokens
advance all three together, an image's tokens take their grid coordinates, so a prompt ends at
position `L + delta` (`delta` ≤ 0 for images larger than one row of patches). Decoding continues
from there on all three axes, which is why the engine keeps `delta` per row.

The Hugging Face processor class for Qwen2-VL also needs a video processor, which needs torchvision;
this project only needs the image half, so `VisionProcessor` does what the processor does for
images itself: the image processor from the model folder (`preprocessor_config.json`, loaded with
`AutoImageProcessor`) for pixels and patch grids, and the placeholder expansion for tokens. The same
code reads a real Qwen2-VL folder and the tiny one `gcore-rl init-tiny DIR arch=qwen2_vl` writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.loading import read_model_config
from gcore_rl.records import ImageInputs, VisionPrompt

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a prompt's text (the i-th placeholder takes the row's i-th image)."""
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_SPECIAL_TOKENS = (VISION_START, IMAGE_PAD, VISION_END)


def count_of(number: int, noun: str) -> str:
    """``"1 image"``, ``"2 images"``: a count with its noun in the right number, for messages."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def is_vision_config(config: dict) -> bool:
    """Whether a model folder's config.json describes a vision-language model (it has a vision tower)."""
    return isinstance(config.get("vision_config"), dict)


@dataclass
class TinyVisionConfig:
    """Shape of the tiny random Qwen2-VL written by `gcore-rl init-tiny DIR arch=qwen2_vl`."""

    image_size: int = field(default=32, metadata={"help": "Side of the square images the processor keeps as they are (larger ones are scaled down to it)."})
    patch_size: int = field(default=4, metadata={"help": "Pixels per side of a vision patch."})
    vision_depth: int = field(default=2, metadata={"help": "Blocks of the vision tower."})
    vision_width: int = field(default=32, metadata={"help": "Width of the vision tower."})

    def validate(self) -> None:
        merge = 2
        if self.patch_size < 1 or self.image_size % (self.patch_size * merge):
            raise ConfigError("image_size", f"{self.image_size} must be a multiple of 2 × patch_size = "
                              f"{2 * self.patch_size} (Qwen2-VL merges 2 × 2 patches into one token)")
        if self.vision_depth < 1:
            raise ConfigError("vision_depth", f"must be at least 1, got {self.vision_depth}")
        if self.vision_width < 4 or self.vision_width % 4:
            raise ConfigError("vision_width", f"must be a multiple of 4 (2 heads of even width), got {self.vision_width}")


def mrope_section(head_dim: int) -> list[int]:
    """How M-RoPE splits a head's `head_dim / 2` rotary frequencies over (time, height, width): Qwen2-VL's
    16/24/24 of 64, scaled to the head (time gets the remainder)."""
    half = head_dim // 2
    spatial = (half * 3) // 8
    return [half - 2 * spatial, spatial, spatial]


def build_tiny_vlm(text: dict, cfg: TinyVisionConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A random Qwen2-VL with the text shape `text` (Qwen2 config keys) and the vision tower of `cfg`."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("vision_start_token_id", VISION_START), ("image_token_id", IMAGE_PAD), ("vision_end_token_id", VISION_END))}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Qwen2VLConfig(
        text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": mrope_section(head_dim)}},
        vision_config={"depth": cfg.vision_depth, "embed_dim": cfg.vision_width, "num_heads": 2, "mlp_ratio": 2,
                       "hidden_size": text["hidden_size"], "patch_size": cfg.patch_size, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "in_channels": 3},
        tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def build_tiny_image_processor(cfg: TinyVisionConfig):
    """Qwen2-VL's image processor sized for `cfg` (images up to `image_size`² pixels kept at their size)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=cfg.patch_size, merge_size=2, temporal_patch_size=2,
                                    min_pixels=(2 * cfg.patch_size) ** 2, max_pixels=cfg.image_size ** 2)


class VisionProcessor:
    """Turns a prompt text with `IMAGE_PLACEHOLDER`s and its images into a `VisionPrompt`.

    Args:
        tokenizer: the model's tokenizer (it knows the vision special tokens).
        image_processor: the model's image processor (Qwen2-VL's: resizes to multiples of patch × merge
            within its pixel limits, normalises, cuts patches).
        config: the model folder's config.json (token ids of the image slot, merge size).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor, config: dict):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = int(config["image_token_id"])
        self.start_id = int(config["vision_start_token_id"])
        self.end_id = int(config["vision_end_token_id"])
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))

    @classmethod
    def from_model_dir(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase) -> VisionProcessor:
        """The processor of a vision-language model folder (its image processor and config.json)."""
        model_dir = Path(path)
        config = read_model_config(model_dir)
        if not is_vision_config(config):
            raise ModelLoadError(f"model '{model_dir}' is a text-only model ({config.get('model_type')}); it cannot "
                                 "read images: use a vision-language model folder (e.g. `gcore-rl init-tiny DIR "
                                 "arch=qwen2_vl`) or drop the rows' images")
        if not (model_dir / "preprocessor_config.json").is_file():
            raise ModelLoadError(f"vision-language model '{model_dir}' has no preprocessor_config.json (its image "
                                 "processor); save the processor with the model")
        try:
            image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"could not load the image processor of '{model_dir}' ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())})") from exc
        return cls(tokenizer, image_processor, config)

    def image_inputs(self, images: Sequence[Image.Image]) -> ImageInputs:
        """Pixels `[P, D]` and grids `[I, 3]` of `images` (RGB), as the model's vision tower reads them."""
        out = self.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
        return ImageInputs(pixel_values=out["pixel_values"].float(), grid_thw=out["image_grid_thw"].long())

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Image tokens of each image of `grid_thw` `[I, 3]` (its patches / merge²)."""
        return [int(g.prod()) // (self.merge * self.merge) for g in grid_thw]

    def encode(self, text: str, images: Sequence[Image.Image]) -> VisionPrompt:
        """The prompt's token ids, each placeholder expanded to its image's slot, with the image inputs.

        Raises ValueError when the text's placeholders and the images do not pair up one to one.
        """
        pieces = self._pieces(text, images)
        inputs = self.image_inputs(images)
        ids: list[int] = []
        for index, (piece, slots) in enumerate(zip(pieces, [*self.image_tokens(inputs.grid_thw), 0], strict=True)):
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
            if index < len(images):
                ids += [self.start_id] + [self.image_token_id] * slots + [self.end_id]
        return VisionPrompt(ids, inputs)

    def token_count(self, text: str, images: Sequence[Image.Image]) -> int:
        """`len(self.encode(text, images))` from the images' sizes alone, without preprocessing their pixels
        (the image processor's `get_number_of_image_patches`, when it has one); ValueError as `encode`."""
        if not hasattr(self.image_processor, "get_number_of_image_patches"):
            return len(self.encode(text, images))
        pieces = self._pieces(text, images)
        slots = sum(self.image_processor.get_number_of_image_patches(im.height, im.width) // (self.merge * self.merge)
                    for im in images)
        text_tokens = sum(len(self.tokenizer.encode(piece, add_special_tokens=False)) for piece in pieces)
        return text_tokens + slots + 2 * len(images)  # each image's slot between its start and end markers

    @staticmethod
    def _pieces(text: str, images: Sequence[Image.Image]) -> list[str]:
        """The text around its placeholders (ValueError when they and the images do not pair up one to one)."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {count_of(len(pieces) - 1, IMAGE_PLACEHOLDER + ' placeholder')} but the "
                             f"row has {count_of(len(images), 'image')}; give exactly one image per placeholder")
        return pieces


def rope_positions(model: torch.nn.Module, token_ids: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
    """M-RoPE positions `[3, L]` of one sequence's tokens `[L]` (a prompt, or prompt + completion).

    Text tokens advance all three axes together; each run of image tokens takes its grid's
    coordinates (the model's own `get_rope_index`). Without images: `arange(L)` on every axis.
    """
    length = token_ids.shape[0]
    if images is None:
        return torch.arange(length, device=token_ids.device).expand(3, length)
    core = model.model
    image_token = model.config.image_token_id
    kinds = (token_ids == image_token).int()
    positions, _ = core.get_rope_index(token_ids[None], kinds[None], image_grid_thw=images.grid_thw.to(token_ids.device))
    return positions[:, 0]


def unsampled_tokens(model: torch.nn.Module) -> list[int]:
    """Token ids a vision-language policy must never generate: its image slot markers and placeholders
    (an image token in a completion would claim image features that do not exist). The engine samples,
    and the trainer scores, with these logits set to −inf, so both see the same distribution. Empty for
    a text model."""
    config = model.config
    if not hasattr(config, "vision_config"):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    vocab = config.get_text_config().vocab_size
    ids = {getattr(config, name, None) for name in names}
    return sorted(int(i) for i in ids if i is not None and 0 <= i < vocab)  # a default id may lie outside a small vocabulary


def without_unsampled(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """`logits` `[..., V]` with the `unsampled_tokens` (`banned`, long) at −inf (as given when None)."""
    if banned is None or banned.numel() == 0:
        return logits
    return logits.index_fill(-1, banned.to(logits.device), float("-inf"))


def uses_mrope(model: torch.nn.Module) -> bool:
    """Whether `model` is a vision-language model with 3-D rotary positions (Qwen2-VL family)."""
    return hasattr(getattr(model, "model", None), "get_rope_index") and hasattr(model.config, "vision_config")


def batch_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    images: Sequence[ImageInputs | None]) -> torch.Tensor:
    """M-RoPE positions `[3, B, T]` of a padded batch (`input_ids`, `attention_mask` `[B, T]`; each row's
    real tokens contiguous); padding gets position 0."""
    positions = torch.zeros((3, *input_ids.shape), dtype=torch.long, device=input_ids.device)
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool()
        positions[:, row, real] = rope_positions(model, input_ids[row, real], images[row])
    return positions


def vision_forward_inputs(images: Sequence[ImageInputs | None], device: torch.device) -> dict:
    """`pixel_values` and `image_grid_thw` of the rows that have images, in row order (empty without any)."""
    present = [i for i in images if i is not None]
    if not present:
        return {}
    joined = ImageInputs.concat(present)
    return {"pixel_values": joined.pixel_values.to(device), "image_grid_thw": joined.grid_thw.to(device)}

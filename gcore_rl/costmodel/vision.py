"""Images in the prompts of the text workload: a vision-language policy (Qwen2-VL) reads each prompt's images.

`workload.images` (an `ImageSettings`) gives each prompt `per_prompt` images (up to
`per_prompt_max`, drawn uniformly) of a side drawn from `sides` (square images). An image costs in
three places, as the project's own vision path does it (`gcore_rl.models.vision`):

- **as prompt tokens**: Qwen2-VL resizes an image to multiples of patch x merge pixels inside
  [min_pixels, max_pixels] (`resized_side`, the image processor's `smart_resize`) and cuts it into
  patches of `patch_size`^2 pixels; merge^2 patches make one prompt token. The image tokens join the
  prompt's tokens (`Wave.prompt_tokens`), so the engine prefills them, they sit in the KV cache,
  the judge reads them (unless `judge_reads_payload` is false: a text-only judge) and the log-prob
  passes and training count them as prompt tokens;
- **in the vision tower**: one forward over an image's p patches is F_v(p) = 2 N_v p + 4 L_v H_v p^2
  (every block of Qwen2-VL's ViT attends over all the image's patches), run once per prompt in
  prefill (a group's samples share the encoding), once per trained row in each log-prob pass, and
  in training 3 F_v (4 with gradient checkpointing) per row, or F_v when the tower is frozen;
- **on the controller's CPU**: loading and decoding each image and running the image processor
  (resize, normalise, cut into patches), then shipping the pixel values (`bytes_per_patch` per
  patch, float32 as `ImageInputs` carries them) once per prompt to the rollout engines, to a
  multimodal judge and, for the trained groups, to the trainers (the rows of a group share one
  `ImageInputs`, which a pickled message holds once). Each controller does this for its own
  shard (K controllers in parallel); `workload.single_driver` makes one driver do it for every
  slice's rows, which is K times a controller's time for K equal shards.

| quantity | formula |
|---|---|
| resized side r | round(s / f) f with f = patch_size x merge_size, then scaled into [min_pixels, max_pixels] |
| patches p, tokens T of one image | p = (r / patch_size)^2, T = p / merge_size^2 (or `tokens_per_image` given: p = T merge_size^2) |
| vision forward of one image | F_v = 2 N_v p + 4 L_v H_v p^2 |
| prefill, per prompt | 2 N (text + sum T) / (prefill_mfu peak tp) + sum F_v / (prefill_mfu peak tp) |
| log-prob pass, per trained row | 2 N (prompt + sum T + response) / (logprob_mfu peak D) + sum F_v / (logprob_mfu peak D) |
| training, per trained row | 6 N (...) + {3, 4 with checkpointing, 1 frozen} x sum F_v, each x epochs / (train_mfu peak D) |
| CPU per image | (decode_seconds_per_image + preprocess_seconds_per_image) + (decode_seconds_per_megapixel + preprocess_seconds_per_megapixel) x megapixels |
| data plane of a controller, per wave | its prompts' CPU seconds / cpu_workers + its bytes / controller_bandwidth |
| single driver, per wave | the sum over the K controllers' data planes |

The CPU constants are measured (`benchmarks/vision_preprocess.py`; see `ImageSettings` and
docs/simulator.md, "The vision workload"); N_v, L_v, H_v are Qwen2-VL's ViT (675 M parameters, 32
blocks of width 1280); the MFUs are the text workload's, not measured on a ViT. Left out: the
judge's own vision tower, the vision tower's weights in swaps, syncs and device memory (1.35 GB in
bf16 for Qwen2-VL, 9 % of the 7B language model), prefetching the next wave's images while the
engines generate, and images that are not square (the model sees the same pixels either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.diffusion import forward_flops
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.errors import ConfigError

#: where the CPU constants' defaults come from (the measuring command's output, bench-results/ is not tracked)
MEASURED = ("`.venv/bin/python benchmarks/vision_preprocess.py --processes 7 --out bench-results/vision_preprocess.json`, "
            "2026-11-25, a 2-vCPU Intel Xeon VM (the development machine), CPU time of one thread, median of 7 "
            "processes x 25 repeats, synthetic PNG images of 64-1024 px, fitted on 64/256/512/1024 px")
#: what the CPU constants' help says of their defaults (the measurement itself: MEASURED, docs/simulator.md)
_MEASURED_HELP = " Default: one CPU thread, measured by benchmarks/vision_preprocess.py (docs/simulator.md)."


@dataclass(frozen=True)
class ImageSettings:
    """The images of each prompt (`workload.images`, text workloads only; per_prompt 0 = text only).

    Defaults: Qwen2-VL's image processor and vision tower (its preprocessor_config.json and
    config.json on the Hugging Face hub: patch 14, merge 2, 56^2 .. 12,845,056 pixels; ViT of 32
    blocks of width 1280, 675 M parameters) and CPU constants measured with
    benchmarks/vision_preprocess.py (see `MEASURED`).
    """

    per_prompt: int = field(default=0, metadata={"help": "Images per prompt (the fewest when per_prompt_max is set); 0 = text only, the workload's numbers as without this section."})
    per_prompt_max: int | None = field(default=None, metadata={"help": "Most images per prompt: each prompt draws per_prompt .. per_prompt_max uniformly. null = exactly per_prompt."})
    sides: tuple[int, ...] = field(default=(448,), metadata={"help": "Side in pixels of a (square) source image, drawn uniformly from this list for every image."})
    tokens_per_image: int | None = field(default=None, metadata={"help": "Prompt tokens per image, given; null = derived from the side as Qwen2-VL does (resize to multiples of patch_size x merge_size within min/max_pixels, one token per merge_size^2 patches)."})
    patch_size: int = field(default=14, metadata={"help": "Pixels per side of a vision patch (Qwen2-VL: 14)."})
    merge_size: int = field(default=2, metadata={"help": "Patches per side merged into one prompt token (Qwen2-VL: 2, one token per 28 x 28 pixels)."})
    min_pixels: int = field(default=56 * 56, metadata={"help": "Smallest resized image in pixels (Qwen2-VL: 3136)."})
    max_pixels: int = field(default=12845056, metadata={"help": "Largest resized image in pixels (Qwen2-VL's preprocessor_config: 12845056; RL recipes often cap it lower, e.g. 28*28*1280 = 1003520)."})
    vision_params: float = field(default=675e6, metadata={"help": "Parameters of the vision tower, N_v in 2 N_v FLOPs per patch (Qwen2-VL's ViT with its merger: 675 M)."})
    vision_layers: int = field(default=32, metadata={"help": "Blocks of the vision tower (L_v of its attention term 4 L_v H_v p^2; Qwen2-VL: 32)."})
    vision_hidden: int = field(default=1280, metadata={"help": "Width of the vision tower (H_v; Qwen2-VL: 1280)."})
    train_vision_tower: bool = field(default=True, metadata={"help": "The vision tower is trained (forward + backward, 3 forwards' FLOPs per trained row); false = frozen (its forward only)."})
    bytes_per_patch: float = field(default=4704.0, metadata={"help": "Bytes of pixel values per patch the controller ships (float32 x 3 channels x temporal patch 2 x 14 x 14 = 4704, as ImageInputs carries them); 0 = the engines read the images themselves."})
    decode_seconds_per_image: float = field(default=3.758e-4, metadata={"help": "CPU seconds to load and decode one PNG, fixed part (decode_seconds_per_megapixel adds the part that grows with the image)." + _MEASURED_HELP})
    decode_seconds_per_megapixel: float = field(default=0.01951, metadata={"help": "CPU seconds to load and decode a PNG, per megapixel of the source image." + _MEASURED_HELP})
    preprocess_seconds_per_image: float = field(default=5.083e-4, metadata={"help": "CPU seconds of Qwen2-VL's image processor (resize, rescale, normalise, patchify into float32; Qwen2VLImageProcessorPil), fixed part." + _MEASURED_HELP})
    preprocess_seconds_per_megapixel: float = field(default=0.04850, metadata={"help": "CPU seconds of Qwen2-VL's image processor per megapixel of the source image." + _MEASURED_HELP})
    cpu_workers: int = field(default=1, metadata={"help": "CPU processes each controller (or the single driver) decodes and preprocesses with, in parallel (a data loader's workers); shipping the bytes stays one process."})

    def validate(self) -> None:
        if self.per_prompt < 0:
            raise ConfigError("per_prompt", f"must be >= 0, got {self.per_prompt}")
        if self.per_prompt_max is not None and self.per_prompt_max < self.per_prompt:
            raise ConfigError("per_prompt_max", f"must be >= per_prompt = {self.per_prompt}, got {self.per_prompt_max}")
        if not self.sides or any(s < 1 for s in self.sides):
            raise ConfigError("sides", f"give at least one side of at least 1 pixel, got {list(self.sides)}")
        if self.tokens_per_image is not None and self.tokens_per_image < 1:
            raise ConfigError("tokens_per_image", f"must be at least 1 (or null), got {self.tokens_per_image}")
        for key in ("patch_size", "merge_size", "min_pixels", "vision_layers", "vision_hidden", "cpu_workers"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.max_pixels < self.min_pixels:
            raise ConfigError("max_pixels", f"must be >= min_pixels = {self.min_pixels}, got {self.max_pixels}")
        for key in ("vision_params", "bytes_per_patch", "decode_seconds_per_image", "decode_seconds_per_megapixel",
                    "preprocess_seconds_per_image", "preprocess_seconds_per_megapixel"):
            if not getattr(self, key) >= 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")

    @property
    def enabled(self) -> bool:
        """Whether any prompt has an image."""
        return max(self.per_prompt, self.per_prompt_max or 0) > 0

    @property
    def most_per_prompt(self) -> int:
        return max(self.per_prompt, self.per_prompt_max or 0)

    @property
    def vision_tower(self) -> ModelSpec:
        """The vision tower's shape, for its forward FLOPs (`diffusion.forward_flops`: 2 N p + 4 L H p^2; the
        KV and vocabulary figures are placeholders: the tower keeps no KV cache and has no vocabulary)."""
        return ModelSpec("vision tower", params=self.vision_params, layers=self.vision_layers,
                         hidden=self.vision_hidden, kv_heads=1, head_dim=1, vocab=1)


# --------------------------------------------------------------------------- one image


def resized_side(sides, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int) -> np.ndarray:
    """The side Qwen2-VL's image processor resizes square images of side `sides` to (its `smart_resize`
    for height = width): the nearest multiple of f = patch_size x merge_size, scaled down (floor) when
    its square exceeds max_pixels or up (ceil) when under min_pixels, never below f."""
    s = np.asarray(sides, dtype=np.float64)
    f = patch_size * merge_size
    side = np.maximum(np.round(s / f), 1.0) * f  # Python's round and numpy's both round half to even
    too_big = side * side > max_pixels
    too_small = side * side < min_pixels
    with np.errstate(divide="ignore"):  # the same floating-point steps as smart_resize, so its boundaries match
        down = np.maximum(f, np.floor(s / np.sqrt(s * s / max_pixels) / f) * f)
        up = np.ceil(s * np.sqrt(min_pixels / (s * s)) / f) * f
    return np.where(too_big, down, np.where(too_small, up, side))


def image_patches(sides, settings: ImageSettings) -> np.ndarray:
    """Vision patches of images of side `sides`: (resized side / patch_size)^2, or tokens_per_image x merge^2 when given."""
    if settings.tokens_per_image is not None:
        return np.full(np.shape(sides), float(settings.tokens_per_image * settings.merge_size ** 2))
    side = resized_side(sides, settings.patch_size, settings.merge_size, settings.min_pixels, settings.max_pixels)
    return (side / settings.patch_size) ** 2


def image_tokens(sides, settings: ImageSettings) -> np.ndarray:
    """Prompt tokens of images of side `sides`: patches / merge_size^2."""
    return image_patches(sides, settings) / settings.merge_size ** 2


def vision_flops(patches, settings: ImageSettings) -> np.ndarray:
    """One vision-tower forward over an image of `patches` patches: 2 N_v p + 4 L_v H_v p^2."""
    return forward_flops(settings.vision_tower, patches)


def cpu_seconds(images, megapixels, settings: ImageSettings) -> np.ndarray:
    """CPU seconds to load, decode and preprocess `images` images of `megapixels` megapixels in all."""
    per_image = settings.decode_seconds_per_image + settings.preprocess_seconds_per_image
    per_megapixel = settings.decode_seconds_per_megapixel + settings.preprocess_seconds_per_megapixel
    return np.asarray(images, np.float64) * per_image + np.asarray(megapixels, np.float64) * per_megapixel


# --------------------------------------------------------------------------- the images of a wave


@dataclass(frozen=True)
class WaveImages:
    """The images of one wave's prompts: arrays over [slice, prompt], each summed over the prompt's images."""

    count: np.ndarray  # [K, P] images
    megapixels: np.ndarray  # [K, P] source megapixels (what is decoded)
    tokens: np.ndarray  # [K, P] prompt tokens (already counted in Wave.prompt_tokens)
    patches: np.ndarray  # [K, P] vision patches
    flops: np.ndarray  # [K, P] one vision-tower forward over the prompt's images

    def take(self, slices: Sequence[int] | np.ndarray) -> WaveImages:
        """The images of the slices `slices` only."""
        return self._select((np.asarray(slices),))

    def take_prompts(self, prompts: Sequence[int] | np.ndarray) -> WaveImages:
        """The images of the prompts `prompts` of every slice (in that order; repeats allowed)."""
        return self._select((slice(None), np.asarray(prompts)))

    def _select(self, index: tuple) -> WaveImages:
        return WaveImages(*(getattr(self, f.name)[index] for f in fields(self)))


def draw_images(rng: np.random.Generator, settings: ImageSettings, shape: tuple[int, int]) -> WaveImages:
    """The images of `shape` = (slices, prompts) prompts: their count and each image's side drawn from `rng`."""
    most = settings.most_per_prompt
    count = rng.integers(settings.per_prompt, most, size=shape, endpoint=True) if settings.per_prompt_max is not None \
        else np.full(shape, settings.per_prompt)
    sides = np.asarray(settings.sides, dtype=np.float64)[rng.integers(0, len(settings.sides), size=(*shape, most))]
    present = np.arange(most)[None, None, :] < count[:, :, None]  # [K, P, most]: the prompt's first `count` images
    patches = np.where(present, image_patches(sides, settings), 0.0)

    def per_prompt(values: np.ndarray) -> np.ndarray:
        return np.where(present, values, 0.0).sum(axis=2)

    tokens = (patches / settings.merge_size ** 2).sum(axis=2)
    return WaveImages(count=count.astype(np.int64), megapixels=per_prompt(sides * sides / 1e6),
                      tokens=np.rint(tokens).astype(np.int64), patches=patches.sum(axis=2),
                      flops=per_prompt(vision_flops(patches, settings)))


@dataclass(frozen=True)
class TrainedImages:
    """The images of a step's trained rows, per slice [K]."""

    patches: np.ndarray  # [K] patches of the trained groups' prompts, each group's once (what is shipped)
    flops: np.ndarray  # [K] one vision-tower forward over every trained row's images (each row runs its own)


# --------------------------------------------------------------------------- seconds


def encode_seconds(flops, hw: Hardware, c: CostConstants, tp: int = 1) -> np.ndarray:
    """Vision-tower forwards of `flops` FLOPs in an engine's prefill on `tp` devices: flops / (prefill_mfu peak tp)."""
    return np.asarray(flops, np.float64) / (c.prefill_mfu * hw.peak_flops * tp)


def logprob_seconds(flops, hw: Hardware, c: CostConstants, devices: int) -> np.ndarray:
    """The vision tower's part of a log-prob pass over `devices`: flops / (logprob_mfu peak devices)."""
    return np.asarray(flops, np.float64) / (c.logprob_mfu * hw.peak_flops * devices)


def train_seconds(flops, settings: ImageSettings, hw: Hardware, c: CostConstants, devices: int, epochs: int = 1,
                  recompute: bool = False) -> np.ndarray:
    """The vision tower's part of training over `devices`: F x flops x epochs / (train_mfu peak devices),
    F = 3 (forward + backward), 4 with gradient checkpointing, 1 with the tower frozen."""
    passes = (4.0 if recompute else 3.0) if settings.train_vision_tower else 1.0
    return passes * np.asarray(flops, np.float64) * epochs / (c.train_mfu * hw.peak_flops * devices)


# --------------------------------------------------------------------------- fitting the CPU constants


@dataclass(frozen=True)
class LinearFit:
    """seconds = intercept + slope x megapixels, fitted to minimise the relative error."""

    intercept: float
    slope: float

    def predict(self, megapixels) -> np.ndarray:
        return self.intercept + self.slope * np.asarray(megapixels, np.float64)

    def relative_errors(self, megapixels, seconds) -> np.ndarray:
        """(predicted - measured) / measured at each point."""
        seconds = np.asarray(seconds, np.float64)
        return (self.predict(megapixels) - seconds) / seconds


def fit_seconds_per_megapixel(megapixels: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Least squares of seconds = a + b x megapixels on relative residuals ((a + b x - y) / y).

    Relative, because the sizes span two orders of magnitude of time: plain least squares would fit
    the largest images and leave the per-image term, which decides the small ones, to chance. A
    two-parameter linear problem, solved exactly (`numpy.linalg.lstsq`); needs two distinct sizes.
    """
    x, y = np.asarray(megapixels, np.float64), np.asarray(seconds, np.float64)
    if len(np.unique(x)) < 2 or np.any(y <= 0):
        raise ValueError("the fit needs at least two distinct sizes and positive times")
    design = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    return LinearFit(intercept=float(a), slope=float(b))

"""The diffusion workload: RL on a text-to-image flow model (Flow-GRPO, DanceGRPO), priced per image.

A step samples `group_size` images per prompt with `denoising_steps` steps of a diffusion
transformer (DiT), decodes them with the VAE, scores them with a reward model (a CLIP-sized scorer
or a generative VLM judge) and trains the policy on `train_steps` of each image's denoising steps.
Nothing is decoded token by token: every denoising step of an image is a full forward over all
its tokens, so sampling is compute-bound and batches like a prefill. The strategies run this work
through the same phase functions as the text workload (`phases.generate`, `phases.judge`,
`phases.update_seconds` dispatch on `Workload.kind`).

Units: FLOP, seconds, tokens, bytes. N = `ModelSpec.params`, L = `layers`, H = `hidden`.

| quantity | formula |
|---|---|
| image tokens I | (resolution / vae_downsample / patch_size)^2 |
| sequence S | I + text_tokens (the DiT attends jointly over image and text tokens) |
| one forward of one image | 2 N S + 4 L H S^2 (the attention scores and their product with V) |
| one batched forward of n sequences | max(W / (tp eff hbm), n x forward / (tp peak prefill_mfu)) + step_overhead_s + L x layer_overhead_s |
| a batch of b images | denoising_steps x forward(b x cfg) + b x vae_flops_per_pixel x resolution^2 / (tp peak prefill_mfu) |
| reference (per image) | train_steps x train_cfg forwards / (logprob_mfu peak devices) |
| training (per image) | 3 (4 with gradient checkpointing) x train_steps x train_cfg forwards / (train_mfu peak devices) |

cfg and train_cfg are 2 with classifier-free guidance (the conditional and unconditional
branches run as one batch of twice the sequences) and 1 without. The MFU and overhead constants
are the text workload's (`CostConstants`): a denoising forward is priced like a prefill, the
reference like a log-prob pass, training like text training; none of them has been measured on a
DiT, so they are assumptions carried over. The training side reuses `cost.train_seconds` /
`cost.logprob_seconds` through `forward_equivalent_tokens` (the tokens whose 2 N FLOPs equal one
DiT forward), which keeps the micro-batch and optimiser-step terms of the text model.

Left out: the text encoders (CLIP-L/G, T5-XXL: one forward per prompt, shared by its group, under
1 % of a group's denoising), SD3.5-Medium's extra image-only attention in its first 13 blocks,
LoRA (Flow-GRPO trains LoRA adapters: the backward pass then skips the weight gradients, about 2
forwards instead of 3), sequence parallelism inside an engine, and the activation memory of a
batch (assumed to fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.decode import DecodeRun
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class DiffusionSettings:
    """What one image costs (`workload.diffusion`, read when `workload.kind` is diffusion).

    Defaults follow Flow-GRPO's SD3.5-Medium configs (arXiv 2505.05470; `config/grpo.py` of its
    repository: 512 px, 10 sampling steps, guidance 4.5, 9 images per sampling batch,
    timestep_fraction 0.99, `train.cfg = True` in `config/base.py`).
    """

    denoising_steps: int = field(default=10, metadata={"help": "Denoising steps per sampled image (Flow-GRPO's denoising reduction samples with 10 and evaluates with 40)."})
    train_steps: int = field(default=9, metadata={"help": "Denoising steps of each image the policy trains on (Flow-GRPO: int(10 x timestep_fraction 0.99) = 9; DanceGRPO: int(16 x 0.6) = 9)."})
    resolution: int = field(default=512, metadata={"help": "Image side in pixels (square images)."})
    vae_downsample: int = field(default=8, metadata={"help": "Pixels per latent cell along a side (the VAE's downsampling factor)."})
    patch_size: int = field(default=2, metadata={"help": "Latent cells per DiT patch along a side: one image token covers patch_size^2 latent cells."})
    latent_channels: int = field(default=16, metadata={"help": "Channels of the VAE latent (16 for SD3 and FLUX): sizes the trajectory the trainer receives."})
    text_tokens: int = field(default=333, metadata={"help": "Text tokens in the DiT's joint attention (SD3.5: 77 CLIP + 256 T5; FLUX.1: 512 T5)."})
    cfg: bool = field(default=True, metadata={"help": "Classifier-free guidance while sampling: every denoising step runs a conditional and an unconditional branch (twice the sequences). false for guidance-distilled models (FLUX.1-dev)."})
    train_cfg: bool = field(default=True, metadata={"help": "Classifier-free guidance in the training (and reference) forwards, as Flow-GRPO's default train.cfg = True; its *_nocfg configs turn it off."})
    batch_images: int = field(default=9, metadata={"help": "Images one rollout engine denoises together (Flow-GRPO's sample.train_batch_size = 9 per GPU); a batch's images finish, and stream to the reward model, together."})
    vae_decode_flops_per_pixel: float = field(default=6.0e6, metadata={"help": "FLOPs of the VAE decoder per output pixel. Assumed: about 7 3x3 convolutions of 128 channels per pixel at full resolution and as many again at each of the 256- and 512-channel lower resolutions (~1.6 TFLOP for a 512 px image); not measured."})
    reward: Literal["scorer", "judge"] = field(default="scorer", metadata={"help": "scorer: the reward model (models.judge) reads each image and returns a score (one forward; priced as a one-token verdict, as the text judge prices a scalar reward model). judge: a generative VLM judge that writes a verdict of workload.judge_output_tokens tokens."})
    reward_image_tokens: int = field(default=257, metadata={"help": "Tokens one image becomes in the reward model (CLIP ViT-H/14 at 224 px: 16 x 16 patches + CLS = 257; Qwen2.5-VL: one token per 28 x 28 pixels). workload.judge_template_tokens adds the prompt and instructions."})

    def validate(self) -> None:
        for key in ("denoising_steps", "train_steps", "resolution", "vae_downsample", "patch_size", "latent_channels",
                    "batch_images", "reward_image_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.text_tokens < 0:
            raise ConfigError("text_tokens", f"must be >= 0, got {self.text_tokens}")
        if self.train_steps > self.denoising_steps:
            raise ConfigError("train_steps", f"{self.train_steps} trained steps of {self.denoising_steps} denoising steps")
        if self.resolution % (self.vae_downsample * self.patch_size):
            raise ConfigError("resolution", f"{self.resolution} px is not a whole number of patches of "
                              f"{self.vae_downsample} x {self.patch_size} px")
        if not self.vae_decode_flops_per_pixel >= 0:
            raise ConfigError("vae_decode_flops_per_pixel", f"must be >= 0, got {self.vae_decode_flops_per_pixel}")

    @property
    def image_tokens(self) -> int:
        return image_tokens(self.resolution, self.vae_downsample, self.patch_size)

    @property
    def sequence_tokens(self) -> int:
        """S: the tokens of one DiT forward (image + text)."""
        return self.image_tokens + self.text_tokens

    @property
    def sampling_branches(self) -> int:
        return 2 if self.cfg else 1

    @property
    def training_branches(self) -> int:
        return 2 if self.train_cfg else 1

    @property
    def image_bytes(self) -> float:
        """A decoded image as 8-bit RGB: what goes from the rollout engines to the reward model."""
        return 3.0 * self.resolution ** 2

    @property
    def trajectory_bytes(self) -> float:
        """The bf16 latents of every denoising step of one image (steps + 1 states): what the trainer needs."""
        cells = (self.resolution // self.vae_downsample) ** 2
        return 2.0 * self.latent_channels * cells * (self.denoising_steps + 1)


# --------------------------------------------------------------------------- FLOPs


def image_tokens(resolution: int, vae_downsample: int, patch_size: int) -> int:
    """Image tokens of one square image: (resolution / vae_downsample / patch_size)^2."""
    return (resolution // vae_downsample // patch_size) ** 2


def attention_flops(model: ModelSpec, tokens) -> np.ndarray:
    """The quadratic term of one forward over `tokens` tokens: 4 L H S^2 (Q K^T and the product with V)."""
    s = np.asarray(tokens, dtype=np.float64)
    return 4.0 * model.layers * model.hidden * s * s


def forward_flops(model: ModelSpec, tokens) -> np.ndarray:
    """One forward over `tokens` tokens: 2 N S + 4 L H S^2."""
    return 2.0 * model.params * np.asarray(tokens, dtype=np.float64) + attention_flops(model, tokens)


def forward_equivalent_tokens(model: ModelSpec, tokens) -> np.ndarray:
    """The tokens whose 2 N FLOPs equal one forward over `tokens` tokens (attention included), so that
    the text formulas (`cost.train_seconds`, `cost.logprob_seconds`) price DiT forwards."""
    return forward_flops(model, tokens) / (2.0 * model.params)


def denoise_flops(settings: DiffusionSettings, model: ModelSpec, images) -> np.ndarray:
    """FLOPs of sampling `images` images, VAE decode excluded: images x denoising_steps x cfg x forward(S)."""
    per_image = settings.denoising_steps * settings.sampling_branches * forward_flops(model, settings.sequence_tokens)
    return np.asarray(images, dtype=np.float64) * per_image


def vae_decode_flops(settings: DiffusionSettings, images) -> np.ndarray:
    """FLOPs of decoding `images` latents to pixels: images x vae_decode_flops_per_pixel x resolution^2."""
    return np.asarray(images, dtype=np.float64) * settings.vae_decode_flops_per_pixel * settings.resolution ** 2


def training_forwards(settings: DiffusionSettings, images) -> np.ndarray:
    """DiT forwards (one sequence each) the update runs per pass over `images` images: images x train_steps x train_cfg."""
    return np.asarray(images, dtype=np.float64) * settings.train_steps * settings.training_branches


# --------------------------------------------------------------------------- seconds


def forward_seconds(sequences, settings: DiffusionSettings, model: ModelSpec, hw: Hardware, c: CostConstants,
                    tp: int = 1) -> np.ndarray:
    """One batched forward over `sequences` sequences of S tokens on an engine of `tp` devices:
    max(W / (tp eff hbm), sequences x forward(S) / (tp peak prefill_mfu)) + the per-forward fixed cost."""
    compute = np.asarray(sequences, dtype=np.float64) * forward_flops(model, settings.sequence_tokens) / (
        tp * hw.peak_flops * c.prefill_mfu)
    memory = model.weight_bytes / (tp * c.decode_bandwidth_efficiency * hw.hbm_bandwidth)
    return np.maximum(memory, compute) + cost.step_fixed_seconds(model, c)


def vae_decode_seconds(images, settings: DiffusionSettings, hw: Hardware, c: CostConstants, tp: int = 1) -> np.ndarray:
    """VAE decode of `images` latents: vae_decode_flops / (tp peak prefill_mfu) (convolutions, compute-bound)."""
    return vae_decode_flops(settings, images) / (tp * hw.peak_flops * c.prefill_mfu)


def batch_seconds(images, settings: DiffusionSettings, model: ModelSpec, hw: Hardware, c: CostConstants,
                  tp: int = 1) -> np.ndarray:
    """A batch of `images` images from noise to pixels: denoising_steps batched forwards over
    images x cfg sequences, then the VAE decode. 0 for an empty batch."""
    images = np.asarray(images, dtype=np.float64)
    seconds = (settings.denoising_steps * forward_seconds(images * settings.sampling_branches, settings, model, hw, c, tp)
               + vae_decode_seconds(images, settings, hw, c, tp))
    return np.where(images > 0, seconds, 0.0)


def denoise_engines(engine: np.ndarray, engines: int, settings: DiffusionSettings, model: ModelSpec, hw: Hardware,
                    c: CostConstants, tp: int = 1) -> DecodeRun:
    """`engines` engines each denoise their images in batches of `batch_images`, one batch after another.

    `engine` [S]: engine index of each image (queue order is array order). Every image of a batch
    finishes when the batch's VAE decode ends. Returned as a `DecodeRun`, so the strategies and the
    step records read it like token generation: `decode_seconds` [E] each engine's busy time,
    `finish_seconds` [S], `steps` [E] batched forwards, `token_steps` [E] sequence-forwards
    (images x denoising_steps x cfg), `compute_bound_steps` [E]; no prefill and no KV cache.
    """
    engine = np.asarray(engine, dtype=np.int64)
    B = settings.batch_images
    counts = np.bincount(engine, minlength=engines)
    order = np.argsort(engine, kind="stable")
    rank = np.empty(len(engine), dtype=np.int64)
    rank[order] = np.arange(len(engine)) - np.repeat(np.cumsum(counts) - counts, counts)
    batches = -(-counts // B)  # [E]
    last = counts - (batches - 1) * B  # images in each engine's last batch
    full_s = float(batch_seconds(B, settings, model, hw, c, tp))
    last_s = batch_seconds(last, settings, model, hw, c, tp)
    busy = np.where(counts > 0, (batches - 1) * full_s + last_s, 0.0)
    batch = rank // B
    in_last = batch == batches[engine] - 1
    finish = np.where(in_last, batch * full_s + last_s[engine], (batch + 1) * full_s)
    steps = batches * settings.denoising_steps
    memory = model.weight_bytes / (tp * c.decode_bandwidth_efficiency * hw.hbm_bandwidth)
    compute_full = B * settings.sampling_branches * float(forward_flops(model, settings.sequence_tokens)) / (
        tp * hw.peak_flops * c.prefill_mfu)
    compute_last = last * settings.sampling_branches * float(forward_flops(model, settings.sequence_tokens)) / (
        tp * hw.peak_flops * c.prefill_mfu)
    compute_bound = np.where(counts > 0, ((batches - 1) * (compute_full >= memory) + (compute_last >= memory))
                             * settings.denoising_steps, 0)
    zeros = np.zeros(engines)
    return DecodeRun(prefill_seconds=zeros, decode_seconds=busy, finish_seconds=finish, steps=steps,
                     token_steps=counts * float(settings.denoising_steps * settings.sampling_branches),
                     kv_token_steps=zeros, compute_bound_steps=compute_bound.astype(np.float64), prefill_tokens=zeros)


def reference_seconds(images, settings: DiffusionSettings, model: ModelSpec, hw: Hardware, c: CostConstants,
                      devices: int, micro_batches=0):
    """The reference model's forward at every trained step of `images` images over `devices`
    (Flow-GRPO's KL term, beta > 0: one reference forward next to each trained forward)."""
    tokens = training_forwards(settings, images) * forward_equivalent_tokens(model, settings.sequence_tokens)
    return cost.logprob_seconds(tokens, model, hw, c, devices, micro_batches=micro_batches)


def train_seconds(images, settings: DiffusionSettings, model: ModelSpec, hw: Hardware, c: CostConstants,
                  devices: int, epochs: int = 1, micro_batches=0, optimiser_steps=0, recompute: bool = False):
    """Training on `train_steps` denoising steps of each of `images` images over `devices`: forward +
    backward = 3 forwards (4 with gradient checkpointing) per trained step, plus the text model's
    micro-batch and optimiser-step overheads (`cost.train_seconds`)."""
    tokens = training_forwards(settings, images) * forward_equivalent_tokens(model, settings.sequence_tokens)
    return cost.train_seconds(tokens, model, hw, c, devices, epochs, micro_batches=micro_batches,
                              optimiser_steps=optimiser_steps, recompute=recompute)

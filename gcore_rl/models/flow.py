"""Flow-matching text-to-image models: the folder layout, a tiny random one, loading, and the velocity call.

A model folder follows diffusers' pipeline layout, each part loadable with its own `from_pretrained`::

    transformer/    SD3Transformer2DModel or FluxTransformer2DModel (config.json + safetensors)
    scheduler/      FlowMatchEulerDiscreteScheduler (the rectified-flow time grid)
    text_encoder/   one CLIP-style encoder: per-token states → the transformer's text stream, projected EOS
    tokenizer/      state → its pooled vector (the tiny models); or the text encoders of an SD3 release
    ...             (+ text_encoder_2/ CLIP-G, text_encoder_3/ T5 (optional), tokenizer_2/, tokenizer_3/) or of
                    a FLUX release (CLIP-L, + text_encoder_2/ T5, tokenizer_2/), combined as diffusers'
                    pipelines do (`gcore_rl.models.flow_text`)
    vae/            optional AutoencoderKL; without it the model denoises pixels directly (the tiny models)

`write_tiny_diffusion` builds such a folder with random weights (no network), in either architecture and
with one text encoder or a release's (`text_encoders=release`: tiny CLIPs, T5 and VAE in the real widths'
proportions), so the same loading path serves a tiny test model and a user's SD3/FLUX folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.flow_text import (
    RELEASE_TEXT_PARTS,
    PromptEncoder,
    TextCondition,
    load_text_conditioning,
    read_json,
    tiny_widths,
    write_tiny_text_parts,
)

ARCHITECTURES = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux"}
"""diffusers transformer classes this module can call, by the short name used in code."""
ARCHITECTURES_BY_SHORT = {short: name for name, short in ARCHITECTURES.items()}
RELEASE_PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
"""diffusers pipeline of each architecture (model_index.json's _class_name of a release-layout folder)."""
MODEL_PARTS = ("scheduler", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
               "tokenizer_3", "vae", "model_index.json")
"""Everything of a model folder besides the transformer (what a trained policy's folder copies from its start)."""
RELEASE_VAE = {"sd3": {"scaling_factor": 1.5305, "shift_factor": 0.0609},
               "flux": {"scaling_factor": 0.3611, "shift_factor": 0.1159}}
"""Latent scaling of the SD3 and FLUX VAEs (their released configs), which the tiny release-layout VAEs copy."""
LATENT_CHANNELS = 16
"""Latent channels of the SD3 and FLUX VAEs (and of the tiny release-layout ones)."""


@dataclass
class TinyDiffusionConfig:
    """Shape of the tiny random flow model written by `gcore-rl init-tiny-diffusion`."""

    arch: Literal["sd3", "flux"] = field(default="sd3", metadata={"help": "Transformer: sd3 (SD3Transformer2DModel, MMDiT) or flux (FluxTransformer2DModel)."})
    text_encoders: Literal["one", "release"] = field(default="one", metadata={"help": "one: a single CLIP-style text encoder, pixel space (no VAE); release: the arch's release layout (sd3: CLIP-L, CLIP-G and T5 text encoders, flux: CLIP-L and T5; their tokenizers; a VAE of 16 latent channels halving the image side), tiny and random."})
    resolution: int = field(default=16, metadata={"help": "Image side in pixels the model is built for (a multiple of 4 with text_encoders=release)."})
    channels: int = field(default=3, metadata={"help": "Image channels (3 with text_encoders=release: its VAE encodes RGB)."})
    num_layers: int = field(default=2, metadata={"help": "Transformer blocks (flux: this many double-stream and this many single-stream blocks)."})
    num_heads: int = field(default=2, metadata={"help": "Attention heads."})
    head_dim: int = field(default=16, metadata={"help": "Dimensions per attention head (flux: a multiple of 8, for its 3-axis rotary embedding)."})
    text_hidden: int = field(default=32, metadata={"help": "Width of the text encoder (and of the pooled text vector); release: of CLIP-L, with CLIP-G twice and T5 four times as wide."})
    text_layers: int = field(default=2, metadata={"help": "Layers of the text encoder(s)."})
    text_tokens: int = field(default=24, metadata={"help": "Longest prompt in tokens (prompts are padded to this; release: the CLIP and the T5 lengths)."})
    seed: int = field(default=0, metadata={"help": "Seed of the random initialisation."})

    def validate(self) -> None:
        for key in ("resolution", "channels", "num_layers", "num_heads", "head_dim", "text_hidden", "text_layers", "text_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.resolution % 2:
            raise ConfigError("resolution", f"{self.resolution} is odd; the transformer takes 2×2 patches")
        if self.arch == "flux" and self.head_dim % 8:
            raise ConfigError("head_dim", f"{self.head_dim} is not a multiple of 8 (FLUX's rotary embedding splits it "
                              "over 3 axes of even sizes: head_dim/4, head_dim/4, head_dim/2)")
        if self.text_encoders == "release" and self.resolution % 4:
            raise ConfigError("resolution", f"{self.resolution} is not a multiple of 4: with text_encoders=release the "
                              "VAE halves the image side and the transformer takes 2×2 patches of the latents")
        if self.text_encoders == "release" and self.channels != 3:
            raise ConfigError("channels", f"must be 3 with text_encoders=release (its VAE encodes RGB images), got "
                              f"{self.channels}")


def _build_transformer(cfg: TinyDiffusionConfig, side: int, channels: int) -> nn.Module:
    """The transformer for `side`×`side` latents of `channels` channels, its text widths from `tiny_widths`."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    widths = tiny_widths(cfg.arch, cfg.text_encoders, cfg.text_hidden)
    text = {key: widths[key] for key in ("joint_attention_dim", "pooled_projection_dim")}
    if cfg.arch == "sd3":
        return SD3Transformer2DModel(
            sample_size=side, patch_size=2, in_channels=channels, out_channels=channels, num_layers=cfg.num_layers,
            attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
            caption_projection_dim=cfg.num_heads * cfg.head_dim, pos_embed_max_size=side // 2, **text)
    quarter = cfg.head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1, in_channels=channels * 4, out_channels=channels * 4, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_layers, attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
        guidance_embeds=False, axes_dims_rope=(quarter, quarter, 2 * quarter), **text)


def _build_vae(cfg: TinyDiffusionConfig) -> nn.Module:
    """A tiny AutoencoderKL: RGB ↔ `LATENT_CHANNELS` latents at half the side, scaled as the arch's release VAE."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=cfg.resolution, use_quant_conv=False,
        use_post_quant_conv=False, **RELEASE_VAE[cfg.arch])


def write_tiny_diffusion(out_dir: str | Path, cfg: TinyDiffusionConfig | None = None) -> Path:
    """Write a tiny random flow model folder (layout in the module docstring) and return its path."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = cfg or TinyDiffusionConfig()
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    write_tiny_text_parts(out, cfg.arch, cfg.text_encoders, cfg.text_hidden, cfg.text_layers, cfg.text_tokens)
    if cfg.text_encoders == "release":
        _build_vae(cfg).save_pretrained(out / "vae")
        transformer = _build_transformer(cfg, cfg.resolution // 2, LATENT_CHANNELS)
    else:
        transformer = _build_transformer(cfg, cfg.resolution, cfg.channels)
    transformer.save_pretrained(out / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out / "scheduler")
    (out / "model_index.json").write_text(json.dumps(_tiny_model_index(cfg), indent=2) + "\n")
    return out


def _tiny_model_index(cfg: TinyDiffusionConfig) -> dict:
    """model_index.json of a tiny folder; a release-layout one loads with diffusers' own pipeline too."""
    if cfg.text_encoders == "one":
        return {"_class_name": "GcoreFlowModel", "transformer": ARCHITECTURES_BY_SHORT[cfg.arch],
                "scheduler": "FlowMatchEulerDiscreteScheduler", "text_encoder": "CLIPTextModelWithProjection",
                "vae": None, "resolution": cfg.resolution}
    import diffusers

    index = {"_class_name": RELEASE_PIPELINES[cfg.arch], "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", ARCHITECTURES_BY_SHORT[cfg.arch]], "vae": ["diffusers", "AutoencoderKL"]}
    for part, class_name in RELEASE_TEXT_PARTS[cfg.arch].items():
        index[part] = ["transformers", class_name]
        index[part.replace("text_encoder", "tokenizer")] = ["transformers", "PreTrainedTokenizerFast"]
    return {**index, "resolution": cfg.resolution, "max_sequence_length": cfg.text_tokens}


@dataclass
class FlowModel:
    """A loaded flow model folder: the transformer (trained), its architecture, text encoder, scheduler, VAE."""

    transformer: nn.Module
    arch: Literal["sd3", "flux"]
    text: PromptEncoder
    scheduler: object
    vae: nn.Module | None
    path: str

    @property
    def latent_channels(self) -> int:
        config = self.transformer.config
        return config.in_channels // 4 if self.arch == "flux" else config.in_channels

    def latent_shape(self, resolution: int, key: str = "sampling.resolution") -> tuple[int, int, int]:
        """``(C, h, w)`` of the latents of a `resolution`-pixel square image (ConfigError naming `key` if the model cannot take it)."""
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        side, rest = divmod(resolution, factor * 2)
        if rest or side < 1:
            raise ConfigError(key, f"{resolution} px is not a multiple of {factor * 2} (the VAE's "
                              f"downsampling {factor} × the transformer's 2×2 patches) for the model at {self.path}")
        limit = getattr(self.transformer.config, "pos_embed_max_size", None)
        if self.arch == "sd3" and limit is not None and side > limit:
            raise ConfigError(key, f"{resolution} px gives {side}×{side} patches, more than the "
                              f"{limit}×{limit} position embeddings of the transformer at {self.path} "
                              f"(at most {limit * factor * 2} px)")
        return self.latent_channels, side * 2, side * 2


def load_flow_model(path: str | Path, text_tokens: int | None = None) -> FlowModel:
    """Load a flow model folder (layout in the module docstring); ModelLoadError names what is wrong.

    `text_tokens`: the padded prompt length of a one-encoder folder (default: its max_position_embeddings),
    or the T5 max_sequence_length of a release folder (default in `gcore_rl.models.flow_text`).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    root = Path(path)
    transformer_class = _check_folder(root)
    try:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
        transformer = getattr(diffusers, transformer_class).from_pretrained(root / "transformer", torch_dtype=torch.float32,
                                                                            low_cpu_mem_usage=False)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler")
        vae = AutoencoderKL.from_pretrained(root / "vae", low_cpu_mem_usage=False) if (root / "vae").is_dir() else None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the diffusion model at '{path}': {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    arch = ARCHITECTURES[transformer_class]
    text = load_text_conditioning(root, transformer.config, arch, text_tokens)
    return FlowModel(transformer=transformer, arch=arch, text=text, scheduler=scheduler, vae=vae, path=str(path))


def transformer_skeleton(path: str | Path) -> nn.Module:
    """The transformer of the flow model folder `path` built on the meta device from its config (no weight read):
    what a check of its modules needs (e.g. LoRA's target modules before any process starts)."""
    import diffusers

    transformer_class = getattr(diffusers, _check_folder(Path(path)))
    with torch.device("meta"):
        return transformer_class.from_config(transformer_class.load_config(Path(path) / "transformer"))


def _check_folder(root: Path) -> str:
    """The transformer class of the folder `root`, after checking what can be checked before loading weights."""
    if not root.is_dir():
        raise ModelLoadError(f"diffusion model '{root}' is not a folder; write one with `gcore-rl init-tiny-diffusion DIR` "
                             "or point model.path at a diffusers model folder (transformer/, scheduler/, text_encoder/, tokenizer/)")
    missing = [part for part in ("transformer", "scheduler", "text_encoder", "tokenizer") if not (root / part).is_dir()]
    if missing:
        kind = "a transformers model (config.json at the top)" if (root / "config.json").is_file() else "not a diffusers model folder"
        raise ModelLoadError(f"'{root}' is {kind}: it lacks {', '.join(m + '/' for m in missing)}; a diffusion policy needs "
                             "transformer/, scheduler/, text_encoder/ and tokenizer/ (diffusers' layout; "
                             "`gcore-rl init-tiny-diffusion DIR` writes one)")
    scheduler_config = read_json(root / "scheduler" / "scheduler_config.json")
    if scheduler_config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ModelLoadError(f"'{root / 'scheduler'}' holds a {scheduler_config.get('_class_name')!r} scheduler; Flow-GRPO "
                             "needs a rectified-flow model, whose scheduler is FlowMatchEulerDiscreteScheduler "
                             "(SD3, FLUX); DDPM/DDIM-style models are not supported")
    if scheduler_config.get("use_dynamic_shifting"):
        raise ModelLoadError(f"'{root / 'scheduler'}' shifts its time grid by the image size (use_dynamic_shifting, as "
                             "FLUX.1-dev's does); the image engine takes a fixed grid (SD3, FLUX.1-schnell) for now")
    transformer_config = read_json(root / "transformer" / "config.json")
    transformer_class = transformer_config.get("_class_name")
    if transformer_class not in ARCHITECTURES:
        raise ModelLoadError(f"'{root / 'transformer'}' is a {transformer_class!r}; supported transformers are "
                             f"{', '.join(ARCHITECTURES)}")
    if transformer_config.get("guidance_embeds"):
        raise ModelLoadError(f"'{root / 'transformer'}' is guidance-distilled (guidance_embeds=true, as FLUX.1-dev): it "
                             "takes a guidance value the image engine does not pass yet; FLUX.1-schnell-style "
                             "transformers (guidance_embeds=false) are supported")
    return transformer_class


def pack_flux(latents: Tensor) -> Tensor:
    """``[B, C, H, W]`` → ``[B, (H/2)(W/2), 4C]``: FLUX's 2×2 patch sequence."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_flux(tokens: Tensor, channels: int, height: int, width: int) -> Tensor:
    """Inverse of `pack_flux`."""
    b = tokens.shape[0]
    return tokens.reshape(b, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, channels, height, width)


def _flux_ids(height: int, width: int, text_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float()
    return image_ids, torch.zeros(text_tokens, 3, device=device)


def predict_velocity(transformer: nn.Module, arch: str, latents: Tensor, t: Tensor, cond: TextCondition) -> Tensor:
    """The model's velocity ``[B, C, H, W]`` at latents ``[B, C, H, W]`` and flow times `t` ``[B]`` in [0, 1].

    SD3 takes diffusers' timestep 1000·t; FLUX takes t itself and its latents as a 2×2-patch sequence.
    """
    if arch == "sd3":
        return transformer(hidden_states=latents, timestep=t * 1000.0, encoder_hidden_states=cond.tokens,
                           pooled_projections=cond.pooled, return_dict=False)[0]
    _, c, h, w = latents.shape
    image_ids, text_ids = _flux_ids(h, w, cond.tokens.shape[1], latents.device)
    out = transformer(hidden_states=pack_flux(latents), timestep=t, encoder_hidden_states=cond.tokens,
                      pooled_projections=cond.pooled, img_ids=image_ids, txt_ids=text_ids, return_dict=False)[0]
    return unpack_flux(out, c, h, w)


def guided_velocity(transformer: nn.Module, arch: str, latents: Tensor, t: Tensor, cond: TextCondition,
                    uncond: TextCondition | None, guidance: float) -> Tensor:
    """Classifier-free guidance: ``v_u + g·(v_c - v_u)`` in one batched call (`uncond` None or g = 1: ``v_c``)."""
    if uncond is None or guidance == 1.0:
        return predict_velocity(transformer, arch, latents, t, cond)
    both = predict_velocity(transformer, arch, torch.cat([latents, latents]), torch.cat([t, t]), TextCondition.cat([cond, uncond]))
    v_cond, v_uncond = both.chunk(2)
    return v_uncond + guidance * (v_cond - v_uncond)

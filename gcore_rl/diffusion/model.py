"""Flow-matching text-to-image models: the folder layout, a tiny random one, loading, and the velocity call.

A model folder follows diffusers' pipeline layout, each part loadable with its own `from_pretrained`::

    transformer/   SD3Transformer2DModel or FluxTransformer2DModel (config.json + safetensors)
    scheduler/     FlowMatchEulerDiscreteScheduler (the rectified-flow time grid)
    text_encoder/  CLIPTextModelWithProjection: per-token states → the transformer's text stream,
                   projected EOS state → its pooled vector
    tokenizer/     the text encoder's tokenizer
    vae/           optional AutoencoderKL; without it the model denoises pixels directly (the tiny models)

`write_tiny_diffusion` builds such a folder with random weights (no network), in either
architecture, so the same loading path serves a tiny test model and a user's SD3/FLUX-shaped folder.
Real SD3/FLUX releases condition on two or three text encoders (CLIP-L, CLIP-G, T5); this loader
uses one (`text_encoder/`), and says so when a folder's transformer expects wider text states.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from gcore_rl.errors import ConfigError, DataError, ModelLoadError
from gcore_rl.models.tiny import TOKENIZER_SIZE, build_char_tokenizer

ARCHITECTURES = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux"}
"""diffusers transformer classes this module can call, by the short name used in code."""


@dataclass
class TinyDiffusionConfig:
    """Shape of the tiny random flow model written by `gcore-rl init-tiny-diffusion`."""

    arch: Literal["sd3", "flux"] = field(default="sd3", metadata={"help": "Transformer: sd3 (SD3Transformer2DModel, MMDiT) or flux (FluxTransformer2DModel)."})
    resolution: int = field(default=16, metadata={"help": "Image side in pixels the model is built for (pixel space: no VAE)."})
    channels: int = field(default=3, metadata={"help": "Image channels."})
    num_layers: int = field(default=2, metadata={"help": "Transformer blocks (flux: this many double-stream and this many single-stream blocks)."})
    num_heads: int = field(default=2, metadata={"help": "Attention heads."})
    head_dim: int = field(default=16, metadata={"help": "Dimensions per attention head (flux: a multiple of 8, for its 3-axis rotary embedding)."})
    text_hidden: int = field(default=32, metadata={"help": "Width of the text encoder (and of the pooled text vector)."})
    text_layers: int = field(default=2, metadata={"help": "Layers of the text encoder."})
    text_tokens: int = field(default=24, metadata={"help": "Longest prompt in tokens (prompts are padded to this)."})
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


def _build_transformer(cfg: TinyDiffusionConfig) -> nn.Module:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    if cfg.arch == "sd3":
        return SD3Transformer2DModel(
            sample_size=cfg.resolution, patch_size=2, in_channels=cfg.channels, out_channels=cfg.channels,
            num_layers=cfg.num_layers, attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
            joint_attention_dim=cfg.text_hidden, caption_projection_dim=cfg.num_heads * cfg.head_dim,
            pooled_projection_dim=cfg.text_hidden, pos_embed_max_size=cfg.resolution // 2)
    quarter = cfg.head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1, in_channels=cfg.channels * 4, out_channels=cfg.channels * 4, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_layers, attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.text_hidden, pooled_projection_dim=cfg.text_hidden, guidance_embeds=False,
        axes_dims_rope=(quarter, quarter, 2 * quarter))


def write_tiny_diffusion(out_dir: str | Path, cfg: TinyDiffusionConfig | None = None) -> Path:
    """Write a tiny random flow model folder (layout in the module docstring) and return its path."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = cfg or TinyDiffusionConfig()
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "right"
    torch.manual_seed(cfg.seed)
    text_config = CLIPTextConfig(
        vocab_size=TOKENIZER_SIZE, hidden_size=cfg.text_hidden, intermediate_size=2 * cfg.text_hidden,
        num_hidden_layers=cfg.text_layers, num_attention_heads=2, max_position_embeddings=cfg.text_tokens,
        projection_dim=cfg.text_hidden, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id)
    CLIPTextModelWithProjection(text_config).save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    _build_transformer(cfg).save_pretrained(out / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out / "scheduler")
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "GcoreFlowModel", "transformer": ARCHITECTURES_BY_SHORT[cfg.arch],
        "scheduler": "FlowMatchEulerDiscreteScheduler", "text_encoder": "CLIPTextModelWithProjection",
        "vae": None, "resolution": cfg.resolution}, indent=2) + "\n")
    return out


ARCHITECTURES_BY_SHORT = {short: name for name, short in ARCHITECTURES.items()}


@dataclass
class TextCondition:
    """Text conditioning of a batch: per-token states ``[B, L, D]`` and pooled vectors ``[B, P]``."""

    tokens: Tensor
    pooled: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: Tensor | list[int]) -> TextCondition:
        return TextCondition(self.tokens[index], self.pooled[index])

    def to(self, device: torch.device) -> TextCondition:
        return TextCondition(self.tokens.to(device), self.pooled.to(device))

    def repeat(self, n: int) -> TextCondition:
        """Each row n times in a row (a prompt's group of n images)."""
        return TextCondition(self.tokens.repeat_interleave(n, dim=0), self.pooled.repeat_interleave(n, dim=0))

    @staticmethod
    def cat(parts: list[TextCondition]) -> TextCondition:
        return TextCondition(torch.cat([p.tokens for p in parts]), torch.cat([p.pooled for p in parts]))


class TextEncoder:
    """The frozen text encoder: prompts → `TextCondition`, every prompt padded to the same length.

    Prompts are tokenized without special tokens, end with the tokenizer's EOS (whose projected
    state is the pooled vector) and are right-padded to `max_tokens`, so a prompt's conditioning
    does not depend on the batch it is in. Results are cached per prompt.
    """

    def __init__(self, model: nn.Module, tokenizer, max_tokens: int):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}

    def token_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        if len(ids) > self.max_tokens:
            raise DataError(f"prompt {prompt!r} has {len(ids)} tokens with its EOS; the text encoder "
                              f"takes at most {self.max_tokens} (its max_position_embeddings): shorten the prompt")
        return ids + [self.tokenizer.pad_token_id] * (self.max_tokens - len(ids))

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> TextCondition:
        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing:
            ids = torch.tensor([self.token_ids(p) for p in missing])
            out = self.model(input_ids=ids, attention_mask=(ids != self.tokenizer.pad_token_id).long())
            for i, prompt in enumerate(missing):
                self._cache[prompt] = (out.last_hidden_state[i], out.text_embeds[i])
        return TextCondition(torch.stack([self._cache[p][0] for p in prompts]),
                             torch.stack([self._cache[p][1] for p in prompts]))


@dataclass
class FlowModel:
    """A loaded flow model folder: the transformer (trained), its architecture, text encoder, scheduler, VAE."""

    transformer: nn.Module
    arch: Literal["sd3", "flux"]
    text: TextEncoder
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
    """Load a flow model folder (layout in the module docstring); ModelLoadError names what is wrong."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"diffusion model '{path}' is not a folder; write one with `gcore-rl init-tiny-diffusion DIR` "
                             "or point model.path at a diffusers model folder (transformer/, scheduler/, text_encoder/, tokenizer/)")
    missing = [part for part in ("transformer", "scheduler", "text_encoder", "tokenizer") if not (root / part).is_dir()]
    if missing:
        kind = "a transformers model (config.json at the top)" if (root / "config.json").is_file() else "not a diffusers model folder"
        raise ModelLoadError(f"'{path}' is {kind}: it lacks {', '.join(m + '/' for m in missing)}; a diffusion policy needs "
                             "transformer/, scheduler/, text_encoder/ and tokenizer/ (diffusers' layout; "
                             "`gcore-rl init-tiny-diffusion DIR` writes one)")
    scheduler_config = _read_json(root / "scheduler" / "scheduler_config.json")
    if scheduler_config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ModelLoadError(f"'{root / 'scheduler'}' holds a {scheduler_config.get('_class_name')!r} scheduler; Flow-GRPO "
                             "needs a rectified-flow model, whose scheduler is FlowMatchEulerDiscreteScheduler "
                             "(SD3, FLUX); DDPM/DDIM-style models are not supported")
    transformer_class = _read_json(root / "transformer" / "config.json").get("_class_name")
    if transformer_class not in ARCHITECTURES:
        raise ModelLoadError(f"'{root / 'transformer'}' is a {transformer_class!r}; supported transformers are "
                             f"{', '.join(ARCHITECTURES)}")
    try:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
        transformer = getattr(diffusers, transformer_class).from_pretrained(root / "transformer", torch_dtype=torch.float32,
                                                                            low_cpu_mem_usage=False)
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler")
        text_model = CLIPTextModelWithProjection.from_pretrained(root / "text_encoder", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
        vae = AutoencoderKL.from_pretrained(root / "vae", low_cpu_mem_usage=False) if (root / "vae").is_dir() else None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the diffusion model at '{path}': {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    arch = ARCHITECTURES[transformer_class]
    if text_model.config.hidden_size != transformer.config.joint_attention_dim:
        raise ModelLoadError(f"the text encoder at '{root / 'text_encoder'}' gives {text_model.config.hidden_size}-wide states "
                             f"but the transformer expects joint_attention_dim={transformer.config.joint_attention_dim} "
                             "(SD3/FLUX releases combine several text encoders, which this loader does not do yet)")
    max_tokens = text_tokens or text_model.config.max_position_embeddings
    return FlowModel(transformer=transformer, arch=arch, text=TextEncoder(text_model, tokenizer, max_tokens),
                     scheduler=scheduler, vae=vae, path=str(path))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc}") from exc


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

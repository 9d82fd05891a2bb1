"""Model shapes: how many parameters, how many bytes of weights and of KV cache per token.

Dense decoder-only transformers only (no mixture of experts), plus the diffusion transformers and
the image reward model of the diffusion workload (`_IMAGE_MODELS`, given directly). The text
presets are built from the public `config.json` of each model (Hugging Face hub pages of
Qwen/Qwen2.5-* and meta-llama/Llama-3.1-*), and their parameter counts are computed from those
shapes by `ModelSpec.from_hf_config`, so they match the published totals (e.g. 7.62 B for Qwen2.5-7B).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gcore_rl.data.balance import SequenceCost
from gcore_rl.errors import ConfigError

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class EngineFit:
    """An engine's costs measured in a run instead of derived from the hardware: a decode step of a batch of
    B sequences takes `step_s + token_s × B` seconds, a prefill `step_s + prefill_token_s × tokens`
    (`gcore_rl.costmodel.replay.fit_engine`, from the engine's own decode rounds).

    On 2 CPU cores the tiny models' decode steps are mostly fixed cost (launches, Python), which the
    roofline formulas do not see; how a step's time divides between the fixed and the per-sequence part
    decides how much a second device saves, so the run's dynamic placement forecasts with these.
    """

    step_s: float = field(metadata={"help": "Seconds of a decode step (or a prefill) that do not grow with the batch."})
    token_s: float = field(metadata={"help": "Seconds a decode step adds per sequence in the batch."})
    prefill_token_s: float = field(default=0.0, metadata={"help": "Seconds a prefill adds per prompt token position."})

    def validate(self) -> None:
        for key in ("step_s", "token_s", "prefill_token_s"):
            if not getattr(self, key) >= 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model.

    Attributes:
        name: label shown in reports.
        params: total parameters (embeddings included), N in the 2N / 6N FLOP formulas.
        layers: decoder layers.
        hidden: width of the residual stream.
        kv_heads: key/value heads (grouped-query attention).
        head_dim: width of one attention head.
        vocab: vocabulary size.
        bytes_per_param: bytes of one weight and one KV element (2 for bf16).
        heads: query heads (0: hidden / head_dim, which holds unless a config sets `head_dim` apart).
        time_scale: multiplies every engine-forward cost of this model (prefill, decode steps, their fixed
            part); 1 = the cost formulas as they are. The runtime's forecast fits it per model from the
            run's measured busy time (`gcore_rl.costmodel.replay.fit_time_scales`).
        engine: measured engine costs (`EngineFit`) that replace the roofline formulas of its prefill and
            decode steps; None = the formulas.
        intermediate: width of the gated MLP (0 = not given; the trainer memory model, `costmodel.memory`,
            needs it).
    """

    name: str = field(metadata={"help": "Label shown in reports."})
    params: float = field(metadata={"help": "Total parameters, embeddings included."})
    layers: int = field(metadata={"help": "Decoder layers."})
    hidden: int = field(metadata={"help": "Width of the residual stream."})
    kv_heads: int = field(metadata={"help": "Key/value heads."})
    head_dim: int = field(metadata={"help": "Width of one attention head."})
    vocab: int = field(metadata={"help": "Vocabulary size."})
    bytes_per_param: int = field(default=2, metadata={"help": "Bytes per weight and per KV element (2 = bf16)."})
    heads: int = field(default=0, metadata={"help": "Query heads (0 = hidden / head_dim)."})
    time_scale: float = field(default=1.0, metadata={"help": "Multiplies this model's engine-forward costs (prefill, decode); 1 = the cost formulas as they are."})
    engine: EngineFit | None = field(default=None, metadata={"help": "Engine costs measured in a run (step_s, token_s, prefill_token_s) in place of the roofline formulas; null = the formulas."})
    intermediate: int = field(default=0, metadata={"help": "Width of the gated MLP (0 = not given; the trainer memory model needs it)."})

    @property
    def query_heads(self) -> int:
        """Query heads: `heads`, or hidden / head_dim when not given."""
        return self.heads or self.hidden // self.head_dim

    def validate(self) -> None:
        for key in ("params", "layers", "hidden", "kv_heads", "head_dim", "vocab", "bytes_per_param"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if not self.time_scale > 0:
            raise ConfigError("time_scale", f"must be positive, got {self.time_scale}")

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights: params x bytes_per_param."""
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache one token occupies: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def sequence_cost(self) -> SequenceCost:
        """The runtime's estimate of one row's training FLOPs (`gcore_rl.data.balance.SequenceCost`:
        6 N L + 6 layers hidden L^2), with N = `params`, the N of every other FLOP count here. (The
        runtime's `SequenceCost.from_config` leaves the input embeddings out of N: 7.07 B rather than
        7.62 B for Qwen2.5-7B, so there the attention term weighs 8 % more against the weights.)"""
        return SequenceCost(params=float(self.params), layers=self.layers, hidden=self.hidden)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None,
                       bytes_per_param: int | None = None) -> ModelSpec:
        """Read a Hugging Face `config.json` dict of a dense Llama / Qwen2-style model.

        Parameters are counted from the shapes: embeddings (vocab x hidden, once more for an untied
        LM head), per layer the q/k/v/o projections (with q/k/v biases for Qwen2, or when
        `attention_bias` is set), the gated MLP (3 x hidden x intermediate_size) and two RMSNorm
        vectors, plus the final norm. `bytes_per_param` defaults to the config's dtype (2 when
        it has none).
        """
        try:
            layers = int(config["num_hidden_layers"])
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            intermediate = int(config["intermediate_size"])
            vocab = int(config["vocab_size"])
        except KeyError as exc:
            raise ConfigError("hf_config", f"config.json lacks {exc.args[0]!r}") from None
        if any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ConfigError("hf_config", "mixture-of-experts models are not modelled (dense models only)")
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        model_type = str(config.get("model_type", ""))
        qkv_bias = bool(config.get("attention_bias", model_type.startswith("qwen2")))
        mlp_bias = bool(config.get("mlp_bias", False))
        tied = bool(config.get("tie_word_embeddings", False))
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        if qkv_bias:
            attention += q_width + 2 * kv_width
        mlp = 3 * hidden * intermediate + (2 * intermediate + hidden if mlp_bias else 0)
        per_layer = attention + mlp + 2 * hidden
        params = layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)
        if bytes_per_param is None:
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
            bytes_per_param = _DTYPE_BYTES.get(dtype, 2)
        label = name or str(config.get("_name_or_path") or model_type or "model")
        return cls(name=label, params=float(params), layers=layers, hidden=hidden, kv_heads=kv_heads,
                   head_dim=head_dim, vocab=vocab, bytes_per_param=bytes_per_param, heads=heads,
                   intermediate=intermediate)


def _hf(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool,
        model_type: str) -> dict[str, Any]:
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "vocab_size": vocab,
            "tie_word_embeddings": tied, "model_type": model_type, "dtype": "bfloat16"}


_SHAPES: dict[str, dict[str, Any]] = {
    # layers, hidden, heads, kv heads, intermediate, vocab, tied embeddings
    "Qwen2.5-0.5B": _hf(24, 896, 14, 2, 4864, 151936, True, "qwen2"),
    "Qwen2.5-1.5B": _hf(28, 1536, 12, 2, 8960, 151936, True, "qwen2"),
    "Qwen2.5-3B": _hf(36, 2048, 16, 2, 11008, 151936, True, "qwen2"),
    "Qwen2.5-7B": _hf(28, 3584, 28, 4, 18944, 152064, False, "qwen2"),
    "Qwen2.5-14B": _hf(48, 5120, 40, 8, 13824, 152064, False, "qwen2"),
    "Qwen2.5-32B": _hf(64, 5120, 40, 8, 27648, 152064, False, "qwen2"),
    "Qwen2.5-72B": _hf(80, 8192, 64, 8, 29568, 152064, False, "qwen2"),
    # Qwen/Qwen2-VL-7B-Instruct's language model (text_config); its vision tower is priced by workload.images
    "Qwen2-VL-7B": _hf(28, 3584, 28, 4, 18944, 152064, False, "qwen2"),
    "Llama-3.1-8B": _hf(32, 4096, 32, 8, 14336, 128256, False, "llama"),
    "Llama-3.1-70B": _hf(80, 8192, 64, 8, 28672, 128256, False, "llama"),
}

# Diffusion transformers and an image reward model, for the diffusion workload (gcore_rl.costmodel.diffusion).
# A DiT has no vocabulary and no KV cache: `vocab` is a placeholder (1) and the KV figures describe its
# attention width only. `layers` counts the blocks with one joint attention over image + text tokens
# (the L of the 4 L H S^2 attention term). Parameter counts are the published totals (model cards);
# layers and widths are those of each transformer/config.json on the Hugging Face hub.
_IMAGE_MODELS: dict[str, ModelSpec] = {
    # stabilityai/stable-diffusion-3.5-medium: MMDiT-X, 2.5 B; 24 blocks, 24 heads x 64
    "SD3.5-Medium": ModelSpec("SD3.5-Medium", params=2.5e9, layers=24, hidden=1536, kv_heads=24, head_dim=64, vocab=1),
    # black-forest-labs/FLUX.1-dev: 12 B; 19 double-stream + 38 single-stream blocks, 24 heads x 128
    "FLUX.1-dev": ModelSpec("FLUX.1-dev", params=12e9, layers=57, hidden=3072, kv_heads=24, head_dim=128, vocab=1),
    # laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the backbone of PickScore: 0.99 B (vision tower 32 layers of
    # width 1280, 16 heads x 80; text tower 24 layers of width 1024); priced with the vision tower's shape
    "CLIP-ViT-H-14": ModelSpec("CLIP-ViT-H-14", params=0.986e9, layers=32, hidden=1280, kv_heads=16, head_dim=80,
                               vocab=49408),
}

MODELS: dict[str, ModelSpec] = {name: ModelSpec.from_hf_config(cfg, name=name) for name, cfg in _SHAPES.items()}
MODELS.update(_IMAGE_MODELS)
"""Presets by name (shapes from each model's public config.json)."""


def model_spec_from_folder(path: str, key: str, hint: str = "") -> ModelSpec:
    """The shape of the Hugging Face model folder `path` (its config.json); `ConfigError(key, ...)`
    when it has none (`hint`: what to do, appended to the message)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(key, f"{path} has no config.json to read the model's shape from{hint}")
    return ModelSpec.from_hf_config(json.loads(config.read_text()), name=Path(path).name)


def model_preset(name: str) -> ModelSpec:
    """The preset called `name` (raises `ConfigError("preset", ...)` for an unknown name)."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError("preset", f"unknown model {name!r}; presets are {', '.join(MODELS)}") from None

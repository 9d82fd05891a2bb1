"""Load policy, reference and tokenizer from a local Hugging Face directory (never the hub)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from gcore_rl.errors import ConfigError, ModelLoadError

DTypeName = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """Where the policy comes from and how it is held in memory."""

    path: str = field(default="runs/tiny-sft", metadata={"help": "Local Hugging Face model directory (config.json + safetensors + tokenizer files)."})
    dtype: DTypeName = field(default="float32", metadata={"help": "Parameter dtype of the trained policy (master weights stay fp32 unless this is changed)."})
    attn_implementation: Literal["sdpa", "eager"] = field(default="sdpa", metadata={"help": "Attention kernel passed to transformers."})

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path", "must name a local model directory")


def quiet_hf_libraries() -> None:
    """Never reach the hub at run time, and keep library progress bars out of the job's output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name from the config to the torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_model_dir(path: str | Path) -> Path:
    """Return `path` if it looks like a local HF causal-LM folder, else raise ModelLoadError."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model path '{model_dir}' does not exist or is not a directory; create a tiny one with "
            f"`gcore-rl init-tiny {model_dir}` or point `model.path` at a local Hugging Face model folder"
        )
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model path '{model_dir}' has no config.json, so it is not a Hugging Face model folder")
    try:
        json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"model config '{config_file}' is not valid JSON: {exc}") from exc
    return model_dir


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model folder; prompts are left-padded for generation."""
    model_dir = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from '{model_dir}': {exc}") from exc
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in '{model_dir}' has no eos token; generation could never stop")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                   device: torch.device | str = "cpu") -> PreTrainedModel:
    """Load a causal LM from a local folder onto `device` (weights only from local files)."""
    model_dir = check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load a causal LM from '{model_dir}': {exc}") from exc
    return model.to(device)


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write model (safetensors) and tokenizer so `from_pretrained(out_dir)` reloads both."""
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    pin_tokenizer_class(out)
    return out


def pin_tokenizer_class(model_dir: Path) -> None:
    """Make `AutoTokenizer` load a saved fast tokenizer exactly as written.

    Without an explicit class, `AutoTokenizer` may substitute the architecture's own tokenizer
    class, which replaces the pre-tokenizer (for the tiny character tokenizer: spaces vanish).
    """
    path = model_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2))

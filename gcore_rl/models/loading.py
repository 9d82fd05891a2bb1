"""Load policy, reference and tokenizer from a local Hugging Face directory (never the hub)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.lora import LoraSettings

DTypeName = Literal["float32", "bfloat16", "float16"]
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
"""What `from_pretrained` raises for a folder it cannot load (re-raised as ModelLoadError naming the folder)."""
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Keys of a model's config.json that give its longest sequence, in the order they are tried."""


@dataclass
class ModelConfig:
    """Where the policy comes from and how it is held in memory."""

    path: str = field(default="runs/tiny-sft", metadata={"help": "Local Hugging Face model directory (config.json + safetensors + tokenizer files)."})
    dtype: DTypeName = field(default="float32", metadata={"help": "Parameter dtype of the trained policy (master weights stay fp32 unless this is changed)."})
    attn_implementation: Literal["sdpa", "eager"] = field(default="sdpa", metadata={"help": "Attention kernel passed to transformers."})
    lora: LoraSettings = field(default_factory=LoraSettings, metadata={"help": "Train low-rank adapters (peft) instead of every parameter."})

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
    if not config_file.is_file() and (model_dir / ADAPTER_CONFIG).is_file():
        raise ModelLoadError(f"model path '{model_dir}' holds LoRA adapters ({ADAPTER_CONFIG}) without their base "
                             f"model ({adapter_base(model_dir)}); point the config at the base model's folder, or "
                             "at a folder with the adapters merged into it (what `gcore-rl export` writes from a LoRA checkpoint)")
    if not config_file.is_file():
        raise ModelLoadError(f"model path '{model_dir}' has no config.json, so it is not a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"model config '{config_file}' is not valid JSON: {exc}; save the model again or "
                             "restore the file") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"model config '{config_file}' is not a JSON object; save the model again or restore the file")
    check_weight_files(model_dir)
    return model_dir


ADAPTER_CONFIG = "adapter_config.json"
"""What marks a folder of peft adapters (with adapter_model.safetensors), which is no model on its own."""


def adapter_base(adapter_dir: Path) -> str:
    """The base model an adapter folder names (`base_model_name_or_path`), as words for a message."""
    try:
        base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return f"its base is '{base}'" if isinstance(base, str) and base else "it names no base"


def check_weight_files(model_dir: Path) -> None:
    """Raise ModelLoadError unless the folder has weights and every safetensors file in it is whole.

    Reads only each file's header, which must describe tensors that exactly cover the file, so a
    truncated or overwritten file is found in milliseconds by the driver, before any process
    starts, instead of by every rank's `from_pretrained`. Corruption inside the tensor data itself
    cannot be seen without reading it (safetensors keeps no checksums). PyTorch ``.bin`` weights
    are left to transformers.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files and not any(model_dir.glob("*.bin")):
        raise ModelLoadError(f"model folder '{model_dir}' has no weights (model.safetensors); save the model again "
                             "with save_pretrained, or create a tiny one with `gcore-rl init-tiny`")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"weights index '{index}' is damaged ({_one_line(exc)}); copy or save "
                                 "the model again") from exc
        missing = sorted(name for name in shards if not (model_dir / name).is_file())
        if missing:
            raise ModelLoadError(f"weights index '{index}' lists {', '.join(missing)}, which the folder lacks; copy "
                                 "the missing files or save the model again")
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"weights file '{file}' is damaged ({_one_line(exc)}): it is truncated or not a safetensors "
                                 "file; copy or save the model again, or point the config at another model folder") from exc


def read_model_config(path: str | Path) -> dict:
    """The config.json of the model folder `path`, as a dict (no model is built)."""
    return json.loads((check_model_dir(path) / "config.json").read_text(encoding="utf-8"))


def context_limit(path: str | Path) -> int | None:
    """Longest sequence (prompt + completion tokens) the model in `path` accepts, from its config.json.

    None when the config names no limit. Multimodal configs keep it under ``text_config``.
    """
    config = read_model_config(path)
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model folder; prompts are left-padded for generation."""
    model_dir = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the tokenizer libraries raise many types (even bare Exception) for bad files
        raise ModelLoadError(f"could not load a tokenizer from '{model_dir}' ({_one_line(exc)}); the folder needs the "
                             "tokenizer files that save_pretrained writes (tokenizer.json, tokenizer_config.json)") from exc
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in '{model_dir}' has no eos token; generation could never stop")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                   device: torch.device | str = "cpu") -> PreTrainedModel:
    """Load a causal LM from a local folder onto `device` (weights only from local files): a text model,
    or a vision-language model (a config with a `vision_config`: `AutoModelForImageTextToText`, which
    generates text like a causal LM and also reads images).

    Every parameter and buffer gets storage of its own (`own_storage`), so the model computes the
    same bits however the loader laid out its tensors.
    """
    model_dir = check_model_dir(path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    auto = AutoModelForImageTextToText if isinstance(config.get("vision_config"), dict) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
        )
    except LOAD_ERRORS as exc:
        raise ModelLoadError(f"could not load a causal LM from '{model_dir}' ({_one_line(exc)}); point the config "
                             "at a folder saved with save_pretrained from a causal LM") from exc
    return own_storage(model.to(device))


def own_storage(model: torch.nn.Module) -> torch.nn.Module:
    """Move each parameter and buffer of `model` into a fresh allocation of its own, in place; returns `model`.

    Loaded weights can be views at arbitrary offsets into one file-sized buffer, and CPU matrix
    kernels round differently on misaligned operands than on the allocator's aligned blocks. Without
    this an engine that later reloads its weights into fresh storage (after sleeping) would give
    other log-probs (in the last bit) than one that still holds the loader's layout, and a run
    resumed from a checkpoint would drift from the uninterrupted one. Tied tensors stay tied.
    """
    fresh: dict[tuple, torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in fresh:
            fresh[key] = tensor.data.clone(memory_format=torch.contiguous_format)
        tensor.data = fresh[key]
    return model


def _one_line(exc: BaseException) -> str:
    """`exc` as ``Type: message`` on one line (library messages often span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(":")


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path,
                   state_dict: dict | None = None) -> Path:
    """Write model (safetensors) and tokenizer so `from_pretrained(out_dir)` reloads both.

    `state_dict` replaces the model's own weights (e.g. full tensors gathered from an FSDP-sharded model).
    A vision-language model's image processor comes along from the folder the model was loaded from.
    """
    out = Path(out_dir)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    return save_beside_weights(tokenizer, out, Path(getattr(model, "name_or_path", "") or ""))


def save_beside_weights(tokenizer: PreTrainedTokenizerBase, out: Path, source: Path) -> Path:
    """Complete the model folder `out` (weights and config written) with the tokenizer and, for a
    vision-language model, the image processor's files from the folder `source` it was loaded from."""
    tokenizer.save_pretrained(out)
    pin_tokenizer_class(out)
    copy_processor_files(source, out)
    return out


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""The files of a vision-language model's image processor: they go wherever its weights go."""


def copy_processor_files(source: Path, out: Path) -> None:
    """Copy the image processor's files of the model folder `source` (the folder the model was loaded from:
    `model.name_or_path`) into `out`, unless `out` has them; a text model's folder has none."""
    if not str(source) or not source.is_dir() or source.resolve() == out.resolve():
        return
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy2(source / name, out / name)


def pin_tokenizer_class(model_dir: Path) -> None:
    """Make `AutoTokenizer` load a saved fast tokenizer exactly as written.

    Without an explicit class, `AutoTokenizer` may substitute the architecture's own tokenizer
    class, which replaces the pre-tokenizer (for the tiny character tokenizer: spaces vanish).
    """
    path = model_dir / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2))

"""Export a LoRA policy's checkpoint: the adapters merged into the base (a plain Hugging Face folder, by
default) or the adapters alone (a `peft` folder that `PeftModel.from_pretrained(base, folder)` loads).

A LoRA checkpoint holds only the adapters and their optimiser state; the base is a frozen model the
manifest records by path and checksum (role ``base``). Export reads the base from there, refusing one
whose weights changed since the save, wraps it with the saved `model.lora` settings, loads the adapters
from the DCP folder, and writes the result; the written tensors are read back and compared, as for a
full checkpoint (`checkpoint.export`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from gcore_rl.checkpoint import layout
from gcore_rl.checkpoint.export import (
    check_export,
    check_written,
    load_policy_weights,
    saved_tokenizer,
    unfit,
)
from gcore_rl.checkpoint.manifest import frozen_model, read_manifest
from gcore_rl.configlib import from_dict
from gcore_rl.errors import CheckpointError, ConfigError, GcoreError
from gcore_rl.models.loading import load_causal_lm, save_beside_weights, save_model_dir
from gcore_rl.models.lora import LoraSettings, apply_lora, is_adapter_name

BASE_ROLE = "base"
"""The manifest's role of a LoRA policy's frozen base model (`config.frozen_model_paths`)."""
CRITIC_BASE_ROLE = "critic_base"
"""The manifest's role of the folder a LoRA critic's frozen body comes from."""


def saved_lora(folder: str | Path) -> LoraSettings | None:
    """The `model.lora` settings of the job that saved checkpoint `folder`, or None when it trained every
    parameter (or its config cannot be read: the full export's checks then speak)."""
    try:
        data = yaml.safe_load((Path(folder) / layout.CONFIG).read_text(encoding="utf-8"))
        settings = from_dict(LoraSettings, (data.get("model") or {}).get("lora"), "model.lora")
    except (OSError, ValueError, AttributeError, yaml.YAMLError, GcoreError):
        return None
    return settings if settings.enabled else None


def base_model_dir(folder: Path) -> Path:
    """The LoRA checkpoint's base model folder, checked against the checksum the manifest recorded."""
    recorded = [frozen for frozen in read_manifest(folder).frozen if frozen.role == BASE_ROLE]
    if not recorded:
        raise unfit(folder, f"its manifest records no {BASE_ROLE} model, which a LoRA checkpoint's adapters apply to")
    base = recorded[0]
    if not Path(base.path).is_dir() or frozen_model(BASE_ROLE, base.path).sha256 != base.sha256:
        raise unfit(folder, f"the base model '{base.path}' is missing or has other weights than when it was saved "
                             f"(checksum in {folder / layout.MANIFEST}); the adapters only mean something on it")
    return Path(base.path)


def export_lora_checkpoint(checkpoint: str | Path, out_dir: str | Path, adapter: bool = False) -> Path:
    """Write a LoRA checkpoint's policy to `out_dir`: merged into the base (default) or, with `adapter`, the
    adapters as a `peft` folder naming the base. Returns `out_dir`."""
    folder, out = Path(checkpoint), Path(out_dir)
    settings = checked_export_settings(folder, out, adapter, lora_only=True)
    base_dir = base_model_dir(folder)
    model, adapters = load_adapters(load_causal_lm(base_dir), settings, folder)
    tokenizer = saved_tokenizer(folder)
    if adapter:
        write_adapter_folder(model, adapters, out, folder)
        save_beside_weights(tokenizer, out, base_dir)
        return out
    merged = model.merge_and_unload()
    save_model_dir(merged, tokenizer, out)
    check_written(merged, out, folder)
    return out


def checked_export_settings(folder: Path, out: Path, adapter: bool, lora_only: bool = False) -> LoraSettings | None:
    """The checks of an export of checkpoint `folder` to `out` (`check_export`, and with `adapter` an `out` without
    adapters); the saved `model.lora` settings, None for a full checkpoint, which `adapter` or `lora_only` refuse."""
    if adapter and (out / "adapter_config.json").exists():
        raise ConfigError("OUT_DIR", f"'{out}' already holds adapters; choose a new directory or remove the old one")
    check_export(folder, out)
    settings = saved_lora(folder)
    if (adapter or lora_only) and settings is None:
        raise unfit(folder, "its job trained every parameter (model.lora.enabled is false), so there are no adapters "
                            "to write; export it without --adapter")
    return settings


def load_adapters(model: torch.nn.Module, settings: LoraSettings, folder: Path
                  ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """`model` (the base) wrapped with the saved `settings`, the checkpoint's adapters loaded into it; and the
    adapters by name."""
    wrapped = apply_lora(model, settings)
    adapters = {name: param for name, param in wrapped.named_parameters() if is_adapter_name(name)}
    load_policy_weights(wrapped, folder, target=adapters)
    return wrapped, adapters


def write_adapter_folder(model: torch.nn.Module, adapters: dict[str, torch.Tensor], out: Path, folder: Path) -> None:
    """The adapters of the peft-wrapped `model` as a `peft` folder `out`, read back and checked."""
    model.save_pretrained(out, safe_serialization=True)
    check_written_adapters(adapters, out, folder)


def check_written_adapters(adapters: dict[str, torch.Tensor], out: Path, folder: Path) -> None:
    """The adapter file holds exactly the loaded adapters (peft writes them without the adapter's name)."""
    files = sorted(out.glob("adapter_model*.safetensors"))
    written: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            written.update({name: handle.get_tensor(name) for name in handle.keys()})
    expected = {name.replace(".default.", "."): tensor.detach() for name, tensor in adapters.items()}
    if written.keys() != expected.keys() or any(not torch.equal(written[n], expected[n]) for n in expected):
        raise CheckpointError(f"the export of '{folder}' to '{out}' did not write the adapters it loaded; remove the "
                              "folder and export again, on a disk with room for them")

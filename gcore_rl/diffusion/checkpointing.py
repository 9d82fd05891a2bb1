"""Exporting a diffusion job's checkpoint as a diffusers folder (`gcore-rl export`).

A diffusion job saves and resumes through the language jobs' machinery (`controller/checkpointing.py`,
`controller/run_state.py`, `runtime/resume.py`); its samples' trajectories are written beside the controller's
JSON (`diffusion/samples.py`). What is its own is the export: the trained transformer from the DCP
folder, the untrained parts copied from the job's start model. A LoRA job's checkpoint holds the adapters only
(`model.lora`): they are merged into the start transformer (checked against the checksum the manifest recorded),
or with `adapter` written alone as a `peft` folder (`PeftModel.from_pretrained(transformer, folder)` loads it).
"""

from __future__ import annotations

from pathlib import Path

from gcore_rl.checkpoint.adapters import (
    base_model_dir,
    checked_export_settings,
    load_adapters,
    write_adapter_folder,
)
from gcore_rl.checkpoint.export import check_written, load_policy_weights, unfit
from gcore_rl.checkpoint.layout import CONFIG
from gcore_rl.errors import GcoreError


def export_flow_checkpoint(checkpoint: str | Path, out_dir: str | Path, adapter: bool = False) -> Path:
    """Write a diffusion job's verified checkpoint as a diffusers folder: the trained transformer from the DCP
    folder (a LoRA job's adapters merged into its start transformer), every other part (scheduler, text encoders,
    tokenizers, VAE) copied from the job's start model (`model.path` of the checkpoint's config, which the
    checkpoint refers to rather than copies); with `adapter`, a LoRA job's adapters alone as a `peft` folder.
    Checks and errors as `checkpoint.export.export_checkpoint`'s."""
    from gcore_rl.configlib import load_config
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.models.flow import load_flow_model
    from gcore_rl.training.flow_sft import save_flow_model

    folder, out = Path(checkpoint), Path(out_dir)
    settings = checked_export_settings(folder, out, adapter)
    try:
        source = load_config(FlowGrpoJobConfig, folder / CONFIG, []).model.path
        model = load_flow_model(source)
    except GcoreError as exc:
        raise unfit(folder, f"the diffusion model its config names cannot be loaded ({' '.join(str(exc).split())}); "
                            "export reads the parts that are not trained from there") from None
    transformer = model.transformer
    if settings is None:
        load_policy_weights(transformer, folder)
    else:
        base_model_dir(folder)  # the start transformer the adapters were trained on, unchanged since
        wrapped, adapters = load_adapters(transformer, settings, folder)
        if adapter:
            write_adapter_folder(wrapped, adapters, out, folder)
            return out
        transformer = wrapped.merge_and_unload()
    save_flow_model(transformer, source, out)
    check_written(transformer, out / "transformer", folder)
    return out

"""Exporting a diffusion job's checkpoint as a diffusers folder (`gcore-rl export`).

A diffusion job saves and resumes through the language jobs' machinery (`controller/checkpointing.py`,
`controller/run_state.py`, `runtime/resume.py`); its samples' trajectories are written beside the controller's
JSON (`diffusion/samples.py`). What is its own is the export: the trained transformer from the DCP
folder, the untrained parts copied from the job's start model.
"""

from __future__ import annotations

from pathlib import Path

from gcore_rl.checkpoint.export import check_export, check_written, load_policy_weights, unfit
from gcore_rl.checkpoint.layout import CONFIG
from gcore_rl.errors import GcoreError


def export_flow_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a diffusion job's verified checkpoint as a diffusers folder: the trained transformer from the DCP
    folder, every other part (scheduler, text encoders, tokenizers, VAE) copied from the job's start model
    (`model.path` of the checkpoint's config, which the checkpoint refers to rather than copies). Checks and
    errors as `checkpoint.export.export_checkpoint`'s."""
    from gcore_rl.configlib import load_config
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.models.flow import load_flow_model
    from gcore_rl.training.flow_sft import save_flow_model

    folder, out = Path(checkpoint), Path(out_dir)
    check_export(folder, out)
    try:
        source = load_config(FlowGrpoJobConfig, folder / CONFIG, []).model.path
        model = load_flow_model(source)
    except GcoreError as exc:
        raise unfit(folder, f"the diffusion model its config names cannot be loaded ({' '.join(str(exc).split())}); "
                            "export reads the parts that are not trained from there") from None
    load_policy_weights(model.transformer, folder)
    save_flow_model(model.transformer, source, out)
    check_written(model.transformer, out / "transformer", folder)
    return out
